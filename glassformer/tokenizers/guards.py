"""A tokenizer file is input a user hands over: reading it, and encoding with the regexes it
brings, end in one error line naming the file, never a traceback or a Rust panic's report.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class TokenizerRegexError(ValueError):
    """A tokenizer file's own regex fails on a text (the file is at fault, not the text)."""


def _hf_encode(
    hf: HFTokenizer, text: str, add_special_tokens: bool, source: Path | None = None
) -> list[int]:
    """hf.encode(text).ids, with a one-line error for text that is not valid Unicode (a lone
    surrogate, which is what undecodable bytes become in argv or with errors='surrogateescape'),
    and for a regex in the file (source) that gives up on the text."""
    try:
        # encode_batch, not encode: only the batch call releases the GIL, so a server thread
        # tokenizing a 10 MB prompt (6 s) does not stall the event loop beside it.
        return hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    except TypeError:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}") from None
        position = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
        raise ValueError(
            f"text has a lone surrogate {text[position]!r} at index {position}, which is "
            f"not encodable as UTF-8; fix the text's decoding (e.g. errors='replace')"
        ) from None
    except BaseException as err:
        if type(err).__name__ != "PanicException":
            raise
        raise _panic_error(err, source) from None


def _panic_error(panic: BaseException, source: Path | None) -> TokenizerRegexError:
    """The one line for a Rust panic inside encode, which pyo3 raises as a BaseException (not an
    Exception). A pre-tokenizer like Split("(a+)+$") backtracks without end on "aaa...ab"; the
    Oniguruma engine gives up at its retry limit and panics."""
    detail = " ".join(str(panic).split())
    where = str(source) if source is not None else "the tokenizer"
    return TokenizerRegexError(
        f"{where}: the tokenizer's pre-tokenizer or normalizer regex fails on this text "
        f"({detail}): the tokenizer.json is broken or hostile; use another model file"
    )


# Rust's panic hook writes its report straight to file descriptor 2 before pyo3 raises the
# panic in Python: a blank line, "thread '<unnamed>' (PID) panicked at FILE:LINE:COL:", the
# message, then "note: run with `RUST_BACKTRACE=1` ..." or a backtrace that (unless
# RUST_BACKTRACE=full) ends in a "note: ..." line.
_PANIC_HEADER = re.compile(rb"thread '[^'\n]*'(?: \(\d+\))? panicked at ")


@contextlib.contextmanager
def panic_reports_hidden() -> Iterator[None]:
    """Keep the report of a Rust panic inside the block off the terminal (the panic's message
    is in the one error line that TokenizerRegexError makes); anything else the block writes to
    stderr is passed on when it ends. For a command's main thread only: file descriptor 2 is
    the process's, so nothing else may write to stderr while the block runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                captured.seek(0)
                kept = _without_panic_reports(captured.read())
                if kept:
                    os.write(2, kept)
    finally:
        os.close(saved)


def _without_panic_reports(written: bytes) -> bytes:
    kept: list[bytes] = []
    in_report = False
    for line in written.splitlines(keepends=True):
        if _PANIC_HEADER.match(line):
            in_report = True
            if kept and not kept[-1].strip():
                kept.pop()  # the blank line the hook writes first
        elif in_report and line.startswith(b"note: "):
            in_report = False
            continue
        if not in_report:
            kept.append(line)
    return b"".join(kept)


def read_tokenizer_json(path: Path, fix: str) -> HFTokenizer:
    """A Hugging Face tokenizer.json, or one ValueError line naming the file."""
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as error:
        if type(error) is not Exception:
            raise  # the Rust side reports bad files as a bare Exception; anything else is a bug
        message = " ".join(str(error).split())
        raise ValueError(
            f"{path} is not a Hugging Face tokenizer.json ({message}): {fix}"
        ) from None
