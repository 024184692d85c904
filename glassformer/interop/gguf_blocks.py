"""A GGUF file's 4-bit weights kept as they are: Q4_0, Q4_1 and Q4_K blocks become an
Int4Linear's packed nibbles, scales and mins without passing through float (seed 002: a
4-bit file holds the same Transformer, each weight a small integer times a block scale).

All three are `w = scale * q + min` with q in 0..15 over groups of 32 weights, the form
Int4Linear keeps (llama.cpp's Q4_1), so each converts exactly:

    Q4_0  (18 bytes / 32)   d fp16, 16 bytes of nibbles        scale = d,      min = -8 d
    Q4_1  (20 bytes / 32)   d fp16, m fp16, 16 bytes           scale = d,      min = m
    Q4_K  (144 bytes / 256) d, dmin fp16, 12 bytes of 6-bit    scale = d sc_j, min = -dmin m_j
                            (sc_j, m_j) for 8 sub-blocks of 32, 128 bytes of nibbles

(an fp16 times a 6-bit integer is exact in float32). Q4_0 and Q4_1 store byte j of a block
as weights j (low nibble) and j + 16 (high), Int4Linear's order. Q4_K stores 64 weights per
32 bytes instead, weight l in the low nibble of byte l and weight 32 + l in its high nibble,
so its nibbles are regrouped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from glassformer.interop.gguf_file import LazyTensor, read_gguf
from glassformer.interop.integrity import InteropError

FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")  # what q4_blocks reads
ABOVE_FOUR_BITS = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_0", "Q5_1", "Q5_K")


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes (..., 2) -> float32 (...)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _pack(q: np.ndarray) -> np.ndarray:
    """Nibbles (..., 32) in weight order -> (..., 16) bytes, byte j = q_j | q_{j+16} << 4."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes (..., 12) -> the 6-bit scales and mins (..., 8) of its sub-blocks:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the
    nibbles of bytes 8-11 with their top two bits in the spare bits of bytes 0-7."""
    raw = raw.astype(np.uint8)
    low, high, rest = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    scales = np.concatenate([low & 63, (rest & 15) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (rest >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def q4_blocks(tensor: Any) -> tuple[Tensor, Tensor, Tensor]:
    """A Q4_0 / Q4_1 / Q4_K GGUF matrix -> Int4Linear's (packed uint8 (O, K/2), scales and
    mins float32 (O, K/32)), in PyTorch's (out, in) order, bit for bit the file's weights."""
    kind = tensor.tensor_type.name
    out_features, in_features = (int(d) for d in reversed(tensor.shape.tolist()))
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(out_features, -1)
    if kind in ("Q4_0", "Q4_1"):
        blocks = raw.reshape(out_features, in_features // 32, -1)  # (O, G, 18 or 20)
        scales = _fp16(blocks[..., 0:2])
        if kind == "Q4_0":
            mins, packed = -8 * scales, blocks[..., 2:18]
        else:
            mins, packed = _fp16(blocks[..., 2:4]), blocks[..., 4:20]
    elif kind == "Q4_K":
        blocks = raw.reshape(out_features, in_features // 256, 144)  # (O, S, 144)
        sc, m = _k_scales(blocks[..., 4:16])  # (O, S, 8)
        scales = _fp16(blocks[..., 0:2])[..., None] * sc
        mins = -(_fp16(blocks[..., 2:4])[..., None] * m)
        qs = blocks[..., 16:].reshape(out_features, -1, 4, 32)  # (O, S, chunk, byte)
        q = np.stack([qs & 15, qs >> 4], axis=3)  # (O, S, chunk, low/high, 32): sub-block order
        packed = _pack(q)  # (O, S, 4, 2, 16)
    else:
        raise InteropError(f"tensor {tensor.name} is {kind}, not one of {', '.join(FOUR_BIT)}")
    rows = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(out_features, -1))  # noqa: E731
    return rows(packed), rows(scales.astype(np.float32)), rows(mins.astype(np.float32))


def keep_file_blocks(model: torch.nn.Module, path: str | Path) -> torch.nn.Module:
    """Before quantize_int4, on the float model loaded from the GGUF file at `path`: each
    nn.Linear of the blocks whose source matrices the file stores at 4 bits becomes an
    Int4Linear holding their blocks as they are, and one with a source stored above 4 bits
    (Q5/Q6/Q8, F16, F32: Q4_K_M files keep some attn_v and ffn_down at Q6_K) becomes int8 in
    groups of 32 from the file's values, as llama.cpp keeps those layers above 4 bits (a fused
    qkv_proj whose v is Q6_K included). quantize_int4 then quantizes what is still float (the
    lm_head, a matrix stored below 4 bits) and leaves these as they are. Returns the model."""
    from glassformer.interop.gguf import SUPPORTED_ARCHITECTURES, rules
    from glassformer.nn.quant import Int4Linear, Int8Linear, frozen_copy, int4_fits

    file = read_gguf(path)
    for rule in rules(model.cfg, permuted=SUPPORTED_ARCHITECTURES[file.architecture]):
        name, _, kind = rule.target.rpartition(".")
        module = model.get_submodule(name) if kind == "weight" else None
        # The blocks' Linears that quantize_int4 packs (as replace_linears: routers stay float)
        in_blocks = name.startswith("blocks.") and not name.endswith(".router")
        if type(module) is not torch.nn.Linear or not in_blocks or not int4_fits(module):
            continue
        types = {file.tensors[s].tensor_type.name for s in rule.sources}
        with torch.no_grad():
            if types <= set(FOUR_BIT):
                kept = Int4Linear(module.in_features, module.out_features, bias=False)
                # The rules only concatenate and permute rows, so they apply to each part.
                parts = zip(*(q4_blocks(file.tensors[s]) for s in rule.sources), strict=True)
                buffers = (kept.weight, kept.scales, kept.mins)
                for buffer, pieces in zip(buffers, parts, strict=True):
                    buffer.copy_(rule.load(list(pieces)))
            elif types <= set(FOUR_BIT + ABOVE_FOUR_BITS):  # some above 4 bits
                exact = torch.nn.Linear(module.in_features, module.out_features, bias=False)
                values = [LazyTensor(file.tensors[s], str(file.path)).load() for s in rule.sources]
                exact.weight.copy_(rule.load(values))
                kept = Int8Linear.from_linear(exact, group_size=32)
            else:
                continue
            kept.bias = frozen_copy(module.bias)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, kept)
    return model
