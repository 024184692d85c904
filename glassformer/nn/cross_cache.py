"""The encoder-decoder's cross-attention cache (seed 000 §3.1): the keys and values a decoder
attends to over its source, projected once per source; a `Cache` (nn/kv_cache.py) the Engine
hands out, swaps and resets like the self-attention caches."""

from __future__ import annotations

import copy

from torch import Tensor


class CrossAttentionCache:
    """The decoder's cross-attention keys and values (seed 000 §3.1): they come from the encoder
    output, which does not change while decoding, so each layer projects them once per source.

    Per layer: k, v (B, Hkv, S, D), or None until the first decode step computes them. A row
    holds its source's keys and values whatever its target length (none before its first
    step); max_seq_len is the target positions its decoder allows.
    """

    rewinds = True  # nothing positional: the source's keys hold for any target length

    def __init__(self, n_layers: int, batch_size: int, max_seq_len: int) -> None:
        self.k: list[Tensor | None] = [None] * n_layers
        self.v: list[Tensor | None] = [None] * n_layers
        self._batch_size, self.max_seq_len = batch_size, max_seq_len

    def get(self, layer: int) -> tuple[Tensor, Tensor] | None:
        if self.k[layer] is None:
            return None
        return self.k[layer], self.v[layer]

    def store(self, layer: int, k: Tensor, v: Tensor) -> None:
        self.k[layer], self.v[layer] = k, v
        self._batch_size = k.shape[0]

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (B',) of every stored tensor: beam search's parent beams."""
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            if k is not None:
                self.store(layer, k.index_select(0, index), v.index_select(0, index))
        self._batch_size = len(index)

    def reset(self) -> None:
        self.k = [None] * len(self.k)
        self.v = [None] * len(self.v)

    def rows(self, start: int, stop: int) -> CrossAttentionCache:
        """Rows start..stop-1: views of what is stored (a store into the view replaces the
        view's tensors only, since they are projected whole from one source)."""
        view = copy.copy(self)
        view.k = [None if t is None else t[start:stop] for t in self.k]
        view.v = [None if t is None else t[start:stop] for t in self.v]
        view._batch_size = stop - start
        return view

    def swap_rows(self, a: int, b: int, n_positions: int | None = None) -> None:
        """Exchange rows a and b of every stored tensor (n_positions: unused, a row holds its
        whole source)."""
        for t in (*self.k, *self.v):
            if t is not None:
                t[[a, b]] = t[[b, a]]  # the right side is a copy

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v if t is not None)

    def row_bytes(self, length: int) -> int:
        """One row's source keys/values once it has decoded (none before its first step)."""
        return self.nbytes // self.batch_size if length else 0
