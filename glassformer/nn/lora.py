"""LoRA: fine-tune a frozen model through small low-rank updates (seed 002: "LoRA 敢只训 1% 参数，
赌的就是'底子不用动'"; the matrices it moves are the attention projections of seed 000 §3.3).

A frozen weight W (O, K) gets an update B A of rank r: y = x W^T + (alpha / r) * B(A(dropout(x))),
with A (r, K) random (Kaiming-uniform, as peft) and B (O, r) zero, so training starts from the
unchanged model. Only A and B learn: r (O + K) numbers instead of O K.

glassformer fuses q|k|v into one qkv_proj and gate|up into one gate_up. A LoRA on "q" is an
adapter on the q rows of qkv_proj only: `LoRALinear` carries one (A, B) per row slice, so
"q,v" puts two adapters on one fused matrix, exactly as peft puts one on q_proj and one on
v_proj. The base may be a float nn.Linear or an int8 `Int8Linear` (the QLoRA idea on the CPU:
frozen int8 weights, adapters in float).

    names = apply_lora(model, "q,v", rank=8, alpha=16)   # freezes the rest, returns sites
    ... train lora_parameters(model) ...
    merge_lora(model)                                    # plain Linears again, same function

Shapes: O output features, K input features, r rank, S rows of one slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.nn.quant import Int8Linear, parameter_count

# The short names a target list may use, by the leaf name of the Linear they live in: each is a
# block of output rows of that Linear (None = all its rows). Sizes are resolved per model.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q", "k", "v"),
    "kv_proj": ("k", "v"),  # cross-attention
    "gate_up": ("gate", "up"),
}
WHOLE_PARTS: dict[str, str] = {
    "qkv_proj": "qkv",
    "kv_proj": "kv",
    "q_proj": "q",  # cross-attention's query
    "out_proj": "o",
    "gate_up": "gate_up",
    "down": "down",
    "fc_in": "fc_in",
    "fc_out": "fc_out",
}
# Hugging Face spellings of the same parts (Llama's q_proj ... down_proj, GPT-2's c_attn, c_fc).
ALIASES: dict[str, str] = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "out_proj": "o",
    "qkv_proj": "qkv",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "c_attn": "qkv",
    "c_fc": "fc_in",
}
# "all-linear" is, as in peft, every projection of the blocks, fused ones as their parts (q, k,
# v, gate, up), so each gets its own adapter; not the lm_head (peft leaves the output layer
# alone) nor MoE routers.


@dataclass(frozen=True)
class LoRASite:
    """One place an adapter can go: rows [start, start + size) of the Linear `module`.

    `name` is the module name for a whole Linear, or module + "." + part for a block of rows of
    a fused one (blocks.0.attn.qkv_proj.q)."""

    name: str
    module: str
    part: str
    start: int
    size: int


class LoRALinear(nn.Module):
    """A frozen Linear (or Int8Linear) plus one low-rank adapter per block of output rows.

    y = base(x), then rows [start, start + S) get + scaling * B(A(dropout(x))) for each adapter.
    `merge()` folds the adapters into a float base weight (W[rows] += scaling * B A) and
    `unmerge()` takes them out again."""

    def __init__(
        self,
        base: nn.Module,
        slices: list[tuple[int, int]] | None = None,
        rank: int | list[int] = 8,
        alpha: float | list[float] = 16.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not isinstance(base, (nn.Linear, Int8Linear)):
            raise TypeError(f"LoRA wraps nn.Linear or Int8Linear, not {type(base).__name__}")
        self.base = base
        self.slices = sorted(slices or [(0, base.out_features)])
        n = len(self.slices)
        ranks = rank if isinstance(rank, list) else [rank] * n
        alphas = alpha if isinstance(alpha, list) else [alpha] * n
        self.ranks = [check_rank(r) for r in ranks]
        self.alphas = [check_alpha(a) for a in alphas]
        self.scalings = [a / r for a, r in zip(self.alphas, self.ranks, strict=True)]
        self.dropout = nn.Dropout(check_dropout(dropout)) if dropout > 0 else nn.Identity()
        # Adapters in the base's float dtype; fp32 over an int8 base.
        weight = base.weight
        dtype = weight.dtype if weight.is_floating_point() else torch.float32
        self.lora_A = nn.ParameterList()
        self.lora_B = nn.ParameterList()
        for (start, size), r in zip(self.slices, self.ranks, strict=True):
            if start < 0 or size < 1 or start + size > base.out_features:
                raise ValueError(
                    f"rows [{start}, {start + size}) are outside the {base.out_features} "
                    "output rows of the wrapped Linear"
                )
            A = torch.empty(r, base.in_features, dtype=dtype, device=weight.device)
            nn.init.kaiming_uniform_(A, a=math.sqrt(5))  # as nn.Linear and peft
            self.lora_A.append(nn.Parameter(A))  # (r, K)
            self.lora_B.append(nn.Parameter(torch.zeros(size, r, dtype=dtype, device=A.device)))
        self.merged = False

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def delta(self, i: int, x: Tensor) -> Tensor:
        """Adapter i's update for its rows: scaling * B A dropout(x), (..., S)."""
        A, B = self.lora_A[i], self.lora_B[i]
        h = F.linear(self.dropout(x).to(A.dtype), A)  # (..., r)
        return F.linear(h, B) * self.scalings[i]  # (..., S)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)  # (..., O)
        if self.merged:
            return y
        # Each adapted block of rows gets its update in place (rows without an adapter pass
        # through): no copy of the whole output. Autograd allows it: a linear layer's backward
        # needs its input and weight, not its output.
        for i, (start, size) in enumerate(self.slices):
            y[..., start : start + size] += self.delta(i, x).to(y.dtype)
        return y

    def delta_weight(self, i: int) -> Tensor:
        """Adapter i as a weight update for its rows: scaling * B A, (S, K)."""
        return (self.lora_B[i] @ self.lora_A[i]) * self.scalings[i]

    def _fold(self, sign: float) -> None:
        if isinstance(self.base, Int8Linear):
            raise ValueError(
                "cannot merge LoRA into an int8 base: rounding W + BA back to int8 would lose "
                "most of the small update. Load the float model, load_adapter, merge_lora, "
                "then quantize (from_pretrained(..., quantize='int8') after saving, or "
                "quantize_int8(model))"
            )
        with torch.no_grad():
            weight = self.base.weight
            for i, (start, size) in enumerate(self.slices):
                weight[start : start + size] += sign * self.delta_weight(i).to(weight.dtype)

    def merge(self) -> None:
        """Fold the adapters into the base weight (forward then costs one matmul again)."""
        if not self.merged:
            self._fold(+1.0)
            self.merged = True

    def unmerge(self) -> None:
        """Take the adapters back out of the base weight."""
        if self.merged:
            self._fold(-1.0)
            self.merged = False

    def extra_repr(self) -> str:
        parts = ", ".join(
            f"rows {s}:{s + n} r={r} alpha={a:g}"
            for (s, n), r, a in zip(self.slices, self.ranks, self.alphas, strict=True)
        )
        return f"{parts}, merged={self.merged}"


