"""The KV caches (seed 000 §2.5.1; seed 002's "0.5 MB per token"): a preallocated cache, a
rolling-buffer cache for sliding-window models (Mistral) whose memory stays at W positions, a
static cache for compiled decode steps, and the encoder-decoder's cross-attention cache.

Prefill writes the whole prompt's keys and values at once; each decode step appends one
position in place. Memory is allocated once, up front, so the decode loop allocates nothing.
Shapes: L layers, B batch, Hkv key/value heads, Tmax capacity, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _with_grad(cached_k: Tensor, k: Tensor, cached_v: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Keys/values for a forward that needs gradients: the cached positions as constants, then
    this call's k, v with their graph.

    The buffers only ever hold detached values. Writing a tensor that requires grad into a
    buffer in place would put the buffer into a graph that saves views of the buffer itself: a
    reference cycle through autograd that Python's gc cannot free, so every cached forward in
    grad mode would leak its activations. Gradients therefore flow through this call's keys
    and values only, never back into earlier calls.
    """
    return torch.cat([cached_k, k], dim=2), torch.cat([cached_v, v], dim=2)


class _SlotCache:
    """What both preallocated caches share: per-layer key/value buffers (L, B, Hkv, slots, D)
    and `length`, the positions fed so far (the model advances it after a forward pass, so
    every layer writes the same slots)."""

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, Hkv, slots, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    def advance(self, n_positions: int) -> None:
        self.length += n_positions

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated for every slot, filled or not."""
        return self.k.nbytes + self.v.nbytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one position across all layers: 2 * L * Hkv * D * bytes, the
        number calc.kv_bytes_per_token(cfg, dtype) computes without a cache."""
        return self.nbytes // self.k.shape[3] // self.k.shape[1]

    @property
    def filled_bytes(self) -> int:
        """Bytes of keys/values held: at most one position per slot."""
        return self.kv_bytes_per_token * min(self.length, self.k.shape[3]) * self.k.shape[1]


