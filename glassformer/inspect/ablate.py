"""Switching attention heads off (seed 000 §4.2: "头剪枝研究：剪掉相当比例的头模型性能几乎不掉").

Shapes: B batch, T time, H query heads, D head dim, C channels (d_model).

    with gf.inspect.ablate_heads(model, {0: [1, 3], 2: [0]}):
        loss = model.loss(ids, targets).ce_loss   # heads (0,1), (0,3), (2,0) contribute nothing

A head's output is its D-wide slice of the concatenated (B, T, H*D) input of the attention's
output projection W_O (MultiHead = Concat(head_1..head_h) W_O). A forward pre-hook on out_proj
multiplies the chosen slices by zero, exactly as if W_O's columns for that head were zero. With
GQA the removed heads are query heads: a shared key/value head keeps serving the others.
Everything is restored on exit, also when the forward raises.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from glassformer.inspect.capture import ATTENTION_KINDS, _family
from glassformer.nn.attention import Attention

HeadSpec = Mapping[int, Iterable[int]]  # {layer index: [query head indices]}


def attention_layers(model: nn.Module, kind: str | None = None) -> list[Attention]:
    """The model's attention modules of one kind, in layer order: "self" for GPT and BERT;
    "encoder" (default), "decoder" or "cross" for seq2seq."""
    family = _family(model)
    kinds = {k: (stack, attr) for k, stack, attr in ATTENTION_KINDS[family]}
    kind = kind or next(iter(kinds))
    if kind not in kinds:
        raise ValueError(
            f"kind={kind!r} is not an attention of a {family} model: pick {list(kinds)}"
        )
    stack, attr = kinds[kind]
    return [getattr(block, attr) for block in getattr(model, stack)]


def _validate(heads: HeadSpec, layers: list[Attention]) -> dict[int, list[int]]:
    if not isinstance(heads, Mapping):
        raise TypeError(
            f"heads must be a dict {{layer: [head, ...]}}, got {type(heads).__name__}: e.g. "
            "{0: [1, 3]} removes heads 1 and 3 of layer 0"
        )
    chosen: dict[int, list[int]] = {}
    for layer, layer_heads in heads.items():
        if not isinstance(layer, int) or not 0 <= layer < len(layers):
            raise ValueError(
                f"layer {layer!r} does not exist: the model has layers 0..{len(layers) - 1}"
            )
        n_heads = layers[layer].n_heads
        picked = sorted(set(layer_heads))
        for head in picked:
            if not isinstance(head, int) or not 0 <= head < n_heads:
                raise ValueError(
                    f"head {head!r} of layer {layer} does not exist: pick query heads "
                    f"0..{n_heads - 1}"
                )
        if picked:
            chosen[layer] = picked
    return chosen


def _zero_heads_hook(keep: Tensor):
    """A pre-hook on out_proj: its input (B, T, H*D) times keep (H*D,), 0 on removed heads."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        return (x * keep.to(dtype=x.dtype, device=x.device), *rest)

    return hook


@contextmanager
def ablate_heads(model: nn.Module, heads: HeadSpec, kind: str | None = None) -> Iterator[None]:
    """While active, the listed query heads contribute nothing to their layer's output.

    heads: {layer: [head, ...]}; an empty dict (or empty lists) changes nothing.
    kind: which attention, see attention_layers."""
    layers = attention_layers(model, kind)
    chosen = _validate(heads, layers)
    handles = []
    try:
        for layer, layer_heads in chosen.items():
            attn = layers[layer]
            keep = torch.ones(attn.n_heads, attn.head_dim)  # (H, D)
            keep[layer_heads] = 0.0
            hook = _zero_heads_hook(keep.flatten())  # (H*D,), the layout of Concat(heads)
            handles.append(attn.out_proj.register_forward_pre_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def all_heads(model: nn.Module, kind: str | None = None) -> list[tuple[int, int]]:
    """Every (layer, head) pair of one attention kind, layer by layer."""
    return [
        (i, h) for i, attn in enumerate(attention_layers(model, kind)) for h in range(attn.n_heads)
    ]


def as_spec(pairs: Iterable[tuple[int, int]]) -> dict[int, list[int]]:
    """(layer, head) pairs -> the {layer: [heads]} that ablate_heads takes."""
    spec: dict[int, list[int]] = {}
    for layer, head in pairs:
        spec.setdefault(layer, []).append(head)
    return spec
