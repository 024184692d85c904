"""One protocol for every cache (nn/kv_cache.py's Cache and AttentionCache): the six caches the
models hand the Engine, each held to the same rules, against copies of its own tensors taken
before the operation (the reference a view, a swap or a reset must agree with)."""

from __future__ import annotations

import itertools

import pytest
import torch

from glassformer.config import ModelConfig
from glassformer.models import build_model
from glassformer.nn.cross_cache import CrossAttentionCache
from glassformer.nn.kv_cache import (
    AttentionCache,
    Cache,
    KVCache,
    SlidingWindowCache,
    StaticKVCache,
)

B, L, HKV, D, T = 3, 2, 2, 4, 8  # rows, layers, key/value heads, head dim, positions


def _static() -> StaticKVCache:
    cfg = ModelConfig(vocab_size=11, d_model=16, n_layers=L, n_heads=4, n_kv_heads=HKV)
    return StaticKVCache(cfg, capacity=T, dtype=torch.float32, device="cpu", batch_size=B)


def _seq2seq():
    cfg = ModelConfig(family="seq2seq", vocab_size=11, d_model=16, n_layers=L, n_heads=4,
                      n_kv_heads=HKV, max_seq_len=T, decoder_start_token_id=0)  # fmt: skip
    return build_model(cfg).new_cache(B, T)


def _rnn():
    cfg = ModelConfig(
        family="rnn", cell="lstm", vocab_size=11, d_model=7, n_layers=L, max_seq_len=T
    )
    return build_model(cfg).new_cache(B)


CACHES = {  # each as new as a model makes it
    "KVCache": lambda: KVCache(L, B, HKV, T, D),
    "SlidingWindowCache": lambda: SlidingWindowCache(L, B, HKV, 4, D, max_seq_len=T),
    "StaticKVCache": _static,
    "CrossAttentionCache": lambda: CrossAttentionCache(L, B, T),
    "Seq2SeqCache": _seq2seq,
    "RNNState": _rnn,
}


def state(cache) -> list[torch.Tensor]:
    """Every tensor a cache keeps, batch rows first."""
    if hasattr(cache, "self_attn"):
        return state(cache.self_attn) + state(cache.cross_attn)
    if hasattr(cache, "h"):
        return [*cache.h, *(cache.c if cache.c is not None else [])]  # (B, C) per layer
    return [t for t in (*cache.k, *cache.v) if t is not None]  # (B, ...) per layer


def filled(name: str):
    """A cache as a decode step leaves it: every tensor holding numbers, cross-attention's
    projected from a 5-token source."""
    cache = CACHES[name]()
    cross = getattr(cache, "cross_attn", cache)
    if isinstance(cross, CrossAttentionCache):
        for layer in range(L):
            cross.store(layer, torch.randn(B, HKV, 5, D), torch.randn(B, HKV, 5, D))
    with torch.no_grad():
        for tensor in state(cache):
            tensor.copy_(torch.randn_like(tensor))
    return cache


@pytest.fixture(params=list(CACHES))
def name(request) -> str:
    return request.param


def test_every_cache_is_a_cache_and_every_self_attention_cache_an_attention_cache(name):
    cache = CACHES[name]()
    assert isinstance(cache, Cache)
    attends = name in ("KVCache", "SlidingWindowCache", "StaticKVCache")
    assert isinstance(cache, AttentionCache) == attends
    assert cache.batch_size == B and cache.max_seq_len == T


def test_rows_are_views_of_the_same_memory(name):
    cache = filled(name)
    view = cache.rows(1, 3)
    assert view.batch_size == 2
    for whole, part in zip(state(cache), state(view), strict=True):
        assert torch.equal(part, whole[1:3])
        part.fill_(7.0)  # a write into the view lands in the cache's rows 1 and 2
        assert bool((whole[1:3] == 7.0).all()) and not bool((whole[0] == 7.0).all())


