"""The generation engine (seed 000 §2.5.1): prefill the prompt in one parallel pass into a
preallocated KV cache, then decode one token at a time, sampling each from the logits.

The engine knows token ids, not text: tokenizing and detokenizing happen at the face (CLI,
server). Every generation reports time to first token, decode tokens/s and KV-cache bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from glassformer.infer.sampling import SamplingParams, sample


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0  # prefill + sampling the first new token
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0  # tokens after the first, per second of decoding
    total_time_s: float = 0.0
    kv_cache_bytes: int = 0  # bytes of keys/values held for the final context
    kv_cache_capacity_bytes: int = 0  # bytes allocated for the whole cache
    stop_reason: str = ""  # "eos", "max_new_tokens" or "context_full"
    context_shifts: int = 0  # times a full context window was cut to its second half


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only
    stats: GenerationStats


@dataclass
class TokenStream:
    """An iterator of new token ids; `stats` is complete once the iterator is exhausted."""

    _tokens: Iterator[int]
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __iter__(self) -> Iterator[int]:
        return self._tokens

    def __next__(self) -> int:
        return next(self._tokens)


class Engine:
    """Generates from any model that offers `new_cache(batch_size, max_seq_len)` and
    `model(ids, cache=cache, last_token_only=True) -> logits`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model.eval()
        self.max_seq_len: int = model.cfg.max_seq_len
        self._cache = None

    def _prompt_tensor(self, prompt_ids: Sequence[int] | Tensor) -> Tensor:
        ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=self.model.device)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(
                f"prompt_ids must be one sequence of token ids, got shape {tuple(ids.shape)}"
            )
        if ids.numel() == 0:
            raise ValueError("the prompt is empty: give at least one token id")
        if ids.numel() > self.max_seq_len:
            raise ValueError(
                f"the prompt has {ids.numel()} tokens but the context window is "
                f"max_seq_len={self.max_seq_len}: shorten the prompt"
            )
        return ids[None]  # (1, T)

    def _fresh_cache(self, capacity: int):
        cache = self._cache
        if cache is None or cache.max_seq_len < capacity:
            cache = self._cache = self.model.new_cache(batch_size=1, max_seq_len=capacity)
        cache.reset()
        return cache

    def stream(
        self,
        prompt_ids: Sequence[int] | Tensor,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | None = None,
        on_full_context: str = "stop",
    ) -> TokenStream:
        """Yield new token ids one by one as they are sampled.

        on_full_context: what to do when prompt + generated tokens fill max_seq_len: "stop",
        or "shift" (keep the window's second half as context and go on)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        if on_full_context not in ("stop", "shift"):
            raise ValueError(
                f"on_full_context={on_full_context!r} is not known: pick 'stop' or 'shift'"
            )
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        prompt = self._prompt_tensor(prompt_ids)
        if eos_token_id is None:
            eos_token_id = self.model.cfg.eos_token_id
        generator = None
        if seed is not None:
            generator = torch.Generator(device=prompt.device).manual_seed(seed)
        stats = GenerationStats(prompt_tokens=prompt.shape[1])
        tokens = self._generate(
            prompt, max_new_tokens, params, generator, eos_token_id, on_full_context, stats
        )
        return TokenStream(tokens, stats)

    def _generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos_token_id: int | None,
        on_full_context: str,
        stats: GenerationStats,
    ) -> Iterator[int]:
        capacity = min(self.max_seq_len, prompt.shape[1] + max_new_tokens)
        cache = self._fresh_cache(capacity)
        stats.kv_cache_capacity_bytes = cache.nbytes
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = self.model(prompt, cache=cache, last_token_only=True)[:, -1]  # (1, V)
            token = sample(logits, params, generator)  # (1,)
            token_id = int(token)
            t_first = time.perf_counter()
            stats.time_to_first_token_s = t_first - t0
            stats.prefill_tokens_per_s = prompt.shape[1] / stats.time_to_first_token_s
            stats.total_time_s = stats.time_to_first_token_s
            stats.stop_reason = "max_new_tokens"
            context = prompt[0].tolist()  # the tokens whose keys/values the cache holds
            while True:
                stats.generated_tokens += 1
                stats.kv_cache_bytes = cache.filled_bytes
                yield token_id
                if eos_token_id is not None and token_id == eos_token_id:
                    stats.stop_reason = "eos"
                    break
                if stats.generated_tokens >= max_new_tokens:
                    break
                context.append(token_id)
                if cache.length < cache.max_seq_len:
                    logits = self.model(token[:, None], cache=cache, last_token_only=True)
                elif on_full_context == "shift":
                    # The window is full: keep its second half and prefill it again, so the
                    # model keeps seeing positions it was trained on (nanoGPT crops likewise).
                    del context[: len(context) - self.max_seq_len // 2]
                    cache.reset()
                    stats.context_shifts += 1
                    window = torch.tensor([context], device=prompt.device)
                    logits = self.model(window, cache=cache, last_token_only=True)
                else:
                    stats.stop_reason = "context_full"
                    break
                logits = logits[:, -1]  # (1, V)
                token = sample(logits, params, generator)
                token_id = int(token)
                now = time.perf_counter()
                stats.total_time_s = now - t0
                stats.decode_tokens_per_s = stats.generated_tokens / (now - t_first)

    def generate(
        self,
        prompt_ids: Sequence[int] | Tensor,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | None = None,
        on_full_context: str = "stop",
    ) -> GenerationResult:
        """Generate up to max_new_tokens; temperature 0 means greedy."""
        stream = self.stream(
            prompt_ids,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            eos_token_id,
            on_full_context,
        )
        token_ids = list(stream)
        return GenerationResult(token_ids=token_ids, stats=stream.stats)
