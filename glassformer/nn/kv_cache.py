"""A static, preallocated KV cache (seed 000 §2.5.1; seed 002's "0.5 MB per token").

Prefill writes the whole prompt's keys and values at once; each decode step appends one
position in place. Memory is allocated once, up front, so the decode loop allocates nothing.
Shapes: L layers, B batch, Hkv key/value heads, Tmax capacity, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """Keys and values of every layer for up to `max_seq_len` positions.

    `length` is how many positions are filled; the model advances it after a forward pass,
    so every layer writes the same slots.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        shape = (n_layers, batch_size, n_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, Hkv, Tmax, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len
        self.length = 0

    @classmethod
    def for_config(
        cls,
        cfg,
        batch_size: int,
        max_seq_len: int | None,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> KVCache:
        """A cache shaped for a ModelConfig's decoder layers (max_seq_len None: the config's)."""
        return cls(
            cfg.n_layers,
            batch_size,
            cfg.n_kv_heads,
            max_seq_len or cfg.max_seq_len,
            cfg.head_dim,
            dtype=dtype,
            device=device,
        )

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, Hkv, T, D) after the filled positions; return all keys/values so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_seq_len:
            raise ValueError(
                f"KV cache is full: {start} cached + {k.shape[2]} new positions > capacity "
                f"{self.max_seq_len}; create the cache with a larger max_seq_len"
            )
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n_positions: int) -> None:
        self.length += n_positions

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated for the whole capacity."""
        return self.k.nbytes + self.v.nbytes

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one position across all layers: 2 * L * Hkv * D * bytes."""
        return self.nbytes // self.max_seq_len // self.k.shape[1]

    @property
    def filled_bytes(self) -> int:
        return self.bytes_per_token * self.length * self.k.shape[1]


class CrossAttentionCache:
    """The decoder's cross-attention keys and values (seed 000 §3.1): they come from the encoder
    output, which does not change while decoding, so each layer projects them once per source.

    Per layer: k, v (B, Hkv, S, D), or None until the first decode step computes them.
    """

    def __init__(self, n_layers: int) -> None:
        self.k: list[Tensor | None] = [None] * n_layers
        self.v: list[Tensor | None] = [None] * n_layers

    def get(self, layer: int) -> tuple[Tensor, Tensor] | None:
        if self.k[layer] is None:
            return None
        return self.k[layer], self.v[layer]

    def store(self, layer: int, k: Tensor, v: Tensor) -> None:
        self.k[layer], self.v[layer] = k, v

    def reset(self) -> None:
        self.k = [None] * len(self.k)
        self.v = [None] * len(self.v)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v if t is not None)
