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

import torch
from torch import Tensor, nn

from glassformer.infer.engine import Engine
from glassformer.infer.rows import Row
from glassformer.nn.kv_cache import StaticKVCache

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


class CompiledDecoder(Engine):
    """The Engine, one row at a time, with a `torch.compile`d decode step (fullgraph, static
    shapes): the step is the model's own forward over a StaticKVCache. compile=False runs the
    very same step eagerly (the reference in tests).

    The model is used as is (its modules and weights, fp32, bf16 or int8); the decoder keeps
    one StaticKVCache per capacity and its compiled step, so build it once and generate many
    times. generate/stream are the Engine's; a full context stops with "context_full".
    """

    def __init__(self, model: nn.Module, *, compile: bool = True, tokenizer=None) -> None:
        check_supported(model)
        super().__init__(model, tokenizer=tokenizer, fast=False)
        self.cfg = model.cfg
        self._caches: dict[int, StaticKVCache] = {}
        self.compiled_forward = self.forward
        if compile:
            # One compile thread: inductor's pool of compile workers otherwise stays busy for a
            # minute after compiling, and on a small machine it takes the cores the decode
            # loop needs (measured on 2 cores: eager steps 14 -> 188 ms while it lingers).
            self.compiled_forward = torch.compile(
                self.forward,
                fullgraph=True,
                dynamic=False,
                options={"compile_threads": 1},
            )

    def forward(self, tokens: Tensor, positions: Tensor, cache: StaticKVCache) -> Tensor:
        """tokens (1, T) at positions (T,) -> next-token logits (1, V) of the last."""
        return self.model(tokens, positions, cache=cache, last_token_only=True)[:, -1]

    def reserve(self, n_rows: int, n_positions: int) -> None:
        """One row; the cache of the power-of-two capacity that holds n_positions."""
        if n_rows != 1:
            raise ValueError(f"CompiledDecoder generates one row at a time, not {n_rows}")
        capacity = capacity_for(n_positions, self.cfg.max_seq_len)
        if capacity not in self._caches:
            param = self.model.tok_emb.weight
            self._caches[capacity] = StaticKVCache(self.cfg, capacity, param.dtype, param.device)
        self.cache = self._caches[capacity]

    def _decode(self, live: list[Row]) -> tuple[Tensor, None]:
        """One compiled step for the row's last token -> its logits (1, V), and no picks (the
        Engine's argmax_picks finds them). Its inputs are made inside inference mode: the
        graph's guards include the grad mode and whether each input is an inference tensor, and
        a mismatch recompiles."""
        (row,) = live
        device = self.model.device
        token = torch.tensor([[row.context[-1]]], device=device)
        position = torch.tensor([row.length], device=device)
        return self.compiled_forward(token, position, self.cache), None
