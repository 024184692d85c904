"""Chunked prefill (vLLM's max_num_batched_tokens, llama.cpp's n_batch): the Engine's rows whose
prompts are not all in their slots yet, and how one step's budget of prompt tokens is shared
among them (seed 000 §2.5.1: prefill is the parallel pass, decode the one-token steps).

Without a budget a prompt is prefilled whole when it is added: a 2,048-token prompt, or sixteen
128-token ones together, is one long forward, and every running row waits for it before its
next token. With one, each Engine.step decodes the running rows and then prefills at most
`budget` prompt tokens, oldest prompt first, so running rows keep their pace while new prompts
join. A chunk continues its row's keys/values at its own positions, exactly as a conversation's
next turn continues a parked row, so the cache written in chunks is the cache written at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from glassformer.infer.rows import Row

# The server's budget (glassformer serve --prefill-chunk), by benchmarks/serve.py --prefill-chunks
# on SmolLM2, 2 cores: while 8 prompts of 256 tokens join 4 running streams, their p99 gap is
# 0.93 s at 512 (0.62 s at 256, 3.0 s with whole prefills), and 16 clients at once see a p99
# time to first token 1.07x that of whole prefills (1.37x at 256: more turns, more decode steps
# between the chunks) and 0.93x the tokens/s (0.86x at 256).
PREFILL_CHUNK = 512
# The server's shortest prefix copied from another request's keys/values (serve
# --min-shared-prefix): a 16-token block, as vLLM's prefix cache shares blocks of 16 (shorter
# ones save less prefill than finding them costs).
MIN_SHARED_PREFIX = 16


@dataclass
class Pending:
    """A row holding a slot whose prompt is in it up to position `done` (exclusive)."""

    row: Row
    done: int


@dataclass
class Chunk:
    """Prompt tokens start..stop-1 of a row, prefilled in one forward."""

    row: Row
    start: int
    stop: int

    @property
    def ids(self) -> list[int]:
        return self.row.prompt[self.start : self.stop]

    @property
    def last(self) -> bool:
        """This chunk ends the prompt: the row samples its first token from it."""
        return self.stop == len(self.row.prompt)


def check_budget(prefill_chunk: int | None) -> int | None:
    """A prefill budget is a whole number of tokens >= 1, or None (whole prompts at once)."""
    whole = isinstance(prefill_chunk, int) and not isinstance(prefill_chunk, bool)
    if prefill_chunk is not None and not (whole and prefill_chunk >= 1):
        raise ValueError(
            f"prefill_chunk={prefill_chunk!r} must be a whole number of tokens >= 1, e.g. 256, "
            "or None to prefill every prompt whole"
        )
    return prefill_chunk


def plan(pending: list[Pending], budget: int | None) -> list[Chunk]:
    """This step's chunks: the oldest prompts first, each as far as the budget goes (None: all
    of every prompt). Finishing one prompt before starting the next gives the earliest first
    tokens; only the last chunk planned can stop short of its prompt's end."""
    chunks, left = [], budget
    for waiting in pending:
        if left is not None and left <= 0:
            break
        n = len(waiting.row.prompt) - waiting.done
        if left is not None:
            n = min(n, left)
            left -= n
        chunks.append(Chunk(waiting.row, waiting.done, waiting.done + n))
    return chunks


def forwards(chunks: list[Chunk], batched: bool) -> list[list[Chunk]]:
    """The chunks grouped into forwards: chunks in consecutive slots that start at the same
    position share one (right-padded to the longest, so the padding lands past each row's
    chunk where the causal mask hides it and a later write replaces it); batched=False (a
    cache that cannot hide padding) runs one forward per chunk."""
    groups: list[list[Chunk]] = []
    for chunk in sorted(chunks, key=lambda c: c.row.slot):
        group = groups[-1] if groups else None
        if (
            batched
            and group is not None
            and chunk.start == group[-1].start
            and chunk.row.slot == group[-1].row.slot + 1
        ):
            group.append(chunk)
        else:
            groups.append([chunk])
    return groups
