"""The generation engine (seed 000 §2.5.1): prefill the prompt in one parallel pass into a
preallocated KV cache, then decode one token at a time, sampling each from the logits.

The engine knows token ids, not text: tokenizing and detokenizing happen at the face (CLI,
server). Every generation reports time to first token, decode tokens/s and KV-cache bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from numbers import Integral

import torch
from torch import Tensor, nn

from glassformer.infer.sampling import (
    SamplingParams,
    check_max_new_tokens,
    make_generator,
    resolve_eos,
    sample,
)
from glassformer.models.common import check_token_ids


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
    # Rows generated together (Engine.generate_batch); above 1, the times, tokens/s and
    # KV-cache bytes are the whole batch's, shared by its rows.
    batch_size: int = 1


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


def check_integer_ids(ids: Sequence[int] | Tensor) -> None:
    """Token ids are whole numbers: 1.5 or True would otherwise be cast to 1 without a word."""
    if isinstance(ids, Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"token ids must be an integer tensor, got dtype {ids.dtype}")
        return
    for position, token_id in enumerate(ids):
        if isinstance(token_id, Sequence):
            check_integer_ids(token_id)
        elif isinstance(token_id, bool) or not isinstance(token_id, (int, Integral)):
            raise ValueError(
                f"token id {token_id!r} at position {position} is not a whole number: token ids "
                "are integers from the tokenizer"
            )


def prompt_tensor(
    prompt_ids: Sequence[int] | Tensor, max_seq_len: int, device: torch.device | None = None
) -> Tensor:
    """One prompt as a (1, T) long tensor, with one-line errors for a batch, an empty prompt or
    one longer than the context window. Shared by every generation loop."""
    check_integer_ids(prompt_ids)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(
            f"prompt_ids must be one sequence of token ids, got shape {tuple(ids.shape)}"
        )
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token id")
    if ids.numel() > max_seq_len:
        raise ValueError(
            f"the prompt has {ids.numel()} tokens but the context window is "
            f"max_seq_len={max_seq_len}: shorten the prompt"
        )
    return ids[None]  # (1, T)


class Engine:
    """Generates from any model that offers `new_cache(batch_size, max_seq_len)` and
    `model(ids, cache=cache, last_token_only=True) -> logits`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model.eval()
        self.max_seq_len: int = model.cfg.max_seq_len
        self._cache = None
        self._batch_cache = None  # generate_batch's cache for batches of more than one row

    def _prompt_tensor(self, prompt_ids: Sequence[int] | Tensor) -> Tensor:
        return prompt_tensor(prompt_ids, self.max_seq_len, self.model.device)

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
        check_max_new_tokens(max_new_tokens)
        if on_full_context not in ("stop", "shift"):
            raise ValueError(
                f"on_full_context={on_full_context!r} is not known: pick 'stop' or 'shift'"
            )
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        prompt = self._prompt_tensor(prompt_ids)
        eos_token_id = resolve_eos(eos_token_id, self.model.cfg)
        generator = make_generator(seed, prompt.device)
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
        # Inference mode is entered per step, never across a yield: a caller between two
        # tokens must find torch in its own mode (an abandoned stream would leave it on).
        t0 = time.perf_counter()
        token = self._next_token(prompt, cache, params, generator)  # (1,)
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
                step_ids = token[:, None]  # (1, 1)
            elif on_full_context == "shift":
                # The window is full: keep its second half and prefill it again, so the
                # model keeps seeing positions it was trained on (nanoGPT crops likewise).
                del context[: len(context) - self.max_seq_len // 2]
                cache.reset()
                stats.context_shifts += 1
                step_ids = torch.tensor([context], device=prompt.device)
            else:
                stats.stop_reason = "context_full"
                break
            token = self._next_token(step_ids, cache, params, generator)
            token_id = int(token)
            now = time.perf_counter()
            stats.total_time_s = now - t0
            stats.decode_tokens_per_s = stats.generated_tokens / (now - t_first)

    @torch.inference_mode()
    def _next_token(
        self,
        ids: Tensor,
        cache,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Tensor:
        """Run `ids` (1, T) through the model into the cache and sample the next token (1,)."""
        logits = self.model(ids, cache=cache, last_token_only=True)[:, -1]  # (1, V)
        return sample(logits, params, generator)

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

    # --- batched generation: several prompts, left-padded into one batch (issue 5) ------------

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int] | Tensor],
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | None = None,
    ) -> list[GenerationResult]:
        """Generate for several prompts in one batch; one result per prompt, in order.

        The prompts are left-padded to the longest, so every row's last prompt token sits in
        the same column and each decode step appends one column for all rows. A padding mask
        hides the pad keys and position ids count real tokens only (each row's first token is
        position 0), so every row computes what it would alone: greedy rows equal `generate`
        token for token. Rows sample independently from one generator seeded once.

        A row that samples eos_token_id is finished (its token_ids end with it): it is fed eos,
        its outputs ignored, until every row is finished or max_new_tokens is reached. The
        context window is the batch's: once the longest prompt plus the tokens so far fill
        max_seq_len, the unfinished rows stop with "context_full" (a shorter row sooner than
        alone; there is no "shift"). With dynamic-NTK RoPE the longest row sets the scaling.

        Stats: prompt_tokens, generated_tokens and stop_reason are each row's own. The times,
        prefill and decode tokens/s (every row's tokens counted) and the KV-cache bytes (every
        row, padding included) are the batch's, shared by all rows; batch_size says how many.

        family "rnn": a recurrent state accepts only right padding, so each prompt runs alone
        through `generate` (each with the same seed) and every figure is that prompt's own.
        """
        check_max_new_tokens(max_new_tokens)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        rows = self._batch_rows(prompts)
        eos_token_id = resolve_eos(eos_token_id, self.model.cfg)
        if self.model.cfg.family == "rnn":
            return [
                self.generate(row, max_new_tokens, temperature, top_k, top_p, seed, eos_token_id)
                for row in rows
            ]
        generator = make_generator(seed, self.model.device)
        return self._generate_batch(rows, max_new_tokens, params, generator, eos_token_id)

    def _batch_rows(self, prompts: Sequence[Sequence[int] | Tensor]) -> list[list[int]]:
        """Check every prompt like `_prompt_tensor`; errors name the prompt's number (from 1)."""
        if isinstance(prompts, str) or (isinstance(prompts, Tensor) and prompts.dim() != 2):
            raise ValueError(
                "prompts must be a list of prompts, each a list of token ids: encode text "
                "with the tokenizer, and wrap a single prompt as [prompt_ids]"
            )
        rows = list(prompts)
        if not rows:
            raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
        if any(isinstance(row, int) for row in rows):
            raise ValueError(
                "prompts is one flat list of token ids: generate_batch takes a list of prompts, "
                "so wrap a single prompt as [prompt_ids]"
            )
        checked = []
        for number, row in enumerate(rows, start=1):
            try:
                if isinstance(row, str):
                    raise ValueError("got text: encode it with the tokenizer first")
                ids = self._prompt_tensor(row)  # (1, T)
                check_token_ids(ids, self.model.cfg.vocab_size)
            except ValueError as error:
                raise ValueError(f"prompt {number} of {len(rows)}: {error}") from None
            checked.append(ids[0].tolist())
        return checked

    @staticmethod
    def _left_pad(
        rows: list[list[int]], capacity: int, device: torch.device
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Left-pad the prompts to the longest: (B, T) ids, the key mask (B, capacity) for the
        whole generation (True at real tokens, and at every generated column), and (B, T)
        position ids counting real tokens only (pads get 0; their outputs are never used)."""
        B, T = len(rows), max(len(row) for row in rows)
        ids = torch.zeros(B, T, dtype=torch.long)  # pad id 0: any valid id, it is masked out
        key_mask = torch.ones(B, capacity, dtype=torch.bool)
        for b, row in enumerate(rows):
            n_pads = T - len(row)
            ids[b, n_pads:] = torch.tensor(row)
            key_mask[b, :n_pads] = False
        # Each real token's position is the number of real tokens before it in its row.
        position_ids = (key_mask[:, :T].long().cumsum(dim=-1) - 1).clamp(min=0)  # (B, T)
        return ids.to(device), key_mask.to(device), position_ids.to(device)

    def _batch_kv_cache(self, batch_size: int, capacity: int):
        """A reset cache for batch_size rows with room for capacity positions, reusing the last
        one when its shape fits (batch 1 shares stream's cache)."""
        if batch_size == 1:
            return self._fresh_cache(capacity)
        cache = self._batch_cache
        if cache is None or cache.k.shape[1] != batch_size or cache.max_seq_len < capacity:
            # (cache.k is (L, B, Hkv, Tmax, D))
            cache = self._batch_cache = self.model.new_cache(
                batch_size=batch_size, max_seq_len=capacity
            )
        cache.reset()
        return cache

    def _generate_batch(
        self,
        rows: list[list[int]],
        max_new_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        eos_token_id: int | None,
    ) -> list[GenerationResult]:
        """Prefill the left-padded batch, then decode one column at a time for every row."""
        B, T = len(rows), max(len(row) for row in rows)
        capacity = min(self.max_seq_len, T + max_new_tokens)
        device = self.model.device
        ids, key_mask, position_ids = self._left_pad(rows, capacity, device)
        padded = not bool(key_mask.all())  # equal lengths: no mask needed, SDPA's causal path
        cache = self._batch_kv_cache(B, capacity)
        new_tokens: list[list[int]] = [[] for _ in rows]
        stats = [GenerationStats(prompt_tokens=len(row), batch_size=B) for row in rows]
        unfinished = list(range(B))
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = self.model(
                ids,
                position_ids=position_ids,
                padding_mask=key_mask[:, :T] if padded else None,
                cache=cache,
                last_token_only=True,
            )[:, -1]  # (B, V): left padding puts every row's last prompt token in column T-1
            token = sample(logits, params, generator)  # (B,)
            t_first = time.perf_counter()
            next_position = torch.tensor([[len(row)] for row in rows], device=device)  # (B, 1)
            while True:
                token_ids = token.tolist()
                for b in list(unfinished):
                    new_tokens[b].append(token_ids[b])
                    if eos_token_id is not None and token_ids[b] == eos_token_id:
                        stats[b].stop_reason = "eos"
                    elif len(new_tokens[b]) >= max_new_tokens:
                        stats[b].stop_reason = "max_new_tokens"
                    else:
                        continue
                    unfinished.remove(b)
                if not unfinished:
                    break
                if cache.length >= capacity:  # the window is full for the whole batch
                    for b in unfinished:
                        stats[b].stop_reason = "context_full"
                    break
                if len(unfinished) < B:  # finished rows (only eos finishes early) are fed eos
                    finished = torch.ones(B, dtype=torch.bool, device=device)
                    finished[unfinished] = False
                    token = token.masked_fill(finished, eos_token_id)
                logits = self.model(
                    token[:, None],  # (B, 1)
                    position_ids=next_position,
                    padding_mask=key_mask[:, : cache.length + 1] if padded else None,
                    cache=cache,
                    last_token_only=True,
                )[:, -1]  # (B, V)
                next_position = next_position + 1
                token = sample(logits, params, generator)
            t_end = time.perf_counter()
        self._fill_batch_stats(stats, new_tokens, cache, t_first - t0, t_end - t_first)
        pairs = zip(new_tokens, stats, strict=True)
        return [GenerationResult(token_ids=tokens, stats=row_stats) for tokens, row_stats in pairs]

    @staticmethod
    def _fill_batch_stats(
        stats: list[GenerationStats],
        new_tokens: list[list[int]],
        cache,
        time_to_first_token_s: float,
        decode_time_s: float,
    ) -> None:
        """Each row's own token count, and the batch's shared times, rates and cache bytes."""
        prompt_tokens = sum(s.prompt_tokens for s in stats)
        # Tokens sampled after the first step, summed over rows (a finished row adds none).
        decode_tokens = sum(len(tokens) for tokens in new_tokens) - len(new_tokens)
        for row_stats, tokens in zip(stats, new_tokens, strict=True):
            row_stats.generated_tokens = len(tokens)
            row_stats.time_to_first_token_s = time_to_first_token_s
            row_stats.prefill_tokens_per_s = prompt_tokens / time_to_first_token_s
            row_stats.decode_tokens_per_s = decode_tokens / decode_time_s if decode_tokens else 0.0
            row_stats.total_time_s = time_to_first_token_s + decode_time_s
            row_stats.kv_cache_bytes = cache.filled_bytes
            row_stats.kv_cache_capacity_bytes = cache.nbytes
