"""The KV caches (seed 000 §2.5.1; seed 002's "0.5 MB per token"): a preallocated cache, a
rolling-buffer cache for sliding-window models (Mistral) whose memory stays at W positions, a
static cache for compiled decode steps; the encoder-decoder's cross-attention cache is
nn/cross_cache.py.

Every cache is a `Cache` (below): rows the Engine can hand out, swap and reset, and bytes it can
count. Every self-attention cache is also an `AttentionCache`, used the same way: the model
calls `begin(positions)` once per forward with the positions of the new tokens, (T,) for every
row or (B, T) per row, and gets the positions of the keys every layer will see (for the mask);
each layer then calls `update(layer, positions, k, v)`, which writes the new keys/values and
returns the keys/values to attend over. The caller's positions are the one source of truth: a
cache stores keys and values where it is told and keeps no count of its own, so rows of one
batch may sit at different lengths (the Engine's continuous batching), and rolling back
(speculative decoding's rejected tokens) is writing at an earlier position next time. Memory is
allocated once, up front: decode allocates nothing.
Shapes: L layers, B batch, Hkv key/value heads, Tmax capacity, D head dim.
"""

from __future__ import annotations

import copy
import functools
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class Cache(Protocol):
    """What every generation cache is to the Engine (KV caches, the RNN's state, the encoder-
    decoder's caches): `batch_size` row slots, `max_seq_len` positions per row at most; `rows`
    gives a view of some slots whose writes land here, `swap_rows` exchanges two slots, `reset`
    readies every slot for a new row; `nbytes` is what is allocated, `row_bytes(length)` what
    one row holding `length` positions uses of it. `rewinds`: a row may go back to an earlier
    position and continue from there (it overwrote nothing it held before that position; a
    ring or a recurrent state cannot), as a chat turn that shares part of the last does."""

    max_seq_len: int
    rewinds: bool

    @property
    def batch_size(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def row_bytes(self, length: int) -> int: ...

    def rows(self, start: int, stop: int) -> Cache: ...

    def swap_rows(self, a: int, b: int, n_positions: int | None = None) -> None: ...

    def reset(self) -> None: ...


@runtime_checkable
class AttentionCache(Cache, Protocol):
    """A self-attention cache: `begin(positions)` before a forward writes tokens at `positions`
    returns the positions of the keys every `update(layer, positions, k, v)` of that forward
    returns, after writing k, v (B, Hkv, T, D) at `positions`."""

    def begin(self, positions: Tensor) -> Tensor: ...

    def update(
        self, layer: int, positions: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor]: ...


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


def _span(positions: Tensor) -> tuple[int, int, bool]:
    """(first, end, consecutive) of positions (T,) or (B, T): the smallest first position, one
    past the largest, and whether every row is the same run first..end-1 (then one slice of
    the buffer is written, not a scatter). One host sync per forward, not per layer."""
    if positions.dim() not in (1, 2) or positions.numel() == 0:
        raise ValueError(
            f"positions must be (T,) or (batch, T) with T >= 1, got shape {tuple(positions.shape)}"
        )
    if positions.numel() == 1:  # one decode step: a single position, read once
        first = last = int(positions)
    else:
        first, last = (int(x) for x in torch.aminmax(positions))
    if first < 0:
        raise ValueError(f"positions must be >= 0, got {first}")
    if positions.shape[-1] != last + 1 - first:
        return first, last + 1, False
    run = torch.arange(first, last + 1, device=positions.device)
    consecutive = positions.numel() == 1 or bool((positions == run).all())
    return first, last + 1, consecutive


class _SlotCache:
    """What the preallocated self-attention caches share: keys and values per layer, k[layer]
    and v[layer] of shape (B, Hkv, slots, D) each, stored as one (L, B, Hkv, slots, D) block or
    as a list of per-layer tensors (StaticKVCache), and the bookkeeping over them."""

    k: Tensor | list[Tensor]
    v: Tensor | list[Tensor]
    max_seq_len: int
    rewinds = True  # position p lives in slot p: going back overwrites nothing earlier

    def reset(self) -> None:
        """Nothing to clear: a new row writes its positions from 0 and reads no further."""

    def rows(self, start: int, stop: int):
        """The same cache for batch rows start..stop-1 only: a view, so its writes land here
        (the Engine prefills one row's slot this way)."""
        view = copy.copy(self)
        view.k, view.v = _batch_rows(self.k, start, stop), _batch_rows(self.v, start, stop)
        return view

    def swap_rows(self, a: int, b: int, n_positions: int | None = None) -> None:
        """Exchange the keys/values of rows a and b, the first n_positions of each (None: all
        slots). The Engine keeps its live rows in the first slots, so a decode step reads one
        contiguous block, and moves only what rows hold."""
        pairs = zip(self._held(a, n_positions), self._held(b, n_positions), strict=True)
        for row_a, row_b in pairs:
            kept = row_a.clone()
            row_a.copy_(row_b)
            row_b.copy_(kept)

    def copy_positions(self, source: int, target: int, n_positions: int) -> None:
        """Row target's first n_positions keys/values become row source's (another request's
        prompt that starts with the same tokens: their keys/values are the same numbers, as a
        position's keys depend only on the tokens up to it). Nothing else changes."""
        pairs = zip(self._held(target, n_positions), self._held(source, n_positions), strict=True)
        for to, held in pairs:
            to.copy_(held)

    def save_positions(self, row: int, n_positions: int) -> list[Tensor]:
        """Copies of row's first n_positions keys/values, out of the slots: what the server's
        prompt store keeps of a row that gives up its slot (llama-server's --cache-ram)."""
        return [held.clone() for held in self._held(row, n_positions)]

    def load_positions(self, saved: list[Tensor], target: int, n_positions: int) -> None:
        """Row target's first n_positions keys/values become the first n_positions of `saved`
        (save_positions's, of at least that many), as copy_positions does from a row."""
        for to, held in zip(self._held(target, n_positions), saved, strict=True):
            to.copy_(held[..., :n_positions, :])  # (..., positions, D)

    def _held(self, row: int, n_positions: int | None) -> list[Tensor]:
        """Row `row`'s first n_positions keys and values (None: all slots), as views: of the
        (L, B, Hkv, slots, D) blocks, every layer in one, or of each layer's (B, Hkv, slots, D)
        tensor of a list. Per layer, a server's swap of two rows was 180 small copies, 1.4 ms
        for 129 positions of SmolLM2 (2026-12-07), several times a request."""
        held = slice(0, n_positions)
        if isinstance(self.k, Tensor):
            return [self.k[:, row, :, held], self.v[:, row, :, held]]
        return [layer[row, :, held] for layer in (*self.k, *self.v)]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @functools.cached_property
    def slots(self) -> int:
        """Positions one row can hold at once (Tmax, or the window W of a ring). Kept: the
        server's prefix cache sums its parked rows' bytes (row_bytes) after every request."""
        return self.k[0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes allocated for every slot, filled or not."""
        return sum(t.nbytes for t in (*self.k, *self.v))

    @functools.cached_property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one position across all layers: 2 * L * Hkv * D * bytes, the
        number calc.kv_bytes_per_token(cfg, dtype) computes without a cache. Computed once: the
        Engine asks for every row after every step, and the sum over 2 L tensors cost a 32-row
        server step 3% of its time (a view of some rows keeps the figure: it is per row)."""
        return self.nbytes // self.slots // self.batch_size

    def row_bytes(self, length: int) -> int:
        """Bytes of keys/values one row of `length` positions holds: at most one per slot."""
        return self.kv_bytes_per_token * min(length, self.slots)


def _batch_rows(buffer: Tensor | list[Tensor], start: int, stop: int) -> Tensor | list[Tensor]:
    """Rows start..stop-1 of a (L, B, ...) block or of each (B, ...) tensor of a list: views."""
    if isinstance(buffer, Tensor):
        return buffer[:, start:stop]
    return [layer[start:stop] for layer in buffer]


def _scatter(buffer: Tensor, positions: Tensor, x: Tensor) -> None:
    """buffer (B, Hkv, slots, D)[..., positions, :] = x (B, Hkv, T, D); positions (T,) for every
    row or (B, T) per row."""
    if positions.dim() == 1:
        buffer[:, :, positions] = x
    else:
        rows = torch.arange(x.shape[0], device=x.device)[:, None]  # (B, 1) with (B, T)
        buffer[rows, :, positions] = x.transpose(1, 2)  # indexed (B, T, Hkv, D)


class KVCache(_SlotCache):
    """Keys and values of every layer for up to `max_seq_len` positions: position p of a row
    lives in slot p, so a row's keys are slots 0..p in order."""

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

    @classmethod
    def for_config(cls, cfg, batch_size, max_seq_len, dtype, device) -> KVCache:
        """A cache shaped for a ModelConfig's decoder layers (max_seq_len None: the config's)."""
        max_seq_len = max_seq_len or cfg.max_seq_len
        return cls(
            cfg.n_layers,
            batch_size,
            cfg.n_kv_heads,
            max_seq_len,
            cfg.head_dim,
            dtype=dtype,
            device=device,
        )

    def begin(self, positions: Tensor) -> Tensor:
        """Before a forward writes tokens at `positions` ((T,) or (B, T)): check they fit and
        return the positions (Tk,) of the keys every `update` returns, 0..end-1. Rows that end
        earlier see their later slots as the future, which the causal mask hides."""
        first, end, consecutive = _span(positions)
        if end > self.max_seq_len:
            raise ValueError(
                f"KV cache is full: {first} cached + {end - first} new positions > capacity "
                f"{self.max_seq_len}; create the cache with a larger max_seq_len"
            )
        self._run = slice(first, end) if consecutive else None
        self._end = end
        return torch.arange(end, device=positions.device)

    def update(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, Hkv, T, D) at `positions` (the tensor given to begin); return the
        keys/values of positions 0..end-1, (B, Hkv, end, D)."""
        run = self._run
        if run is None:
            if k.requires_grad or v.requires_grad:
                raise ValueError(
                    "a cached forward with gradients needs one run of consecutive positions "
                    "for every row: run it under torch.no_grad(), or one row at a time"
                )
            _scatter(self.k[layer], positions, k)
            _scatter(self.v[layer], positions, v)
        else:
            self.k[layer, :, :, run] = k.detach()  # values, not graphs: see _with_grad
            self.v[layer, :, :, run] = v.detach()
            if k.requires_grad or v.requires_grad:
                cached = slice(0, run.start)
                return _with_grad(self.k[layer, :, :, cached], k, self.v[layer, :, :, cached], v)
        return self.k[layer, :, :, : self._end], self.v[layer, :, :, : self._end]


class SlidingWindowCache(_SlotCache):
    """Mistral's rolling buffer: a KV cache for sliding-window models whose memory is bounded by
    the window W instead of the sequence length.

    A query at position p sees only keys p - W + 1 .. p, so a key older than W positions is never
    needed again: position p is written to slot p % W, over the key that just left the window.
    RoPE is applied before caching (each key carries its position), so a 1-token decode step
    may attend to the filled slots in any order; `begin` names the position of each key that
    `update` returns, for masks and ALiBi. Per layer: k, v (B, Hkv, W, D).

    `max_seq_len` bounds the positions fed (what the model's positions support), not memory:
    positions run past W up to it.
    """

    rewinds = False  # position p overwrote position p - W

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
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, Hkv, W, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.window = window
        self.max_seq_len = max_seq_len

    @classmethod
    def for_config(cls, cfg, batch_size, max_seq_len, dtype, device) -> SlidingWindowCache:
        """A ring of cfg.sliding_window slots (max_seq_len None: the config's position limit)."""
        if cfg.sliding_window is None:
            raise ValueError(
                "sliding_window=None: this model attends to every earlier key, so a ring cache "
                "would drop keys it needs; use KVCache (model.new_cache(kind='full'))"
            )
        max_seq_len = max_seq_len or cfg.max_seq_len
        return cls(
            cfg.n_layers,
            batch_size,
            cfg.n_kv_heads,
            cfg.sliding_window,
            cfg.head_dim,
            max_seq_len,
            dtype=dtype,
            device=device,
        )

    def key_positions(self, start: int, n_new: int, device=None) -> Tensor:
        """Sequence positions (Tk,) of the keys `update` returns when positions start..start +
        n_new - 1 arrive after a row holding 0..start-1.

        One new position: the filled slots in slot order (slot s holds the latest position
        p < start + 1 with p % W == s). Several: the cached positions in order, then the new.
        """
        W, end = self.window, start + n_new
        if n_new == 1:
            slots = torch.arange(min(end, W), device=device)
            return slots + W * ((end - 1 - slots) // W)
        return torch.arange(max(0, start - W), end, device=device)

    def begin(self, positions: Tensor) -> Tensor:
        """Before a forward writes tokens at `positions`: one run of consecutive positions for
        every row, (T,), or one new position per row, (B, 1). Returns the key positions every
        `update` returns: (Tk,) for the run, (B, Tk) per row."""
        first, end, consecutive = _span(positions)
        if end > self.max_seq_len:
            raise ValueError(
                f"sliding-window cache is at its position limit: {first} fed + {end - first} "
                f"new positions > max_seq_len {self.max_seq_len}; create it with a larger "
                "max_seq_len"
            )
        self._end = end
        if consecutive:
            self._start, self._per_row = first, None
            return self.key_positions(first, end - first, positions.device)
        if positions.dim() != 2 or positions.shape[1] != 1:
            raise ValueError(
                f"a sliding-window ring cache takes one run of consecutive positions for every "
                f"row, or one new position per row (batch, 1), not positions of shape "
                f"{tuple(positions.shape)}: prefill each row on its own (cache.rows(b, b + 1))"
            )
        # One decode step per row, each row at its own position: slot s of row b holds the
        # latest position <= p_b that is s mod W; a slot the row has not reached yet gets a
        # position past every query, so the causal mask hides it.
        self._per_row = positions[:, 0]  # (B,)
        W, ends = self.window, positions + 1  # (B, 1)
        slots = torch.arange(min(end, W), device=positions.device)[None]  # (1, Tk)
        held = slots + W * ((ends - 1 - slots) // W)
        return torch.where(slots < ends, held, self.max_seq_len + W)  # (B, Tk)

    def update(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, Hkv, T, D) into the ring; return the keys/values the new queries attend
        over, in the order of the key positions `begin` returned."""
        T, W = k.shape[2], self.window
        if self._per_row is not None:
            if k.requires_grad or v.requires_grad:
                raise ValueError(
                    "a ring cache with rows at different positions runs without gradients: "
                    "use torch.no_grad()"
                )
            slots = (self._per_row % W)[:, None]  # (B, 1)
            _scatter(self.k[layer], slots, k)
            _scatter(self.v[layer], slots, v)
            n_filled = min(self._end, W)
            return self.k[layer, :, :, :n_filled], self.v[layer, :, :, :n_filled]
        start = self._start
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
        keys = torch.cat([self._in_position_order(self.k[layer], start), k], dim=2)
        values = torch.cat([self._in_position_order(self.v[layer], start), v], dim=2)
        kept = min(T, W)  # only the last W positions can be needed later
        slots = torch.arange(start + T - kept, start + T, device=k.device) % W
        self.k[layer].index_copy_(2, slots, k[:, :, T - kept :].detach())
        self.v[layer].index_copy_(2, slots, v[:, :, T - kept :].detach())
        return keys, values  # (B, Hkv, Tk, D)

    def _in_position_order(self, ring: Tensor, start: int) -> Tensor:
        """The cached positions max(0, start - W) .. start - 1 of one layer, oldest first."""
        if start < self.window:
            return ring[:, :, :start]
        oldest = start % self.window  # the slot written longest ago
        return torch.cat([ring[:, :, oldest:], ring[:, :, :oldest]], dim=2)


class StaticKVCache(_SlotCache):
    """gpt-fast's cache, for a compiled decode step (infer/compiled.py): one (B, Hkv, Tmax, D)
    tensor per layer for keys and one for values, written at explicit positions, and always
    read whole: a step then has the same shapes at every position, so it compiles to one graph
    (the causal mask hides the slots not filled yet).

    Each layer's tensors stand alone (not views of one (L, ...) block) so that a compiled step
    writes its slot in place: torch.compile copies a whole input it cannot prove unaliased.
    `begin` reads nothing from the device (a compiled graph cannot wait for it)."""

    static = True  # the model builds a dense mask over the whole capacity, without host syncs

    def __init__(
        self, cfg, capacity: int, dtype: torch.dtype, device: torch.device, batch_size: int = 1
    ) -> None:
        shape = (batch_size, cfg.n_kv_heads, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self._every_position = torch.arange(capacity, device=device)
        self.max_seq_len = capacity

    def begin(self, positions: Tensor) -> Tensor:
        """Every slot's position: each update returns the whole capacity."""
        return self._every_position

    def update(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v (B, Hkv, T, D) at positions (T,); return the layer's whole capacity."""
        k_layer, v_layer = self.k[layer], self.v[layer]
        k_layer[:, :, positions] = k
        v_layer[:, :, positions] = v
        return k_layer, v_layer
