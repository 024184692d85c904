"""GenerationStats as a person reads them, in one place: after `generate` (one prompt or a
batch) and after each chat reply."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from glassformer.infer.engine import GenerationStats


def _kv_cache(stats: GenerationStats) -> str:
    return (
        f"KV cache {stats.kv_cache_bytes / 1024:.1f} KiB in use of "
        f"{stats.kv_cache_capacity_bytes / 1024:.1f} KiB allocated"
    )


def format_stats(stats: GenerationStats) -> str:
    """One prompt: tokens, why it stopped, time to first token, rates and cache bytes."""
    shifted = f" | context shifted {stats.context_shifts}x" if stats.context_shifts else ""
    return (
        f"[{stats.prompt_tokens} prompt tokens, {stats.generated_tokens} generated, "
        f"stop: {stats.stop_reason}] time to first token {stats.time_to_first_token_s * 1e3:.1f}"
        f" ms | decode {stats.decode_tokens_per_s:.1f} tok/s | prefill "
        f"{stats.prefill_tokens_per_s:.0f} tok/s | {_kv_cache(stats)}{shifted}"
    )


def format_batch_stats(rows: Sequence[GenerationStats]) -> str:
    """A batch: each row's tokens and stop reason; the times, rates and cache bytes are the
    batch's, shared by all rows (the first row's copy stands for them)."""
    batch = rows[0]
    return (
        f"[batch of {len(rows)}: {sum(s.prompt_tokens for s in rows)} prompt tokens, "
        f"{sum(s.generated_tokens for s in rows)} generated, stop: "
        f"{', '.join(s.stop_reason for s in rows)}] time to first token "
        f"{batch.time_to_first_token_s * 1e3:.1f} ms | decode {batch.decode_tokens_per_s:.1f}"
        f" tok/s (all rows) | prefill {batch.prefill_tokens_per_s:.0f} tok/s | "
        f"{_kv_cache(batch)}"
    )


def format_reply_stats(stats: GenerationStats, reply_tokens: int, stop_reason: str) -> str:
    """A chat reply: its own token count and stop reason (a chat also stops at end of turn or
    Ctrl-C, which the engine does not know about)."""
    return (
        f"[{reply_tokens} tokens | time to first token "
        f"{stats.time_to_first_token_s * 1e3:.0f} ms | {stats.decode_tokens_per_s:.1f} tok/s | "
        f"prompt {stats.prompt_tokens} tokens | stop: {stop_reason}]"
    )
