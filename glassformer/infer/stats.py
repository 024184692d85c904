"""GenerationStats as a person reads them, in one place (the engine computes them): after
`glassformer generate` (one prompt or a batch) and after each chat reply (chat.py)."""

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
        f"{format_thinking(stats)}"
    )


def format_thinking(stats: GenerationStats) -> str:
    """The split of a thinking model's output: thinking and answer tokens and seconds."""
    if not stats.thinking_tokens:
        return ""
    ended = " (budget spent: </think> emitted)" if stats.thinking_forced_end else ""
    return (
        f"\nthinking {stats.thinking_tokens} tokens in {stats.thinking_time_s:.2f} s{ended}"
        f" | answer {stats.answer_tokens} tokens in {stats.answer_time_s:.2f} s"
    )


def format_batch_stats(rows: Sequence[GenerationStats]) -> str:
    """A batch: each row's tokens and stop reason; the rows decode side by side, so their
    decode rates add up, and each holds its own slot of the KV cache."""
    first_token_ms = [s.time_to_first_token_s * 1e3 for s in rows]
    in_use = sum(s.kv_cache_bytes for s in rows) / 1024
    allocated = sum(s.kv_cache_capacity_bytes for s in rows) / 1024
    return (
        f"[batch of {len(rows)}: {sum(s.prompt_tokens for s in rows)} prompt tokens, "
        f"{sum(s.generated_tokens for s in rows)} generated, stop: "
        f"{', '.join(s.stop_reason for s in rows)}] time to first token "
        f"{min(first_token_ms):.1f}-{max(first_token_ms):.1f} ms | decode "
        f"{sum(s.decode_tokens_per_s for s in rows):.1f} tok/s (all rows) | KV cache "
        f"{in_use:.1f} KiB in use of {allocated:.1f} KiB allocated"
    )


def format_reply_stats(stats: GenerationStats, reply_tokens: int, stop_reason: str) -> str:
    """A chat reply: its own token count and stop reason (a chat also stops at end of turn or
    Ctrl-C, which the engine does not know about)."""
    return (
        f"[{reply_tokens} tokens | time to first token "
        f"{stats.time_to_first_token_s * 1e3:.0f} ms | {stats.decode_tokens_per_s:.1f} tok/s | "
        f"prompt {stats.prompt_tokens} tokens ({stats.cached_prompt_tokens} cached) | "
        f"stop: {stop_reason}]{format_thinking(stats)}"
    )
