"""int8 and int4 weight-only quantization (seed 002: a model is its numbers; seed 000 §2.5.1:
decode is memory-bound, so fewer bytes per weight is more tokens per second).

Each Linear weight is stored as int8 with float scales: w ~= q * scale, symmetric, scale =
max|w| / 127 over a group of weights. With one group per output row (per-channel scaling) an
outlier input column costs its whole row precision; groups of `group_size` columns (64 by
default; 32 is llama.cpp's Q8_0) bound that damage to one group for 4 more bytes per group.
Activations stay float: the int8 rows are turned back into floats inside the matrix-vector kernel
(glassformer/kernels), or, when many rows come at once (prefill), multiplied on the tile unit's
bf16 products with x in three exact bf16 pieces (AMX: kernels/tiles_split.h), else dequantized
a slice at a time for an fp32 matmul: the same function each way, in another order.

int4 (Int4Linear) is asymmetric, llama.cpp's Q4_1: each group of 32 weights keeps a float scale
and a float min, w ~= scale * q + min with q in 0..15 (scale = (max - min) / 15, min = the
group's least weight), two q a byte in GGUF's order. The same form holds GGUF's Q4_0, Q4_1
and Q4_K blocks exactly (interop/gguf_blocks.py reads them into it without going through
float). About 6 bits a weight with float32 scales and mins (5 in llama.cpp's Q4_1, whose scales
are fp16).

w8a8 and w4a8 (round_inputs) go one step further, as llama.cpp does: each module's input is
rounded to int8 too, in groups of 32 columns (round_to_int8), so the decode step's products are
integer sums (glassformer/kernels/a8.h) instead of a float conversion per weight, and a prompt's
many rows are products of int8 tiles on the CPU's tile unit where it has one (AMX:
kernels/tiles_a8.h, kernels.matmul_a8), else rounded here and multiplied in floats. That
changes the function computed (benchmarks/quantization.py measures by how much), so it is a
precision of its own, never what int8 or int4 run.

Shapes: O output features, K input features, G = K / group_size groups per row.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glassformer import kernels

# Columns per scale. Measured on SmolLM2 (benchmarks/quantization.py, 4096 Hamlet tokens):
# perplexity +1.08% with one scale per row, +0.13% with groups of 64, +0.12% with 32 (llama.cpp's
# Q8_0 blocks, used for Q8_0 GGUF files); 64 decodes ~14% faster than 32.
DEFAULT_GROUP_SIZE = 64


def check_group_size(group_size: int | None, in_features: int) -> int:
    """The group size to use for a K-column weight: None means per-channel (group = K)."""
    if group_size is None:
        return in_features
    if not isinstance(group_size, int) or group_size < 1 or in_features % group_size:
        raise ValueError(
            f"group_size={group_size!r} does not divide in_features={in_features}: use a "
            f"divisor of it (32 as llama.cpp's Q8_0), or None for one scale per output row"
        )
    return group_size


def quantize_groupwise(weight: Tensor, group_size: int | None = DEFAULT_GROUP_SIZE):
    """Symmetric int8: (O, K) float -> q int8 (O, K), scales float32 (O, G).

    |w - q * scale| <= scale / 2 for every weight; an all-zero group gets scale 1 and q = 0."""
    w = weight.detach().float()  # (O, K)
    O, K = w.shape
    group = check_group_size(group_size, K)
    groups = w.view(O, K // group, group)  # (O, G, group)
    scales = groups.abs().amax(dim=-1) / 127  # (O, G)
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(groups / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(O, K), scales


def round_to_int8(x: Tensor) -> Tensor:
    """x (..., K) rounded to int8 in groups of 32 columns and given back as floats: d * q with
    d = max|x| / 127 over the group and q = round(x * (1 / d)) in -127..127 (ties to even), the
    rounding the decode step's a8.h applies to every input of a round_inputs module (llama.cpp's
    Q8_0 activations). K must be a multiple of 32."""
    groups = x.float().unflatten(-1, (-1, 32))
    d = groups.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(groups * inverse) * d).flatten(-2).to(x.dtype)


class Int8Linear(nn.Module):
    """A Linear with an int8 weight (O, K) and float32 scales (O, G): y = x (q * s)^T + b.

    Inference only (the int8 weight has no gradient). The output has the input's dtype.
    round_inputs (w8a8): x is rounded to int8 first (round_to_int8)."""

    round_inputs = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        group_size: int | None = DEFAULT_GROUP_SIZE,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = check_group_size(group_size, in_features)
        n_groups = in_features // self.group_size
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("scales", torch.ones(out_features, n_groups, device=device))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group_size: int | None = DEFAULT_GROUP_SIZE
    ) -> Int8Linear:
        """Quantize an nn.Linear (its weight is copied, never shared)."""
        weight = linear.weight
        module = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            group_size=group_size,
            device=weight.device,
        )
        q, scales = quantize_groupwise(weight, group_size)
        module.weight.copy_(q)
        module.scales.copy_(scales)
        module.bias = frozen_copy(linear.bias)
        return module

    def dequantize(self) -> Tensor:
        """The float32 weight (O, K) this module computes with: q * scale."""
        return kernels.dequantize(self.weight, self.scales, torch.float32)

    def forward(self, x: Tensor) -> Tensor:
        y = kernels.matmul_a8(x, self.weight, self.scales) if self.round_inputs else None
        if y is None:  # weight-only, or no tile unit here: round x, then the float product
            y = kernels.matvec(
                round_to_int8(x) if self.round_inputs else x, self.weight, self.scales
            )
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, group_size={self.group_size}"
            + (", inputs=int8" if self.round_inputs else "")
        )


def frozen_copy(bias: Tensor | None) -> nn.Parameter | None:
    """A quantized Linear's own float32 copy of a bias, without gradient (None stays None)."""
    if bias is None:
        return None
    return nn.Parameter(bias.detach().float().clone(), requires_grad=False)