# --- checks -----------------------------------------------------------------------------------


def check_rank(rank: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank={rank!r} must be a whole number >= 1 (8 or 16 are usual)")
    return rank


def check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(
            f"LoRA alpha={alpha!r} must be a number > 0: the update is scaled by alpha / rank "
            "(alpha = 2 * rank is usual, e.g. 16 for rank 8)"
        )
    return float(alpha)


def check_dropout(dropout: float) -> float:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise ValueError(f"LoRA dropout={dropout!r} must be a number in [0, 1)")
    if not 0 <= dropout < 1:
        raise ValueError(f"LoRA dropout={dropout!r} must be in [0, 1) (0.05 is usual; 0 = off)")
    return float(dropout)


# --- where adapters can go --------------------------------------------------------------------


def _part_sizes(model: nn.Module, module_name: str, linear: nn.Module) -> list[int]:
    """The row sizes of a fused Linear's parts (q | k | v, k | v, gate | up)."""
    leaf = module_name.rsplit(".", 1)[-1]
    if leaf == "qkv_proj":
        attn = model.get_submodule(module_name.rsplit(".", 1)[0])
        q_size, kv_size = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
        return [q_size, kv_size, kv_size]
    half = linear.out_features // 2  # kv_proj and gate_up hold two equal halves
    return [half, half]


def lora_sites(model: nn.Module) -> list[LoRASite]:
    """Every place an adapter can go: each projection Linear of the model whole, and each part of
    a fused one (q, k, v of qkv_proj; gate, up of gate_up). lm_heads, routers and task heads are
    not sites."""
    sites = []
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            module = module.base  # a wrapped Linear is still the site of its name
        elif not isinstance(module, (nn.Linear, Int8Linear)) or name.endswith(".base"):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in WHOLE_PARTS:
            continue
        sites.append(LoRASite(name, name, WHOLE_PARTS[leaf], 0, module.out_features))
        if leaf in FUSED_PARTS:
            start = 0
            sizes = _part_sizes(model, name, module)
            for part, size in zip(FUSED_PARTS[leaf], sizes, strict=True):
                sites.append(LoRASite(f"{name}.{part}", name, part, start, size))
                start += size
    return sites


def resolve_targets(model: nn.Module, targets: str | list[str]) -> list[LoRASite]:
    """The sites a target list names. Each entry is a part name (q, k, v, o, qkv, gate, up,
    gate_up, down, fc_in, fc_out, kv, or a Hugging Face spelling: q_proj, c_attn, ...),
    "all-linear", or a site name or its dotted tail (blocks.0.attn.qkv_proj,
    attn.qkv_proj.q). Every entry must match something."""
    if isinstance(targets, str):
        entries = [t.strip() for t in targets.split(",") if t.strip()]
    elif isinstance(targets, (list, tuple)) and all(isinstance(t, str) for t in targets):
        entries = [t.strip() for t in targets if t.strip()]
    else:
        raise ValueError(f"LoRA targets={targets!r} must be a string like 'q,v' or a list of names")
    if not entries:
        raise ValueError(f"LoRA targets={targets!r} names nothing: give e.g. 'q,v' or 'all-linear'")
    sites = lora_sites(model)
    if not sites:
        raise ValueError(
            f"{type(model).__name__} has no projection Linear LoRA can wrap (qkv_proj, "
            "out_proj, gate_up, down, fc_in, fc_out)"
        )
    chosen: dict[str, LoRASite] = {}
    for entry in entries:
        matched = _match(sites, entry)
        if not matched:
            raise ValueError(_no_match_message(sites, entry))
        for site in matched:
            chosen[site.name] = site
    _refuse_overlaps(list(chosen.values()))
    return list(chosen.values())


def _match(sites: list[LoRASite], entry: str) -> list[LoRASite]:
    if entry == "all-linear":
        # A fused Linear through its parts (each its own adapter), any other Linear whole.
        fused = {s.module for s in sites if s.name != s.module}
        return [s for s in sites if (s.name != s.module) == (s.module in fused)]
    part = ALIASES.get(entry, entry)
    by_part = [s for s in sites if s.part == part]
    if by_part:
        return by_part
    return [s for s in sites if s.name == entry or s.name.endswith("." + entry)]


def _refuse_overlaps(sites: list[LoRASite]) -> None:
    by_module: dict[str, list[LoRASite]] = {}
    for site in sites:
        by_module.setdefault(site.module, []).append(site)
    for group in by_module.values():
        group.sort(key=lambda s: s.start)
        for a, b in pairwise(group):
            if b.start < a.start + a.size:
                raise ValueError(
                    f"LoRA targets overlap: {a.name} and {b.name} cover the same rows; name "
                    f"either the whole Linear or its parts, not both"
                )


def _no_match_message(sites: list[LoRASite], entry: str) -> str:
    parts = sorted({s.part for s in sites})
    modules = [s.name for s in sites]
    shown = ", ".join(modules[:8]) + (f" ... ({len(modules)} in all)" if len(modules) > 8 else "")
    return (
        f"LoRA target {entry!r} matches no module of this model. Parts it has: "
        f"{', '.join(parts)} (or all-linear); module names: {shown}"
    )


# --- applying, counting, merging --------------------------------------------------------------


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def add_adapters(
    model: nn.Module,
    sites: list[LoRASite],
    rank: int | dict[str, int],
    alpha: float | dict[str, float],
    dropout: float = 0.0,
) -> list[str]:
    """Wrap the Linears of `sites` in LoRALinear (one adapter per site; rank and alpha may be
    per site name), freeze every other parameter, and return the site names."""
    if lora_modules(model):
        raise ValueError(
            "this model already has LoRA adapters: merge_lora(model) first, or start from a "
            "fresh base model"
        )
    check_dropout(dropout)
    order = {site.name: i for i, site in enumerate(lora_sites(model))}  # the model's order
    sites = sorted(sites, key=lambda site: order[site.name])
    by_module: dict[str, list[LoRASite]] = {}
    for site in sites:
        by_module.setdefault(site.module, []).append(site)
    for param in model.parameters():
        param.requires_grad_(False)
    for module_name, group in by_module.items():
        group.sort(key=lambda s: s.start)
        ranks = [rank[s.name] if isinstance(rank, dict) else rank for s in group]
        alphas = [alpha[s.name] if isinstance(alpha, dict) else alpha for s in group]
        parent_name, _, leaf = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, leaf)
        wrapper = LoRALinear(base, [(s.start, s.size) for s in group], ranks, alphas, dropout)
        wrapper.train(model.training)  # an adapter added to a model in eval mode drops nothing
        setattr(parent, leaf, wrapper)
    return [s.name for s in sites]


