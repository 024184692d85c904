"""Thinking before answering (seed 000 §2.5.2): a reasoning model writes a chain of thought
between two markers, <think> and </think>, and then its answer.

The engine's rows tell the two apart by the markers' token ids (SamplingParams.think_ids; the
Row routes each token to `reasoning` or `text` and counts it in stats.thinking_tokens), and a
thinking budget caps the segment: when N tokens are spent the row emits </think> itself and
the model answers from there (SamplingParams.thinking_budget). `--no-think` starts the answer
at once: the prompt gets an empty segment (what Qwen3's template writes for
enable_thinking=False) and a budget of 0 closes any segment the model would open anyway.

Markers come from the tokenizer: both must be single tokens of its vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glassformer.templates import THINK_END, THINK_START


@dataclass(frozen=True)
class ThinkingMarkers:
    start: str
    end: str
    start_id: int
    end_id: int

    @property
    def ids(self) -> tuple[int, int]:
        return self.start_id, self.end_id


def thinking_markers(
    tokenizer: Any, start: str = THINK_START, end: str = THINK_END
) -> ThinkingMarkers | None:
    """The tokenizer's thinking markers, or None when it lacks either as a single token."""
    if tokenizer is None:
        return None
    ids = []
    for marker in (start, end):
        token_id = None
        if hasattr(tokenizer, "token_to_id"):
            token_id = tokenizer.token_to_id(marker)
        if token_id is None and hasattr(tokenizer, "encode"):
            try:
                encoded = tokenizer.encode(marker)
            except ValueError:  # a character vocabulary without "<": no markers
                encoded = []
            token_id = encoded[0] if len(encoded) == 1 else None
        if token_id is None:
            return None
        ids.append(token_id)
    if ids[0] == ids[1]:
        return None
    return ThinkingMarkers(start, end, ids[0], ids[1])


def require_markers(tokenizer: Any, model_name: str, flag: str) -> ThinkingMarkers:
    """The markers, or a one-line error naming the model and the flag that needs them."""
    markers = thinking_markers(tokenizer)
    if markers is None:
        raise ValueError(
            f"{flag} needs a thinking model, but the tokenizer of {model_name} has no "
            f"{THINK_START} and {THINK_END} tokens: drop {flag}, or use a model that thinks "
            "(Qwen3, a DeepSeek-R1 distill, or configs/arith-think.toml trained here)"
        )
    return markers


def check_budget(budget: int | None, flag: str = "--thinking-budget") -> None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
        raise ValueError(f"{flag}={budget!r} must be a whole number of tokens")
    if budget is not None and budget < 0:
        raise ValueError(
            f"{flag}={budget} is below 0: give the most thinking tokens before the answer "
            "(0 answers at once), or leave it out for no limit"
        )


def no_think_suffix(markers: ThinkingMarkers) -> list[int]:
    """What --no-think appends to a prompt: an empty thinking segment."""
    return [markers.start_id, markers.end_id]


def opens_segment(prompt: list[int], think_ids: tuple[int, int]) -> bool:
    """Whether the prompt leaves a thinking segment open: a start marker after its last end
    marker (DeepSeek-R1's template ends the prompt with "<think>\n")."""
    start, end = think_ids
    for token in reversed(prompt):
        if token == end:
            return False
        if token == start:
            return True
    return False


class Segments:
    """Which part of a reply each new token belongs to: "marker" (<think> or </think>),
    "thinking" or "answer". A segment opens with the prompt or with the reply's first token;
    once it has closed, or an answer token has come, a start marker is just text."""

    def __init__(self, think_ids: tuple[int, int], prompt: list[int]) -> None:
        self.start, self.end = think_ids
        self.thinking = opens_segment(prompt, think_ids)
        self.answering = False

    def push(self, token: int) -> str:
        if self.thinking:
            if token == self.end:
                self.thinking, self.answering = False, True  # one segment per reply
                return "marker"
            return "thinking"  # (a start marker inside the segment counts as thinking too)
        if token == self.start and not self.answering:
            self.thinking = True
            return "marker"
        self.answering = True
        return "answer"


def split_reasoning(reasoning: str, answer: str) -> tuple[str, str]:
    """The two texts as a reply shows them: without the blank lines models put around the
    markers ("<think>\\n...\\n</think>\\n\\n")."""
    return reasoning.strip(), answer.lstrip()
