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

import torch
from torch import Tensor

from glassformer.infer.rows import Row
from glassformer.nn.kv_cache import KVCache

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


# The most new tokens a row's prefill runs through the fused step (Engine._prefill), each
# weight read once for all of them, rather than through the torch forward. SmolLM2, 2 threads,
# fused step against torch forward in ms, up to 64 tokens from position 100, more from 0
# (2026-12-07): int4 1 token 4.9 against 24.8, 16: 27 against 93, 32: 52 against 112, 64: 111
# against 149, 128: 211 against 199; int8 32: 96 against 120, 64: 199 against 156; fp32 32: 74
# against 99, 64: 136 against 135. A prompt whose first 127 tokens were cached waited 40-50 ms
# for its first token through the server, most of it the one token's torch forward.
FUSED_PREFILL = 32


class Prefills:
    """The Engine's prefill (infer/engine.py): this step's chunks of the pending prompts, each
    through the fused step (FUSED_PREFILL tokens or fewer) or the torch forward, and the rows
    whose prompts are then whole sampled and made live."""

    def _prefill_pending(self) -> list[Row]:
        """Prefill this step's chunks of the pending prompts (all of every prompt without a
        budget); a row whose prompt is then whole samples its first token and joins the live
        rows. Returns those rows."""
        chunks = plan(self.pending, self.prefill_chunk)
        whole: list[tuple[Row, Tensor]] = []
        with torch.inference_mode():
            for group in forwards(chunks, batched=type(self.cache) is KVCache):
                logits = self._prefill_chunks(group)  # (n, V)
                for chunk, row_logits in zip(group, logits, strict=True):
                    if chunk.last:
                        whole.append((chunk.row, row_logits[None]))
        for waiting, chunk in zip(self.pending, chunks, strict=False):  # chunks follow pending
            waiting.done = chunk.stop
        for row, logits in whole:
            self.pending = [waiting for waiting in self.pending if waiting.row is not row]
            self._swap(row.slot, self.n_live)  # the first pending slot: now the last live one
            self.n_live += 1
            self._first_token(row, logits)
        return [row for row, _ in whole]

    def _prefill(self, row: Row, new_ids: list[int], start: int) -> Tensor:
        """Run a row's new tokens (positions start..) through its slot -> logits (1, V). A
        few tokens (a short prompt, a prompt's rest after a cached prefix, a chat's next turn)
        go through the fused step, up to its max_tokens a call; more through the torch forward,
        whose batched matmuls win there (see FUSED_PREFILL)."""
        fused = self.fused
        if fused is not None and len(new_ids) <= FUSED_PREFILL and fused.supports(self.cache):
            at = fused.max_tokens
            for i in range(0, len(new_ids), at):
                logits = fused.many(new_ids[i : i + at], start + i, self.cache, row.slot)
            return logits[-1:]
        slot = self.cache.rows(row.slot, row.slot + 1)
        if start == 0:
            slot.reset()  # a recurrent state must start from zero; a KV cache just overwrites
        ids = torch.tensor([new_ids], device=self.model.device)  # (1, T)
        positions = torch.arange(start, start + len(new_ids), device=ids.device)
        with self._linears():
            return self.model(ids, positions, cache=slot, last_token_only=True)[:, -1]

    def _prefill_chunks(self, group: list[Chunk]) -> Tensor:
        """Chunks of rows in consecutive slots, all from one position, in one forward -> the
        logits (n, V) at each chunk's last token: the chunks right-padded (token 0) to the
        longest (a single chunk is _prefill's)."""
        if len(group) == 1:
            (chunk,) = group
            return self._prefill(chunk.row, chunk.ids, chunk.start)
        first, start = group[0].row.slot, group[0].start
        view = self.cache.rows(first, first + len(group))
        if start == 0:
            view.reset()
        device = self.model.device
        longest = max(len(chunk.ids) for chunk in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long, device=device)  # (n, T)
        for i, chunk in enumerate(group):
            ids[i, : len(chunk.ids)] = torch.tensor(chunk.ids, device=device)
        positions = torch.arange(start, start + longest, device=device)
        with self._linears():
            hidden = self.model.hidden_states(ids, positions, cache=view)  # (n, T, C)
        last = torch.tensor([len(chunk.ids) - 1 for chunk in group], device=device)
        return self.model.lm_head(hidden[torch.arange(len(group), device=device), last])
