"""The whole decode step in one C call (seed 000 §2.5.1: decode is memory-bound).

Decoding one token through the torch modules costs about forty small ops per layer, each with
its dispatch, its allocation and its OpenMP fork/join; on SmolLM2's 30 layers that overhead is
larger than the time to read the weights. `FusedStep` hands the model's own weights (and the
Engine's KV cache) to glassformer/kernels/decode.c, which runs the token's every layer inside
one parallel region and writes the logits. The Engine uses it for the decode steps of the
models it supports (`FusedStep.for_model` says which and why not), one row or a batch of up to
`max_tokens` rows, each at its own position of its own cache row, every weight read once for
all of them; prefill and every other model run the torch modules, which stay the reference the
tests hold this path to.
The step reads the weights where they are; moved into 2 MB pages first (infer/huge_pages.py,
which the Engine does with huge_pages=True) they stream faster (fp32 and bf16 steps
1.22-1.31x in benchmarks/huge_pages.py), a choice for the model's owner. One exception: on a
CPU with AMX, int4 matrices are read from a copy in the tile unit's order (kernels/amx.h,
_pack_for_tiles), the step's own, in 2 MB pages. The ctypes structs it
fills mirror step.h's (kernels/step.py); the library's own sizes and offsets are checked
against them before the first call (check_layout).

The model may change after the step is built, and every call checks: weights written in place,
replaced or loaded are read again (the structs are rebuilt), and while a hook, an attention
capture or an adapter is on the model the call runs the torch modules instead, which honour
them. The check walks every module, parameter and buffer, which a step leaves cold in every
cache: 0.2 ms of a 4.6 ms SmolLM2 int4 token (0.06 ms warm). Inside `with step.unchanged():`,
where the caller vouches that nothing changes the model, only the block's first call checks:
the Engine's generate and generate_batch, between whose steps none of the caller's code runs,
and the server's engine thread, which runs all other work on the model between its steps.

    step = FusedStep.for_model(model)              # None when this model needs the torch path
    logits = step(token_id, position, cache, slot) # (1, V), and the cache holds the new k, v
    logits = step.many(ids, position, cache, slot) # (n, V) for up to step.max_tokens ids at
                                                   # position.. (a speculative round's check)
    logits = step.rows(ids, positions, slots, cache)  # (n, V): row i the token ids[i] at
                                                   # positions[i] of cache row slots[i] (a batch)
    step.picks                                     # each row's argmax of the last call's
                                                   # logits, -1 where one is NaN/inf
    with step.unchanged(): ...                     # nothing changes the model in here: check once

Shapes: C channels, H query heads, Hkv key/value heads, D head dim, V vocab, Tmax cache length.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain
from operator import attrgetter, is_
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from glassformer import kernels
from glassformer.infer import huge_pages
from glassformer.kernels import step as step_h
from glassformer.nn.kv_cache import KVCache

_VERSION = attrgetter("_version")


def unsupported(model: nn.Module) -> str | None:
    """Why this model's decode step cannot be the fused one (None: it can)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or cfg.family != "gpt" or not hasattr(model, "blocks"):
        return f"{type(model).__name__} is not a decoder-only GPT-family model"
    if not kernels.available():
        return "the C kernels are not available on this machine (AVX2/FMA CPU, a C compiler)"
    if model.device.type != "cpu":
        return f"the model is on {model.device}, and the fused step runs on the CPU"
    reasons = {
        "post-norm layers": cfg.norm_position != "pre",
        "no residual connections": not cfg.residual,
        "an MoE FFN": cfg.ffn == "moe",
        "ALiBi": cfg.position == "alibi",
        "a sliding window": cfg.sliding_window is not None,
        "dynamic-NTK RoPE": (cfg.rope_scaling or {}).get("type") == "dynamic",
        f"head_dim={cfg.head_dim} (odd)": cfg.head_dim % 2 == 1,
    }
    for reason, applies in reasons.items():
        if applies:
            return f"the model has {reason}"
    for block in model.blocks:
        for name in ("qkv_proj", "out_proj"):
            problem = _linear_problem(getattr(block.attn, name))
            if problem:
                return f"attn.{name}: {problem}"
        ffn = block.ffn
        for layer in (
            (ffn.gate_up, ffn.down) if cfg.ffn in step_h.GATED else (ffn.fc_in, ffn.fc_out)
        ):
            problem = _linear_problem(layer)
            if problem:
                return f"ffn: {problem}"
        if block.attn.weights_sink is not None:
            return "a layer is being inspected (its attention weights are recorded)"
    # Hooks (inspection, counting) on any module: the fused step would run past them.
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "the model is being inspected (a module has forward hooks)"
    if _global_forward_hooks or _global_forward_pre_hooks:
        return "every module is being inspected (a global forward hook is registered)"
    return _linear_problem(model.lm_head)


