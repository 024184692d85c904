"""A compiled decode step (seed 000 §2.5.1: decode is memory-bound, so a step should cost the
time to stream the weights, not the ~1,200 small torch calls and Python frames around them).

gpt-fast's recipe, on the model's own modules: every layer keeps a static (1, Hkv, Tmax, D) cache;
each step writes its keys/values at a *tensor* of positions (`k_cache[:, :, positions] = k`) and
attends over the whole capacity with a mask of the filled slots, so a decode step has the same
shapes at every position and `torch.compile` makes one graph, compiled once per capacity and
reused across generations. The C matrix-vector kernels enter the graph as the
`glassformer::matvec` operator (glassformer/kernels), so nothing breaks it. The prompt runs the
same code eagerly (its length varies, and prefill is compute-bound anyway).

    model = quantize_int8(model)                      # or optimize_for_decode(model, "bf16")
    decoder = CompiledDecoder(model)
    result = decoder.generate(prompt_ids, max_new_tokens=128, temperature=0.0)

Shapes: L layers, Hkv key/value heads, Tmax cache capacity, D head dim, C channels, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from glassformer.infer.engine import GenerationResult, GenerationStats, prompt_tensor
from glassformer.infer.sampling import (
    SamplingParams,
    check_max_new_tokens,
    make_generator,
    resolve_eos,
    sample,
)
from glassformer.nn.attention import AttentionMask, attention_mask
from glassformer.nn.kv_cache import CacheWrites, StaticKVCache

# Capacities come in powers of two from this size up: attention reads the whole capacity every
# step (about 0.26 ms per 256 fp32 positions on SmolLM2), and each new capacity is a new graph.
MIN_CAPACITY = 256


def capacity_for(n_positions: int, max_seq_len: int) -> int:
    """The cache capacity for n_positions: the next power of two >= MIN_CAPACITY, at most the
    model's max_seq_len."""
    capacity = MIN_CAPACITY
    while capacity < n_positions:
        capacity *= 2
    return min(capacity, max_seq_len)