def test_swap_rows_exchanges_two_rows_and_leaves_the_others(name):
    cache = filled(name)
    before = [t.clone() for t in state(cache)]
    cache.swap_rows(0, 2)
    for after, old in zip(state(cache), before, strict=True):
        assert torch.equal(after[0], old[2]) and torch.equal(after[2], old[0])
        assert torch.equal(after[1], old[1])


@pytest.mark.parametrize("name", ["KVCache", "SlidingWindowCache", "StaticKVCache"])
def test_swapping_the_first_positions_leaves_the_later_ones(name):
    # The Engine swaps only the positions rows hold: the (L, B, ...) block's rows in one view,
    # a list's layer by layer; the slots past them stay where they were.
    cache = filled(name)
    before = [t.clone() for t in state(cache)]
    cache.swap_rows(0, 2, n_positions=3)
    for after, old in zip(state(cache), before, strict=True):  # (B, Hkv, slots, D) each
        assert torch.equal(after[0, :, :3], old[2, :, :3])
        assert torch.equal(after[2, :, :3], old[0, :, :3])
        assert torch.equal(after[:, :, 3:], old[:, :, 3:]) and torch.equal(after[1], old[1])


def test_nbytes_count_every_tensor_and_row_bytes_share_them(name):
    cache = filled(name)
    assert cache.nbytes == sum(t.nbytes for t in state(cache))
    lengths = range(T + 1)
    used = [cache.row_bytes(n) for n in lengths]
    assert used[0] == 0  # a row holds nothing before its first token
    assert all(a <= b for a, b in itertools.pairwise(used))
    assert cache.row_bytes(T) * B == cache.nbytes  # a full row uses its whole share


def test_reset_leaves_what_a_new_cache_would_show_a_new_row(name):
    cache, new = filled(name), CACHES[name]()
    cache.reset()
    if hasattr(cache, "self_attn"):  # the encoder-decoder's: each part by its own rule
        assert_shows_a_new_row(cache.self_attn, new.self_attn)
        assert_shows_a_new_row(cache.cross_attn, new.cross_attn)
    else:
        assert_shows_a_new_row(cache, new)


def assert_shows_a_new_row(cache, new) -> None:
    if isinstance(cache, AttentionCache):  # a row written from position 0 reads only itself
        k = torch.randn(B, HKV, 2, D)
        for c in (cache, new):
            c.begin(torch.arange(2))
        got, want = cache.update(0, torch.arange(2), k, k), new.update(0, torch.arange(2), k, k)
        # what the causal mask lets the row see: its 2 positions (a static cache returns all)
        assert all(
            torch.equal(g[..., :2, :], w[..., :2, :]) for g, w in zip(got, want, strict=True)
        )
        return
    assert len(state(cache)) == len(state(new))  # no cross-attention keys until a source
    assert all(torch.equal(a, b) for a, b in zip(state(cache), state(new), strict=True))


@pytest.mark.parametrize("name", ["KVCache", "SlidingWindowCache", "StaticKVCache", "Seq2SeqCache"])
def test_rewinds_says_whether_going_back_keeps_the_earlier_positions(name):
    """Write positions 0..7, then go back to position 5: the keys returned for 0..4 are the
    ones written there exactly when the cache says it rewinds (a ring of 4 overwrote them)."""
    cache = CACHES[name]()
    attention = getattr(cache, "self_attn", cache)
    keys = torch.randn(B, HKV, T, D)
    attention.begin(torch.arange(T))
    attention.update(0, torch.arange(T), keys, keys)
    key_positions = attention.begin(torch.tensor([5]))
    got, _ = attention.update(0, torch.tensor([5]), keys[:, :, :1], keys[:, :, :1])
    earlier = (key_positions < 5).nonzero().flatten()
    kept = torch.equal(got[:, :, earlier], keys[:, :, key_positions[earlier]])
    assert kept == cache.rewinds