def _linear_problem(module: nn.Module) -> str | None:
    """Why the C step cannot read this projection (None: it can)."""
    if type(module).__name__ not in ("Linear", "DecodeLinear", "Int8Linear", "Int4Linear"):
        name = type(module).__name__
        return f"{name} is not a plain, decode or quantized Linear (merge adapters)"
    weight = module.weight
    if weight.dtype not in step_h.STORAGE or weight.dim() != 2 or not weight.is_contiguous():
        return f"a {weight.dtype} weight of shape {tuple(weight.shape)} is not supported"
    width = kernels.in_features(weight)
    group = width // module.scales.shape[1] if hasattr(module, "scales") else width
    if width % 32 or group % 32:
        return f"width {width} (group {group}) is not a multiple of 32"
    return None


class FusedStep:
    """One decode step of `model` (batch 1) through decode.c, or a run of up to `max_tokens`
    consecutive tokens (`many`: a speculative round's check); see the module docstring."""

    def __init__(self, model: nn.Module, max_tokens: int = 8) -> None:
        """max_tokens: the most rows (or consecutive tokens) one call takes."""
        reason = unsupported(model)
        if reason:
            raise ValueError(f"the fused decode step cannot run this model: {reason}")
        self.model, self.cfg, self.max_tokens = model, model.cfg, max_tokens
        self._function, self._rows_function = step_h.decode_functions(kernels.library())
        # The last call's greedy picks, one per row: the index of its largest logit (the first
        # of equal ones, as argmax), -1 where its logits hold a NaN or an infinity; found by
        # the C step (decode.c's pick_rows). None after a call that ran the torch modules.
        self.picks: list[int] | None = None
        self._holds, self._held_verdict = 0, None  # unchanged(): blocks open, their verdict
        self._build()

    @classmethod
    def for_model(cls, model: nn.Module, max_tokens: int = 8) -> FusedStep | None:
        """The fused step, or None when the model needs the torch path (unsupported())."""
        return None if unsupported(model) else cls(model, max_tokens)

    # --- the structs --------------------------------------------------------------------------

    def _f32(self, tensor: Tensor | None) -> int | None:
        """A pointer to tensor's values as contiguous float32 (a copy when they are not)."""
        if tensor is None:
            return None
        values = tensor.detach().to(torch.float32).contiguous()
        if values.data_ptr() != tensor.data_ptr():
            self._copied.append(tensor)
        self._keep.append(values)
        return values.data_ptr()

    def _linear(self, module: nn.Module) -> step_h.Linear:
        weight = module.weight.detach()
        self._keep.append(weight)
        scales, mins = getattr(module, "scales", None), getattr(module, "mins", None)
        out, width = weight.shape[0], kernels.in_features(weight)
        group = width // scales.shape[1] if scales is not None else width
        return step_h.Linear(
            weight.data_ptr(),
            self._f32(scales),
            self._f32(mins),
            self._f32(module.bias),
            width,
            out,
            group,
            step_h.STORAGE[weight.dtype],
            int(getattr(module, "round_inputs", False)),
        )

    def _pack_for_tiles(self, linears: list[tuple[step_h.Linear, nn.Module]]) -> None:
        """Where the kernels run int4 products on AMX's tile unit (amx.h), give each int4 matrix
        of 16 rows or more (inputs not rounded) a copy in the tile unit's order
        (kernels.pack_q4_tiles), all in one buffer in 2 MB pages where the system has them:
        the step streams the copies as it streams the weights (SmolLM2 int4 step against a read,
        called bare: 4 KB pages 0.66-0.70x in 4 runs, 2 MB pages 0.71x and 0.72x;
        benchmarks/step_bandwidth.py)."""
        if not kernels.amx():
            return
        chosen = [
            (linear, module)
            for linear, module in linears
            if linear.storage == step_h.STORAGE[torch.uint8]
            and not linear.round_inputs
            and linear.out >= 16
        ]
        if not chosen:
            return
        tiles = [
            kernels.pack_q4_tiles(m.weight.detach(), m.scales.detach(), m.mins.detach())
            for _, m in chosen
        ]
        starts = [0]
        for t in tiles:  # each copy on a cache line of its own
            starts.append(starts[-1] + (t.numel() + 63) // 64 * 64)
        if huge_pages.supported():
            arena = huge_pages.huge_page_empty(starts[-1])
        else:
            arena = torch.empty(starts[-1], dtype=torch.uint8)
        for (linear, module), t, start in zip(chosen, tiles, starts, strict=False):
            arena[start : start + t.numel()].copy_(t.reshape(-1))
            linear.packed = arena.data_ptr() + start
            self._copied.extend([module.weight, module.scales, module.mins])  # writes rebuild it
        self._keep.append(arena)

    def _norm(self, norm: nn.Module) -> tuple[int | None, int | None]:
        return self._f32(norm.weight), self._f32(getattr(norm, "bias", None))

    def _build(self) -> None:
        """Build the structs from the model's weights as they are now, and remember them."""
        self._keep: list[Tensor] = []  # every tensor the C structs point to stays alive here
        self._copied: list[Tensor] = []  # the model's tensors they read through a copy
        self._struct = self._structs()
        self._cache_key: tuple | None = None  # the new layers point at no cache yet
        self._watch()

    def _structs(self) -> step_h.Model:
        model, cfg = self.model, self.cfg
        gated = cfg.ffn in step_h.GATED
        layers = (step_h.Layer * cfg.n_layers)()
        for layer, block in zip(layers, model.blocks, strict=True):
            attn, ffn = block.attn, block.ffn
            layer.attn_norm_weight, layer.attn_norm_bias = self._norm(block.attn_norm)
            layer.ffn_norm_weight, layer.ffn_norm_bias = self._norm(block.ffn_norm)
            if attn.q_norm is not None:
                layer.q_norm_weight = self._f32(attn.q_norm.weight)
                layer.k_norm_weight = self._f32(attn.k_norm.weight)
            layer.qkv, layer.out = self._linear(attn.qkv_proj), self._linear(attn.out_proj)
            up, down = (ffn.gate_up, ffn.down) if gated else (ffn.fc_in, ffn.fc_out)
            layer.up, layer.down = self._linear(up), self._linear(down)
        self._layers = layers
        tok_emb = model.tok_emb.weight.detach()
        if tok_emb.dtype not in (torch.float32, torch.bfloat16):
            tok_emb = tok_emb.float()
            self._copied.append(model.tok_emb.weight)
        self._keep.append(tok_emb)
        final_weight, final_bias = self._norm(model.final_norm)
        C, H, Hkv, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        scale = cfg.attention_scale if cfg.attention_scale is not None else D**-0.5
        rope = model.rope
        struct = step_h.Model(
            n_layers=cfg.n_layers,
            d_model=C,
            n_heads=H,
            n_kv_heads=Hkv,
            head_dim=D,
            d_ff=cfg.d_ff,
            vocab_size=cfg.vocab_size,
            rms_norm=int(cfg.norm == "rms"),
            gated=int(gated),
            activation=step_h.ACTIVATION[cfg.ffn],
            emb_storage=step_h.STORAGE[tok_emb.dtype],
            norm_eps=cfg.norm_eps,
            attn_scale=scale,
            rope_factor=rope.attention_factor if rope is not None else 1.0,
            inv_freq=self._f32(rope.inv_freq) if rope is not None else None,
            tok_emb=tok_emb.data_ptr(),
            pos_emb=self._f32(model.pos_emb.weight) if model.pos_emb is not None else None,
            final_norm_weight=final_weight,
            final_norm_bias=final_bias,
            head=self._linear(model.lm_head),
            layers=layers,
        )
        scratch = {
            "x": C,
            "h": C,
            "qkv": (H + 2 * Hkv) * D,
            "att": H * D,
            "ff": (2 if gated else 1) * cfg.d_ff,
        }
        for name, size in scratch.items():  # per token, for up to max_tokens
            buffer = torch.zeros(self.max_tokens * size)
            self._keep.append(buffer)
            setattr(struct, name, buffer.data_ptr())
        # the structs' views (ctypes shares their memory): packed copies are set in place
        linears = [(struct.head, model.lm_head)]
        for layer, block in zip(layers, model.blocks, strict=True):
            up, down = (
                (block.ffn.gate_up, block.ffn.down)
                if gated
                else (block.ffn.fc_in, block.ffn.fc_out)
            )
            linears += [(layer.qkv, block.attn.qkv_proj), (layer.out, block.attn.out_proj)]
            linears += [(layer.up, up), (layer.down, down)]
        self._pack_for_tiles(linears)
        return struct

    # --- what the structs were built from -----------------------------------------------------

    def _watch(self) -> None:
        """Remember what the structs were built from, for `_changed`: every module's hooks,
        submodules, parameters and buffers, each tensor's address, and the version of each
        tensor read through a copy (torch counts every in-place write: copy_, load_state_dict,
        an optimizer's step). The others need none: the step reads their own memory, so a write
        in place reaches it as it is (SmolLM2 w4a8: 425 tensors, 31 us a step for versions)."""
        modules = list(self.model.modules())
        self._hooks = [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        # Only the dicts that hold something: an entry where a module had none (a new name)
        # is nothing its forward reads, and skipping the empty two thirds halves the check.
        members = [d for m in modules for d in (m._modules, m._parameters, m._buffers)]
        self._members = [d for d in members if d]
        self._attentions = [block.attn for block in self.model.blocks]
        self._entries = list(chain.from_iterable(map(dict.values, self._members)))
        self._tensors = [entry for entry in self._entries if isinstance(entry, Tensor)]
        self._addresses = list(map(Tensor.data_ptr, self._tensors))
        self._versions = _versions(self._copied)

    def _changed(self) -> bool:
        """Whether the model differs from what the structs were built from: a hook (here or
        global), an attention capture, a module, parameter or buffer added or replaced, a
        tensor given new storage (.data = ..., .to()), one read through a copy written in
        place. A few flat passes over lists made in _watch, no walk of the module tree."""
        if _global_forward_hooks or _global_forward_pre_hooks or any(self._hooks):
            return True
        if any(attention.weights_sink is not None for attention in self._attentions):
            return True
        entries = list(chain.from_iterable(map(dict.values, self._members)))
        return not (
            len(entries) == len(self._entries)
            and all(map(is_, entries, self._entries))
            and list(map(Tensor.data_ptr, self._tensors)) == self._addresses
            and _versions(self._copied) == self._versions
        )

    def _fused_now(self) -> bool:
        """Whether this call can run the C step: yes when the model is as it was built from,
        or changed only in ways the structs can follow (rebuilt here); no while it has what
        the C step would run past (unsupported(): a hook, a capture, an adapter). Inside
        unchanged(), the block's first verdict."""
        if self._held_verdict is not None:
            return self._held_verdict
        verdict = True
        if self._changed():
            verdict = unsupported(self.model) is None
            if verdict:
                self._build()
        if self._holds:
            self._held_verdict = verdict
        return verdict

    @contextmanager
    def unchanged(self) -> Iterator[None]:
        """A block in which nothing changes the model (no hook, capture, adapter or write of
        a weight, from any thread): its first call checks the model, the later ones take that
        verdict. Blocks nest; recheck() makes the next call check again."""
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            if not self._holds:
                self._held_verdict = None

    def recheck(self) -> None:
        """The model may have changed (inside unchanged(): work on it ran): check it again."""
        self._held_verdict = None

    def _point_at(self, cache: KVCache, slot: int) -> None:
        """Point every layer at the cache row `slot` (once per cache memory, layout and slot).
        The key is the memory itself, keys' and values' both: a cache freed and another made
        can take the keys' old address and object id while its values land elsewhere, and the
        layers would read and write values freed."""
        k, v = cache.k, cache.v
        key = (k.data_ptr(), v.data_ptr(), k.shape, k.stride(), k.dtype, slot)
        if key == self._cache_key:
            return
        k, v = cache.k[:, slot], cache.v[:, slot]  # (L, Hkv, Tmax, D)
        for l, layer in enumerate(self._layers):
            layer.k_cache, layer.v_cache = k[l].data_ptr(), v[l].data_ptr()
        s = self._struct
        s.cache_head_stride, s.cache_pos_stride = k.stride(1), k.stride(2)
        s.cache_kind = step_h.CACHE_KINDS[cache.k.dtype]
        scores = torch.zeros(self.cfg.n_heads, cache.max_seq_len)
        self._scores = scores  # replaced with the cache, so it always fits its length
        s.scores, s.max_positions = scores.data_ptr(), cache.max_seq_len
        self._cache_key = key

    def supports(self, cache: Any) -> bool:
        """Whether this cache is one the C step reads: a full KVCache of f32, bf16 or f16
        whose head dim is contiguous."""
        return (
            type(cache) is KVCache
            and cache.k.dtype in step_h.CACHE_KINDS
            and cache.k.stride(-1) == 1
        )

    def takes(self, cache: Any, n_tokens: int) -> bool:
        """Whether `many` can run n_tokens tokens on this cache (else: the torch modules)."""
        return self.supports(cache) and 1 <= n_tokens <= self.max_tokens

    # --- the step -----------------------------------------------------------------------------

    def __call__(self, token: int, position: int, cache: KVCache, slot: int = 0) -> Tensor:
        """The next-token logits (1, V) for `token` at `position` of cache row `slot`, whose
        positions 0..position-1 are filled; writes the token's keys/values at `position`."""
        return self.many([token], position, cache, slot)

    def many(self, tokens: list[int], position: int, cache: KVCache, slot: int = 0) -> Tensor:
        """The logits (n, V) after each of n consecutive `tokens` at positions position.. of
        cache row `slot` (token i sees the cache and tokens 0..i), as the model's forward over
        them would give; writes their keys/values. n is 1 to max_tokens. Through the torch
        modules while the model has a hook, a capture or an adapter (see _fused_now)."""
        n = len(tokens)
        if not 1 <= n <= self.max_tokens:
            raise ValueError(f"{n} tokens: the fused step takes 1 to {self.max_tokens} at once")
        if position < 0 or position + n > cache.max_seq_len:
            raise ValueError(
                f"position {position + n - 1} is outside the cache's {cache.max_seq_len}"
            )
        cfg = self.cfg
        if self.model.pos_emb is not None and position + n > cfg.max_seq_len:
            # the C step would read past the position table; the torch path's words
            raise ValueError(
                f"sequence of {position + n} tokens is longer than max_seq_len="
                f"{cfg.max_seq_len}, the most positions a model with {cfg.position} positions "
                "knows: shorten the input or use position='rope'/'alibi'"
            )
        for token in tokens:
            if not 0 <= token < cfg.vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary ({cfg.vocab_size})")
        if not self._fused_now():
            self.picks = None
            return self._modules_step(tokens, position, cache, slot)
        self._point_at(cache, slot)
        ids, picks = (ctypes.c_int64 * n)(*tokens), (ctypes.c_int64 * n)()
        logits = torch.empty(n, self.cfg.vocab_size)
        self._function(
            ctypes.byref(self._struct), ids, n, position, logits.data_ptr(), picks,
            torch.get_num_threads(),
        )  # fmt: skip
        self.picks = list(picks)
        return logits  # float32 whatever the weights: the C step computes in float32

    def rows(
        self, tokens: list[int], positions: list[int], slots: list[int], cache: KVCache
    ) -> Tensor | None:
        """The logits (n, V) of n rows, row i the token tokens[i] at positions[i] of cache row
        slots[i] (which holds its positions before), each weight read once for all of them:
        the Engine's batched decode step. Each row's logits are exactly what a one-row call
        gives it (the same dot products, in the same order). None while the model has what
        the C step would run past (see _fused_now): the caller runs its torch path."""
        n = len(tokens)
        if not 1 <= n <= self.max_tokens or not n == len(positions) == len(slots):
            raise ValueError(
                f"{n} tokens, {len(positions)} positions, {len(slots)} slots: the fused step "
                f"takes 1 to {self.max_tokens} rows, one of each per row"
            )
        if len(set(slots)) != n or not all(0 <= s < cache.batch_size for s in slots):
            raise ValueError(f"slots {slots}: each row needs its own slot of the cache's")
        cfg = self.cfg
        for token, position in zip(tokens, positions, strict=True):
            if not 0 <= position < cache.max_seq_len:
                raise ValueError(f"position {position} is outside the cache's {cache.max_seq_len}")
            if self.model.pos_emb is not None and position >= cfg.max_seq_len:
                raise ValueError(
                    f"position {position} is past max_seq_len={cfg.max_seq_len}, the most "
                    f"positions a model with {cfg.position} positions knows"
                )
            if not 0 <= token < cfg.vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary ({cfg.vocab_size})")
        if not self._fused_now():
            self.picks = None
            return None
        self._point_at(cache, 0)
        row_stride = cache.k.stride(1)  # elements from one slot's block to the next's
        ids = (ctypes.c_int64 * n)(*tokens)
        at = (ctypes.c_int64 * n)(*positions)
        offsets = (ctypes.c_int64 * n)(*(slot * row_stride for slot in slots))
        logits, picks = torch.empty(n, cfg.vocab_size), (ctypes.c_int64 * n)()
        self._rows_function(
            ctypes.byref(self._struct), ids, n, at, offsets, logits.data_ptr(), picks,
            torch.get_num_threads(),
        )  # fmt: skip
        self.picks = list(picks)
        return logits

    def _modules_step(self, tokens: list[int], position: int, cache: KVCache, slot: int) -> Tensor:
        """many() through the torch modules, for a model that now has what the C step would
        run past (hooks, a capture, an adapter): the forward the Engine runs without the step."""
        ids = torch.tensor([tokens], device=self.model.device)  # (1, n)
        positions = torch.arange(position, position + len(tokens), device=ids.device)
        view = cache.rows(slot, slot + 1)
        return self.model(ids, positions, cache=view)[0].float()  # (n, V)


def _versions(tensors: list[Tensor]) -> list[int]:
    """Each tensor's in-place write count; -1 for an inference tensor (made under
    torch.inference_mode), which keeps none."""
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:
        return [-1 if t.is_inference() else t._version for t in tensors]