def fitting_group_size(group_size: int | None, in_features: int) -> int | None:
    """group_size if it divides in_features, else 32 (Q8_0's blocks) if that does, else None
    (one scale per row): a model whose widths are not multiples of 64 still quantizes."""
    for group in (group_size, 32):
        if group is None or in_features % group == 0:
            return group
    return None


def quantize_int8(model: nn.Module, group_size: int | None = DEFAULT_GROUP_SIZE) -> nn.Module:
    """Replace every nn.Linear in a GPT's blocks, and its lm_head, by an Int8Linear (in place;
    the model is returned, in eval mode). Forward, KV cache and Engine work unchanged.

    Tied embeddings: the lm_head becomes its own int8 copy and the embedding lookup keeps the
    float table (SmolLM2: 113 MB fp32 table + 28 MB int8 head; the table is only read one row
    per token). MoE routers stay float: top-k routing turns tiny logit differences into
    different experts, and a router is a small matrix. A layer whose width group_size does not
    divide gets the next fitting grouping (fitting_group_size)."""
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size={group_size!r} must be a positive integer or None")

    def int8(linear: nn.Linear) -> Int8Linear:
        return Int8Linear.from_linear(linear, fitting_group_size(group_size, linear.in_features))

    return replace_linears(model, int8, int8, "quantize_int8")


