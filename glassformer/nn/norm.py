"""LayerNorm and RMSNorm (seed 000 §5.3): the per-token "voltage regulator" of every layer.

LayerNorm centers and scales each token's vector, then applies a learned gain γ and shift β;
RMSNorm (Llama) skips the centering and the shift. Both normalize in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.config import ModelConfig


def upcast(x: Tensor) -> Tensor:
    """x in at least float32: bf16/fp16 go up for precision-sensitive steps (norms, softmax,
    rotations), float64 stays float64 (so a float64 reference model is float64 throughout)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # x / sqrt(mean(x^2) + eps) in (at least) float32, then the gain in x's dtype (as
        # Llama does); F.rms_norm is that formula in one fused op: one call, not six per token.
        normed = F.rms_norm(upcast(x), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.d_model
    if cfg.norm == "rms":
        return RMSNorm(dim, cfg.norm_eps)
    return LayerNorm(dim, cfg.norm_eps, bias=cfg.norm_bias)