def apply_lora(
    model: nn.Module,
    targets: str | list[str] = "q,v",
    rank: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
) -> list[str]:
    """Put a LoRA adapter (A Kaiming-uniform, B zero: the model is unchanged until trained) on
    every site `targets` names, freeze everything else, and return the site names, e.g.
    ["blocks.0.attn.qkv_proj.q", "blocks.0.attn.qkv_proj.v", ...].

    targets: "q,v"-style part names (q k v o gate up down, qkv gate_up fc_in fc_out, or Hugging
    Face spellings q_proj, c_attn, ...), "all-linear", or site names and their dotted tails
    ("blocks.0.attn.qkv_proj", "attn.qkv_proj.q"); a name that matches nothing is an error
    listing what exists."""
    check_rank(rank)
    check_alpha(alpha)
    check_dropout(dropout)
    sites = resolve_targets(model, targets)
    return add_adapters(model, sites, rank, alpha, dropout)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' A and B matrices: what an optimizer should train."""
    params: list[nn.Parameter] = []
    for _, module in lora_modules(model):
        params += list(module.lora_A) + list(module.lora_B)
    return params


def trainable_fraction(model: nn.Module) -> float:
    """Trainable parameters / all parameters (int8 weights counted as the parameters they are;
    tied tensors once)."""
    total = parameter_count(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable / total if total else 0.0


def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its base weight and put the plain Linear back in its place (in
    place; the model computes the same function with no LoRA modules left). Returns the merged
    module names. An int8 base is refused (see LoRALinear.merge)."""
    merged = []
    for name, module in lora_modules(model):
        module.merge()
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, module.base)
        merged.append(name)
    return merged
