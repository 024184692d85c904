"""Streaming detokenization (seed 002 "token ≠ 字"): a byte-level BPE may split one Chinese
character or emoji across several tokens, so text streamed out of a generator must hold back
half-finished characters until their last byte arrives (and drop one that never completes, when
a reply is cut there), and text that could still begin a stop string until it no longer can.
TokenBytes gives each token's exact bytes, which is what tells the two kinds of U+FFFD apart."""

from __future__ import annotations

import codecs
import functools
import re
from collections.abc import Sequence

from glassformer.tokenizers import REPLACEMENT_CHAR, Tokenizer, byte_level_chars

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens (Llama)


@functools.cache
def _byte_of() -> dict[str, int]:
    return {char: byte for byte, char in byte_level_chars().items()}


class TokenBytes:
    """The bytes a token stands for: a byte-level BPE's entry mapped back from GPT-2's byte
    alphabet ("Ġ" is a space; half a character is its lone bytes), a byte-fallback token
    ("<0xE4>") as its byte, any other token as the UTF-8 of its text. `tokenizer.decode`
    cannot say this: it writes every incomplete or invalid byte sequence as the same U+FFFD."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        hf = getattr(tokenizer, "hf", None)
        self._hf = hf
        self._byte_level = hf is not None and type(hf.decoder).__name__ == "ByteLevel"

    def __call__(self, token_id: int) -> bytes:
        spelled = self._hf.id_to_token(int(token_id)) if self._hf is not None else None
        if spelled is not None:
            byte_of = _byte_of()
            if self._byte_level and all(c in byte_of for c in spelled):
                return bytes(byte_of[c] for c in spelled)
            fallback = _BYTE_FALLBACK.fullmatch(spelled)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
        return self.tokenizer.decode([token_id]).encode("utf-8")  # an added token spelled as text

    def text(self, token_id: int) -> str:
        """The token as logprobs show it: its text, or for bytes that are not UTF-8 by
        themselves (part of a character), "bytes:" and their escapes, as OpenAI's legacy
        completions write them ("bytes:\\xe4\\xb8"): never a U+FFFD that hides which bytes."""
        return token_text(self(token_id))


def token_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + data.decode("utf-8", errors="backslashreplace")


def ends_mid_character(data: bytes) -> bool:
    """True if `data` ends in the first bytes of a UTF-8 character (more bytes could complete
    it), not in a complete character or an invalid byte."""
    _, consumed = codecs.utf_8_decode(data, "replace", False)
    return consumed < len(data)


class IncrementalDecoder:
    """Turn a stream of token ids into text pieces without ever emitting half a character.

    Like vLLM's detokenizer, it decodes only a short window: the tokens of the last emitted
    piece (context, so decoders that look at neighbours still agree with a full decode) plus
    the tokens not yet emitted. Lossy UTF-8 decoding is prefix-stable: appending bytes can
    only change the *last* character, which is a U+FFFD while that character is incomplete.
    So everything before a trailing U+FFFD is final, and `"".join(pushes) + flush()` equals
    `tokenizer.decode(all_ids)`. The window only grows while tokens straddle characters, and
    BPE never merges across a pre-tokenizer split (space, punctuation), so the work per push
    is bounded by the text's longest word, not by the length of the stream.
    """

    def __init__(self, tokenizer: Tokenizer, token_bytes: TokenBytes | None = None) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes or TokenBytes(tokenizer)
        self._window: list[int] = []  # context tokens, then tokens not yet fully emitted
        self._n_context = 0  # how many leading tokens of _window are context
        self._emitted = 0  # characters of decode(_window) already returned

    def push(self, token_id: int) -> str:
        window = [*self._window, int(token_id)]
        text = self.tokenizer.decode(window)  # raises on a bad id before any state changes
        self._window = window
        complete = not text.endswith(REPLACEMENT_CHAR)
        stable = text if complete else text[:-1]
        piece = stable[self._emitted :]
        self._emitted = max(self._emitted, len(stable))
        if complete:
            # A character boundary: keep only the tokens since the previous boundary as context.
            self._window = self._window[self._n_context :]
            self._n_context = len(self._window)
            self._emitted = len(self.tokenizer.decode(self._window))
        return piece

    def flush(self) -> str:
        """Return whatever is held back (e.g. a truncated character as U+FFFD) and reset."""
        piece = self.tokenizer.decode(self._window)[self._emitted :]
        self._window, self._n_context, self._emitted = [], 0, 0
        return piece

    def finish(self) -> str:
        """flush() at the end of a reply: what is held back, less a last character the reply
        was cut in the middle of (max_tokens, a stop token), which would show as U+FFFD and
        can never complete. A U+FFFD that stands for invalid bytes, or for the character
        U+FFFD itself, stays: so the text is `tokenizer.decode(ids)` with only an incomplete
        tail dropped."""
        cut = ends_mid_character(b"".join(map(self.token_bytes, self._window)))
        piece = self.flush()
        return piece[:-1] if cut and piece.endswith(REPLACEMENT_CHAR) else piece


class StopStrings:
    """Watch streamed text for stop strings (OpenAI's `stop`): `push` returns the part of a new
    piece that can be shown now, holding back the longest tail that could still begin a stop
    string; once a stop string appears the text ends where it begins (the stop string is not
    part of the reply) and `stopped` is set. At the end of a generation that did not stop here
    (length, eos), `flush` returns the held tail. So `"".join(pushes) + flush()` is the whole
    text cut at its first stop string, and nothing shown is ever taken back.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = tuple(stops)
        self.held = ""  # the tail that could still begin a stop string
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        # An occurrence that began in text already shown would have been held, so searching
        # the held tail plus the new piece finds the first one.
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self.held = True, ""
            return text[: min(found)]
        cut = len(text) - stop_prefix_length(text, self.stops)
        self.held = text[cut:]
        return text[:cut]

    def flush(self) -> str:
        piece, self.held = self.held, ""
        return piece


class StopStringsAfter(StopStrings):
    """Stop strings that match only in the text after the first `min_tokens` generated tokens
    (vLLM's min_tokens: no stop before then). That text is shown as it comes and never cut;
    vLLM (v1) still matches a stop string that begins in it and ends later, cutting the reply
    inside those tokens, which would leave it shorter than asked."""

    def __init__(self, stops: Sequence[str] = (), min_tokens: int = 0) -> None:
        super().__init__(stops)
        self.min_tokens = min_tokens

    def push_token(self, piece: str, n_generated: int) -> str:
        """The new text of the n_generated-th token (from 1), as far as it can be shown."""
        # Nothing is held while the first min_tokens pass: nothing was pushed yet.
        return piece if n_generated <= self.min_tokens else self.push(piece)


def stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
