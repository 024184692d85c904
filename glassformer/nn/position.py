"""Positional encodings (seed 000 §4.3): sinusoidal, learned, RoPE with NTK/YaRN/llama3 scaling,
and ALiBi.

Attention is permutation-equivariant; these are the ways order gets back in. Sinusoidal and
learned vectors are added to the token embeddings once; RoPE rotates q and k inside every
layer; ALiBi adds a distance penalty to the attention scores.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.nn.norm import upcast

# --- absolute positions, added to the embeddings --------------------------------------------


def sinusoidal_table(n_positions: int, d_model: int, base: float = 10000.0) -> Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(same), as in the paper."""
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (T, 1)
    inv_freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (C/2,)
    angles = position * inv_freq  # (T, C/2)
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table.float()


class AbsolutePositions(nn.Module):
    """A vector per position, looked up by position id: learned (GPT/BERT) or fixed sinusoids."""

    def __init__(self, kind: str, max_seq_len: int, d_model: int) -> None:
        super().__init__()
        self.kind = kind
        self.max_seq_len = max_seq_len
        if kind == "learned":
            self.weight = nn.Parameter(torch.zeros(max_seq_len, d_model))
        else:
            self.register_buffer("weight", sinusoidal_table(max_seq_len, d_model), persistent=False)

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> AbsolutePositions | None:
        """The table a config's position kind needs, or None when positions live elsewhere."""
        if cfg.position not in ("learned", "sinusoidal"):
            return None
        return cls(cfg.position, cfg.max_seq_len, cfg.d_model)

    def forward(self, position_ids: Tensor) -> Tensor:
        # (B, T) -> (B, T, C)
        return self.weight[position_ids]


# --- RoPE -----------------------------------------------------------------------------------


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_seq_len: int
) -> tuple[Tensor, float]:
    """Per-pair rotation frequencies and the cos/sin scale ("attention factor") for static
    scalings. Dynamic NTK depends on the current length: see `dynamic_ntk_inv_freq`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # (D/2,)
    if scaling is None or scaling["type"] == "dynamic":
        return inv_freq, 1.0
    kind, factor = scaling["type"], float(scaling["factor"])
    original_len = int(scaling.get("original_max_seq_len", max_seq_len))
    if kind == "linear":
        # Position interpolation: squeeze positions by `factor` so long inputs look familiar.
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (slow pairs) are interpolated, short ones kept, the middle blended.
        scaled = torch.where(wavelen > original_len / low_freq_factor, inv_freq / factor, inv_freq)
        smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original_len / high_freq_factor) & (
            wavelen <= original_len / low_freq_factor
        )
        return torch.where(medium, blended, scaled), 1.0
    # YaRN: interpolate the slow pairs, extrapolate the fast ones, ramp in between, and
    # sharpen attention by a log-factor so long-range softmax does not flatten.
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(n_rotations: float) -> float:
        return (head_dim * math.log(original_len / (n_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    return inv_freq, float(attention_factor)


def dynamic_ntk_inv_freq(
    head_dim: int, theta: float, factor: float, original_len: int, seq_len: int
) -> Tensor:
    """Dynamic NTK: past the trained length, raise the base so the slowest pair still fits."""
    seq_len = max(seq_len, original_len)
    base = theta * ((factor * seq_len / original_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (base**exponents)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE. Pairs are (i, i + D/2) ("rotate half"), the Hugging Face layout,
    so Llama-family weights load without permuting q/k."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.theta = cfg.rope_theta
        self.scaling = cfg.rope_scaling
        self.max_seq_len = cfg.max_seq_len
        inv_freq, self.attention_factor = rope_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_seq_len
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T) positions -> cos, sin of shape (B, 1, T, D), computed in float32."""
        inv_freq = self.inv_freq
        if self.scaling is not None and self.scaling["type"] == "dynamic":
            original_len = int(self.scaling.get("original_max_seq_len", self.max_seq_len))
            seq_len = int(position_ids.max()) + 1
            if seq_len > original_len:
                inv_freq = dynamic_ntk_inv_freq(
                    self.head_dim, self.theta, float(self.scaling["factor"]), original_len, seq_len
                ).to(inv_freq.device)
        angles = position_ids[..., None].float() * inv_freq  # (B, T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (B, T, D)
        cos = angles.cos() * self.attention_factor
        sin = angles.sin() * self.attention_factor
        return cos[:, None], sin[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each (i, i + D/2) pair of x (B, H, T, D) by its position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (upcast(x) * cos + upcast(rotated) * sin).to(x.dtype)


# --- ALiBi ----------------------------------------------------------------------------------


def alibi_slopes(n_heads: int) -> Tensor:
    """Geometric slopes 2^(-8/n), 2^(-16/n), ...; for non-powers of two, interleave the next
    power's slopes as in the ALiBi paper."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(power_of_two_slopes(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(power_of_two_slopes(closest) + extra)


def alibi_bias(slopes: Tensor, q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """-slope * |i - j| per head: (H,), (B, Tq), (B, Tk) -> (B, H, Tq, Tk).

    Under a causal mask only j <= i survives, so this equals the paper's -slope * (i - j)."""
    distance = (q_positions[:, :, None] - k_positions[:, None, :]).abs().float()  # (B, Tq, Tk)
    return -slopes[None, :, None, None] * distance[:, None]


# --- T5's relative position bias --------------------------------------------------------------


def relative_position_bucket(
    relative_position: Tensor, bidirectional: bool, n_buckets: int, max_distance: int
) -> Tensor:
    """T5's bucket of each key - query distance: exact for small distances, logarithmic up to
    max_distance, one bucket beyond. Bidirectional (encoder) splits the buckets by direction;
    the causal decoder only ever sees keys behind the query."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        n_buckets //= 2
        buckets += (relative_position > 0).long() * n_buckets
        distance = relative_position.abs()
    else:
        distance = -relative_position.clamp(max=0)
    max_exact = n_buckets // 2
    is_small = distance < max_exact
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (n_buckets - max_exact)).long()
    large = large.clamp(max=n_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """A learned scalar per (bucket, head) added to the attention scores (T5). Computed once
    per forward and shared by every layer of a stack, as in T5's first layer."""

    def __init__(self, cfg: ModelConfig, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.n_buckets = cfg.relative_buckets
        self.max_distance = cfg.relative_max_distance
        self.weight = nn.Parameter(torch.zeros(cfg.relative_buckets, cfg.n_heads))

    def forward(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """(Tq,), (Tk,) positions -> (1, H, Tq, Tk) bias."""
        relative = k_positions[None, :] - q_positions[:, None]  # (Tq, Tk)
        bucket = relative_position_bucket(
            relative, self.bidirectional, self.n_buckets, self.max_distance
        )
        return self.weight[bucket].permute(2, 0, 1)[None]  # (1, H, Tq, Tk)
