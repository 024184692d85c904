"""Streaming detokenization (seed 002 "token ≠ 字"): a byte-level BPE may split one Chinese
character or emoji across several tokens, so text streamed out of a generator must hold back
half-finished characters until their last byte arrives, and text that could still begin a stop
string until it no longer can."""

from __future__ import annotations

from collections.abc import Sequence

from glassformer.tokenizers import REPLACEMENT_CHAR, Tokenizer


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

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
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


def stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