def replace_linears(model: nn.Module, block_linear, head_linear, who: str) -> nn.Module:
    """Swap each nn.Linear of a GPT's blocks for block_linear(it) (None keeps it float) and the
    lm_head for head_linear(it), in place, MoE routers excepted; returns the model in eval
    mode. `who` names the caller in the error for other families."""
    cfg = getattr(model, "cfg", None)
    family = getattr(cfg, "family", type(model).__name__)
    if family != "gpt" or not hasattr(model, "blocks") or not hasattr(model, "lm_head"):
        raise ValueError(
            f"{who} supports GPT-family models (GPT-2, Llama, SmolLM2), not {family!r}: "
            "load a decoder-only checkpoint, or run this model in float"
        )
    model.eval()
    with torch.no_grad():
        for parent in list(model.blocks.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and name != "router":
                    replacement = block_linear(child)
                    if replacement is not None:
                        setattr(parent, name, replacement)
        if isinstance(model.lm_head, nn.Linear):
            model.lm_head = head_linear(model.lm_head)
    return model


# --- int4 ------------------------------------------------------------------------------------


def quantize_q4(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric int4 in groups of 32: (O, K) float -> packed uint8 (O, K/2), scales and mins
    float32 (O, K/32). |w - (scale q + min)| <= scale / 2; a constant group gets scale 1, q 0."""
    w = weight.detach().float()
    O, K = w.shape
    if K % kernels.Q4_GROUP:
        raise ValueError(
            f"int4 packs groups of {kernels.Q4_GROUP} weights: in_features={K} is not a multiple "
            f"of {kernels.Q4_GROUP}; quantize this model to int8 instead"
        )
    groups = w.view(O, K // kernels.Q4_GROUP, kernels.Q4_GROUP)  # (O, G, 32)
    mins, maxs = groups.amin(dim=-1), groups.amax(dim=-1)  # (O, G)
    scales = (maxs - mins) / 15
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round((groups - mins[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # byte j: weight j (low), weight j + 16 (high)
    return packed.reshape(O, K // 2), scales, mins


class Int4Linear(nn.Module):
    """A Linear with int4 weights (uint8 (O, K/2), two a byte), float32 scales and mins (O,
    K/32): y = x (scale q + min)^T + b. Inference only; the output has the input's dtype.
    round_inputs (w4a8): x is rounded to int8 first (round_to_int8)."""

    round_inputs = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        n_groups = in_features // kernels.Q4_GROUP
        self.register_buffer(
            "weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
        )
        self.register_buffer("scales", torch.ones(out_features, n_groups, device=device))
        self.register_buffer("mins", torch.zeros(out_features, n_groups, device=device))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int4Linear:
        """Quantize an nn.Linear (its weight is copied, never shared)."""
        weight = linear.weight
        module = cls(
            linear.in_features, linear.out_features, linear.bias is not None, device=weight.device
        )
        packed, scales, mins = quantize_q4(weight)
        module.weight.copy_(packed)
        module.scales.copy_(scales)
        module.mins.copy_(mins)
        module.bias = frozen_copy(linear.bias)
        return module

    def dequantize(self) -> Tensor:
        """The float32 weight (O, K) this module computes with: scale q + min."""
        return kernels.dequantize(self.weight, self.scales, torch.float32, self.mins)

    def forward(self, x: Tensor) -> Tensor:
        y = kernels.matmul_a8(x, self.weight, self.scales, self.mins) if self.round_inputs else None
        if y is None:
            x = round_to_int8(x) if self.round_inputs else x
            y = kernels.matvec(x, self.weight, self.scales, self.mins)  # (..., O)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, group_size={kernels.Q4_GROUP}"
            + (", inputs=int8" if self.round_inputs else "")
        )


def int4_fits(linear: nn.Linear) -> bool:
    """Whether quantize_int4 packs this Linear of a block: its width is whole groups of 32."""
    return linear.in_features % kernels.Q4_GROUP == 0


def quantize_int4(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in a GPT's blocks by an Int4Linear, and the lm_head by an
    Int8Linear with groups of 32 (in place; returns the model, in eval mode).

    The head stays at 8 bits as llama.cpp keeps its output matrix above the blocks' precision:
    every logit passes through it (SmolLM2's Q4_1 file stores it as Q8_0, which int8 with
    groups of 32 gives back exactly). As quantize_int8: the embedding table stays float, MoE
    routers stay float, and a layer whose width is not a multiple of 32 stays float too."""

    def int4(linear: nn.Linear) -> Int4Linear | None:
        return Int4Linear.from_linear(linear) if int4_fits(linear) else None

    def head(linear: nn.Linear) -> Int8Linear:
        return Int8Linear.from_linear(linear, fitting_group_size(32, linear.in_features))

    return replace_linears(model, int4, head, "quantize_int4")


def round_inputs(model: nn.Module) -> nn.Module:
    """w8a8 / w4a8: every Int8Linear and Int4Linear of a quantized model rounds its input to
    int8 in groups of 32 before its product (round_to_int8; in place, returns the model).
    Refuses a model with none, and one whose int8 groups are not whole groups of 32."""
    modules = [m for m in model.modules() if isinstance(m, Int8Linear | Int4Linear)]
    if not modules:
        raise ValueError(
            "round_inputs rounds the inputs of int8 and int4 weights, and this model has none: "
            "quantize it first (quantize_int8, quantize_int4)"
        )
    for module in modules:
        group = getattr(module, "group_size", kernels.Q4_GROUP)
        if module.in_features % 32 or group % 32:
            raise ValueError(
                f"round_inputs needs widths and weight groups in multiples of 32: a module has "
                f"{module.in_features} inputs in groups of {group}"
            )
    for module in modules:
        module.round_inputs = True
    return model


def precision_name(model: nn.Module) -> str:
    """What a model decodes in: int4 or int8 (its blocks' Linears), w4a8 or w8a8 when their
    inputs are rounded to int8 too, else its float dtype (fp32, bf16, fp16)."""
    quantized = [m for m in model.modules() if isinstance(m, Int4Linear | Int8Linear)]
    if quantized:
        bits = "4" if any(isinstance(m, Int4Linear) for m in quantized) else "8"
        return f"w{bits}a8" if quantized[0].round_inputs else f"int{bits}"
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def parameter_count(model: nn.Module) -> int:
    """Parameters, with an Int8Linear's weight counted as the parameters it stands for (it is a
    buffer) and shared (tied) parameters once: a tied lm_head's int8 copy of the embedding
    table (quantize_int8) is the embedding's, already counted."""
    total = sum(p.numel() for p in model.parameters())
    tied = getattr(getattr(model, "cfg", None), "tie_embeddings", False)
    head = getattr(model, "lm_head", None) if tied else None
    return total + sum(
        m.in_features * m.out_features
        for m in model.modules()
        if isinstance(m, Int8Linear | Int4Linear) and m is not head
    )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer, counting shared (tied) storage once."""
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict().values():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += tensor.untyped_storage().nbytes()
    return total


def refuse_quantized(model: nn.Module, action: str) -> None:
    """A clear error for saving a quantized model into a float checkpoint format."""
    if any(isinstance(m, Int8Linear | Int4Linear) for m in model.modules()):
        raise ValueError(
            f"cannot {action} a quantized model: save the float model and quantize after "
            "loading (from_pretrained(..., quantize='int8' or 'int4'), --quantize)"
        )