class KVCache(_SlotCache):
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
        self._allocate(shape, dtype, device)  # (L, B, Hkv, Tmax, D)
        self.max_seq_len = max_seq_len

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
        self.k[layer, :, :, start:end] = k.detach()  # values, not graphs: see _with_grad
        self.v[layer, :, :, start:end] = v.detach()
        if k.requires_grad or v.requires_grad:
            return _with_grad(self.k[layer, :, :, :start], k, self.v[layer, :, :, :start], v)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (speculative decoding's rollback of rejected
        tokens). Nothing is erased: the next update writes at `length` and reads only [:end]."""
        if not 0 <= length <= self.length:
            raise ValueError(
                f"truncate(length={length}) must keep between 0 and the {self.length} cached "
                "positions: a cache can only be rolled back, not extended"
            )
        self.length = length


class SlidingWindowCache(_SlotCache):
    """Mistral's rolling buffer: a KV cache for sliding-window models whose memory is bounded by
    the window W instead of the sequence length.

    A query at position p sees only keys p - W + 1 .. p, so a key older than W positions is never
    needed again: position p is written to slot p % W, over the key that just left the window.
    RoPE is applied before caching (each key carries its position), so a 1-token decode step
    may attend to the filled slots in any order; `key_positions` names the position of each
    key that `update` returns, for masks and ALiBi. Per layer: k, v (B, Hkv, W, D).

    `max_seq_len` bounds the total positions fed (what the model's positions support), not
    memory: `length` can run past W up to it.
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        window: int,
        head_dim: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1: the model's sliding_window")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len={max_seq_len} must be >= 1: the most positions fed")
        shape = (n_layers, batch_size, n_kv_heads, window, head_dim)
        self._allocate(shape, dtype, device)  # (L, B, Hkv, W, D); length may exceed W
        self.window = window
        self.max_seq_len = max_seq_len

    @classmethod
    def for_config(
        cls,
        cfg,
        batch_size: int,
        max_seq_len: int | None,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> SlidingWindowCache:
        """A ring of cfg.sliding_window slots (max_seq_len None: the config's position limit)."""
        if cfg.sliding_window is None:
            raise ValueError(
                "sliding_window=None: this model attends to every earlier key, so a ring cache "
                "would drop keys it needs; use KVCache (model.new_cache(kind='full'))"
            )
        return cls(
            cfg.n_layers,
            batch_size,
            cfg.n_kv_heads,
            cfg.sliding_window,
            cfg.head_dim,
            max_seq_len or cfg.max_seq_len,
            dtype=dtype,
            device=device,
        )

    def key_positions(self, n_new: int, device: torch.device | str | None = None) -> Tensor:
        """Sequence positions (Tk,) of the keys `update` returns when n_new positions arrive.

        One new position: the filled slots in slot order (slot s holds the latest position
        p < length + 1 with p % W == s). Several: the cached positions in order, then the new.
        """
        W, end = self.window, self.length + n_new
        if n_new == 1:
            slots = torch.arange(min(end, W), device=device)
            return slots + W * ((end - 1 - slots) // W)
        return torch.arange(max(0, self.length - W), end, device=device)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, Hkv, T, D) into the ring; return the keys/values the new queries attend
        over, in the order of `key_positions(T)`."""
        T, W, start = k.shape[2], self.window, self.length
        if start + T > self.max_seq_len:
            raise ValueError(
                f"sliding-window cache is at its position limit: {start} fed + {T} new "
                f"positions > max_seq_len {self.max_seq_len}; create it with a larger max_seq_len"
            )
        if T == 1:
            # Decode: overwrite the slot of position start - W (now outside the window). In
            # place, no allocation; every filled slot is within the window of the new query.
            slot = start % W
            self.k[layer, :, :, slot : slot + 1] = k.detach()  # values, not graphs: _with_grad
            self.v[layer, :, :, slot : slot + 1] = v.detach()
            n_filled = min(start + 1, W)
            if k.requires_grad or v.requires_grad:
                keys, values = self.k[layer, :, :, :n_filled], self.v[layer, :, :, :n_filled]
                after = slice(slot + 1, n_filled)  # the new position keeps its slot's place
                keys = torch.cat([keys[:, :, :slot], k, keys[:, :, after]], dim=2)
                values = torch.cat([values[:, :, :slot], v, values[:, :, after]], dim=2)
                return keys, values
            return self.k[layer, :, :, :n_filled], self.v[layer, :, :, :n_filled]
        # A chunk of several queries: the earliest still need keys that the chunk's own writes
        # overwrite, so copy the ring out (in position order) before writing. The model's mask
        # keeps each query within its own window.
        keys = torch.cat([self._in_position_order(self.k[layer]), k], dim=2)  # (B, Hkv, Tk, D)
        values = torch.cat([self._in_position_order(self.v[layer]), v], dim=2)
        kept = min(T, W)  # only the last W positions can be needed later
        slots = torch.arange(start + T - kept, start + T, device=k.device) % W
        self.k[layer].index_copy_(2, slots, k[:, :, T - kept :].detach())
        self.v[layer].index_copy_(2, slots, v[:, :, T - kept :].detach())
        return keys, values

    def _in_position_order(self, ring: Tensor) -> Tensor:
        """The cached positions max(0, length - W) .. length - 1 of one layer, oldest first."""
        if self.length < self.window:
            return ring[:, :, : self.length]
        oldest = self.length % self.window  # the slot written longest ago
        return torch.cat([ring[:, :, oldest:], ring[:, :, :oldest]], dim=2)


class StaticKVCache:
    """gpt-fast's cache, for a compiled decode step (infer/compiled.py): one (1, Hkv, Tmax, D)
    tensor per layer for keys and one for values, written at explicit positions.

    Each layer's tensors stand alone (not views of one (L, ...) block) so that a compiled step
    writes its slot in place: torch.compile copies a whole input it cannot prove unaliased.
    `length` is how many positions are filled."""

    def __init__(self, cfg, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (1, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.capacity = capacity
        self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    @property
    def filled_bytes(self) -> int:
        return self.nbytes * self.length // self.capacity


class CacheWrites:
    """What Attention calls as `cache.update`: write k, v (1, Hkv, T, D) at sequence
    `positions` (T,) and return the layer's whole capacity (1, Hkv, Tmax, D)."""

    def __init__(self, cache: StaticKVCache, positions: Tensor) -> None:
        self.cache, self.positions = cache, positions

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        k_layer, v_layer = self.cache.k[layer], self.cache.v[layer]
        k_layer[:, :, self.positions] = k
        v_layer[:, :, self.positions] = v
        return k_layer, v_layer


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