def check_supported(model: nn.Module) -> None:
    """A clear error for models whose decode step cannot be one static graph."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or cfg.family != "gpt" or not hasattr(model, "blocks"):
        raise ValueError(
            f"CompiledDecoder runs decoder-only GPT-family models, not {type(model).__name__}: "
            "use Engine(model) for other families"
        )
    if cfg.ffn == "moe":
        raise ValueError(
            "ffn='moe' routes each token to data-dependent experts, which one static graph "
            "cannot hold: use Engine(model)"
        )
    scaling = cfg.rope_scaling
    if scaling is not None and scaling.get("type") == "dynamic":
        raise ValueError(
            "dynamic-NTK RoPE rescales with the sequence length at every step: use Engine(model)"
        )


class CompiledDecoder:
    """Greedy or sampled generation with a `torch.compile`d decode step (fullgraph, static
    shapes). compile=False runs the very same step eagerly (the reference in tests).

    The model is used as is (its modules and weights, fp32, bf16 or int8); the decoder owns
    one StaticKVCache per capacity and its compiled step, so build it once and generate many times.
    """

    def __init__(self, model: nn.Module, *, compile: bool = True) -> None:
        check_supported(model)
        self.model = model.eval()
        self.cfg = model.cfg
        self._caches: dict[int, StaticKVCache] = {}
        self._step = self.forward
        if compile:
            # One compile thread: inductor's pool of compile workers otherwise stays busy for a
            # minute after compiling, and on a small machine it takes the cores the decode
            # loop needs (measured on 2 cores: eager steps 14 -> 188 ms while it lingers).
            self._step = torch.compile(
                self.forward,
                fullgraph=True,
                dynamic=False,
                options={"compile_threads": 1},
            )

    def _cache(self, n_positions: int) -> StaticKVCache:
        capacity = capacity_for(n_positions, self.cfg.max_seq_len)
        if capacity not in self._caches:
            param = self.model.tok_emb.weight
            self._caches[capacity] = StaticKVCache(self.cfg, capacity, param.dtype, param.device)
        cache = self._caches[capacity]
        cache.length = 0
        return cache

    def forward(self, tokens: Tensor, positions: Tensor, cache: StaticKVCache) -> Tensor:
        """tokens (1, T) at sequence positions (T,) -> next-token logits (1, V) of the last;
        their keys and values land in cache slots `positions`. The model's own modules, with
        attention over the whole capacity: a decode step (T = 1) has the same shapes at every
        position, so it compiles to one graph."""
        model = self.model
        x = model.tok_emb(tokens)  # (1, T, C)
        position_ids = positions[None]  # (1, T)
        if model.pos_emb is not None:
            x = x + model.pos_emb(position_ids)
        rope = model.rope(position_ids) if model.rope is not None else None
        mask = AttentionMask(bias=self._mask_bias(positions, cache.capacity))
        writes = CacheWrites(cache, positions)
        for block in model.blocks:
            x = block(x, mask, rope, writes)
        return model.lm_head(model.final_norm(x[:, -1:]))[:, -1]  # (1, V)

    def _mask_bias(self, positions: Tensor, capacity: int) -> Tensor:
        """The model's mask over the whole capacity as one additive tensor (1, 1 or H, T,
        Tmax): unfilled slots lie in every query's future, so the causal rule hides them.
        Additive, because CPU SDPA with a bool mask is ~100x slower (measured: 7.7 ms against
        42 us for one SmolLM2 layer at Tmax = 512); dense, because a compiled graph cannot
        branch on whether anything is masked."""
        slots = torch.arange(capacity, device=positions.device)
        mask = attention_mask(
            positions,
            slots,
            causal=True,
            sliding_window=self.cfg.sliding_window,
            alibi_slopes=getattr(self.model, "alibi_slopes", None),
            simplify=False,
        )
        return mask.additive(len(positions), capacity, torch.float32, positions.device)

    def prefill(self, prompt: Tensor, cache: StaticKVCache) -> Tensor:
        """The prompt (1, T) in one eager pass (compute-bound, and T varies) -> logits (1, V)."""
        positions = torch.arange(prompt.shape[1], device=prompt.device)
        with torch.inference_mode():
            logits = self.forward(prompt, positions, cache)
        cache.length = prompt.shape[1]
        return logits

    def decode(self, token: Tensor, cache: StaticKVCache) -> Tensor:
        """One compiled step for token (1,) after the cache's filled positions -> (1, V)."""
        # Always inference mode, and inputs made inside it: the compiled graph's guards include
        # the grad mode and whether each input is an inference tensor; a mismatch recompiles.
        with torch.inference_mode():
            position = torch.tensor([cache.length], device=token.device)
            logits = self._step(token.reshape(1, 1).clone(), position, cache)
        cache.length += 1
        return logits

    def generate(
        self,
        prompt_ids: Sequence[int] | Tensor,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | None = None,
    ) -> GenerationResult:
        """Engine.generate's contract (temperature 0 is greedy); a full context stops with
        "context_full" (no "shift")."""
        check_max_new_tokens(max_new_tokens)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        prompt = prompt_tensor(prompt_ids, self.cfg.max_seq_len, self.model.device)  # (1, T)
        eos_token_id = resolve_eos(eos_token_id, self.cfg)
        generator = make_generator(seed, prompt.device)
        stats = GenerationStats(prompt_tokens=prompt.shape[1], stop_reason="max_new_tokens")
        cache = self._cache(prompt.shape[1] + max_new_tokens)
        stats.kv_cache_capacity_bytes = cache.nbytes
        token_ids: list[int] = []
        with torch.inference_mode():
            t0 = time.perf_counter()
            token = sample(self.prefill(prompt, cache), params, generator)  # (1,)
            t_first = time.perf_counter()
            stats.time_to_first_token_s = t_first - t0
            stats.prefill_tokens_per_s = prompt.shape[1] / stats.time_to_first_token_s
            while True:
                token_ids.append(int(token))
                stats.kv_cache_bytes = cache.filled_bytes
                if eos_token_id is not None and token_ids[-1] == eos_token_id:
                    stats.stop_reason = "eos"
                    break
                if len(token_ids) >= max_new_tokens:
                    break
                if cache.length >= cache.capacity:
                    stats.stop_reason = "context_full"
                    break
                token = sample(self.decode(token, cache), params, generator)
            now = time.perf_counter()
        stats.generated_tokens = len(token_ids)
        stats.total_time_s = now - t0
        if len(token_ids) > 1:
            stats.decode_tokens_per_s = (len(token_ids) - 1) / (now - t_first)
        return GenerationResult(token_ids=token_ids, stats=stats)
