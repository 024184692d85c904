"""Preparing a model for fast generation (seed 000 §2.5.1: prefill is compute-bound, decode is
memory-bound).

A decode step multiplies one activation row by every weight matrix, so its speed is the speed
of streaming the weights from memory. `optimize_for_decode` swaps each nn.Linear of the blocks
and the lm_head for a `DecodeLinear`, which sends few-row inputs (decode, speculative
verification, small batches) to the matrix-vector kernels in glassformer/kernels and many-row
inputs (prefill) to torch's matmul. Nothing else changes: the same attention, KV cache and
Engine run, and tests hold the optimized model to the plain one.

    model = optimize_for_decode(model)                  # fp32 weights, kernels for decode
    model = optimize_for_decode(model, dtype="bf16")    # half the bytes per token
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glassformer import kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class DecodeLinear(nn.Module):
    """y = x W^T + b for inference, W stored (out, in) in fp32 or bf16.

    The weight may be shared with another module (a tied embedding table): the kernel reads
    rows of W, which is the embedding's own layout, so tying costs no copy."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.weight = _parameter(weight)
        self.bias = None if bias is None else _parameter(bias)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        y = kernels.matvec(x, self.weight)  # (..., out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, dtype={self.weight.dtype}, "
            f"kernel={'yes' if kernels.available() else 'no (F.linear)'}"
        )


def _parameter(tensor: Tensor) -> nn.Parameter:
    # An existing Parameter is kept as is, so a tied head and embedding stay one tensor.
    if isinstance(tensor, nn.Parameter):
        return tensor
    return nn.Parameter(tensor, requires_grad=False)


def optimize_for_decode(model: nn.Module, dtype: str = "fp32") -> nn.Module:
    """Cast the model to `dtype` ("fp32" or "bf16") and replace the Linear layers of its
    blocks and its lm_head by DecodeLinear, in place; returns the model, in eval mode.

    bf16 runs the whole model in bf16 (as transformers' torch_dtype=bfloat16 does): prefill's
    matmuls use torch's bf16 kernels (on a CPU without bf16 instructions, fp32 matmuls on the
    weights widened exactly: kernels.matvec), decode's matrix-vector products read 2-byte
    weights and accumulate in fp32. MoE routers stay nn.Linear (tiny, and routing is sensitive)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported: pick one of {', '.join(DTYPES)}")
    if not hasattr(model, "blocks") or not hasattr(model, "lm_head"):
        raise ValueError(
            f"optimize_for_decode works on decoder-only models (GPT family), not "
            f"{type(model).__name__}"
        )
    model = model.to(DTYPES[dtype]).eval()
    with torch.no_grad():
        for parent in list(model.blocks.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and name != "router":
                    setattr(parent, name, DecodeLinear(child.weight, child.bias))
        if type(model.lm_head) is nn.Linear:
            # A tied head keeps sharing the embedding table's tensor.
            model.lm_head = DecodeLinear(model.lm_head.weight)
    return model
