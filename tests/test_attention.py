"""Attention (seed 000 §3.3, §4.1-4.2): eager == SDPA for every mask, masks against brute force,
GQA/MQA against MHA, and the 1/sqrt(d) scale against a numpy reference."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from glassformer.config import ModelConfig
from glassformer.nn.attention import (
    Attention,
    AttentionMask,
    attention_mask,
    eager_attention,
    sdpa_attention,
)
from glassformer.nn.kv_cache import KVCache
from glassformer.nn.position import alibi_bias, alibi_slopes

ATOL = 1e-5


def build_allowed(
    n_queries: int,
    n_keys: int,
    *,
    causal: bool,
    sliding_window: int | None = None,
    key_padding: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """attention_mask for the last n_queries of n_keys positions (a KV cache's case), dense."""
    mask = attention_mask(
        torch.arange(n_keys - n_queries, n_keys),
        torch.arange(n_keys),
        causal=causal,
        sliding_window=sliding_window,
        padding_mask=key_padding,
        document_ids=document_ids,
    )
    return mask.dense(n_queries, n_keys, torch.device("cpu"))


HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}  # name: (n_heads, n_kv_heads)
MASK_KINDS = [
    "none",
    "causal",
    "causal_short_query",
    "padding_right",
    "padding_left",
    "documents",
    "sliding_window",
    "alibi_causal",
]


def _reference_allowed(
    n_queries: int,
    n_keys: int,
    batch: int,
    *,
    causal: bool,
    sliding_window: int | None = None,
    key_padding: list[list[bool]] | None = None,
    document_ids: list[list[int]] | None = None,
) -> list[list[list[bool]]]:
    """The mask rules as a plain double loop: [b][i][j] is True when query i may see key j.

    Query i is the key at index n_keys - n_queries + i (the earlier keys sit in a KV cache).
    A query row that may see nothing is opened to every key (its output is padding)."""
    out = []
    for b in range(batch):
        rows = []
        for i in range(n_queries):
            qi = n_keys - n_queries + i
            row = []
            for j in range(n_keys):
                ok = True
                if causal and j > qi:
                    ok = False
                if sliding_window is not None and abs(qi - j) >= sliding_window:
                    ok = False
                if key_padding is not None and not key_padding[b][j]:
                    ok = False
                if document_ids is not None and document_ids[b][qi] != document_ids[b][j]:
                    ok = False
                row.append(ok)
            if not any(row):
                row = [True] * n_keys
            rows.append(row)
        out.append(rows)
    return out


def _dense(mask: torch.Tensor | None, batch: int, n_queries: int, n_keys: int) -> torch.Tensor:
    if mask is None:
        return torch.ones(batch, 1, n_queries, n_keys, dtype=torch.bool)
    return mask.expand(batch, 1, n_queries, n_keys)


def _make_mask(
    kind: str, batch: int, n_heads: int, n_queries: int, n_keys: int
) -> tuple[AttentionMask, torch.Tensor]:
    """An AttentionMask of the given kind and a (B, 1, Tq, Tk) bool of the real query rows."""
    real_queries = torch.ones(batch, 1, n_queries, 1, dtype=torch.bool)
    if kind == "none":
        return AttentionMask(), real_queries
    if kind == "causal":
        assert n_queries == n_keys
        return AttentionMask(is_causal=True), real_queries
    if kind == "causal_short_query":
        return AttentionMask(allowed=build_allowed(n_queries, n_keys, causal=True)), real_queries
    if kind in ("padding_right", "padding_left"):
        lengths = [n_keys, n_keys - 3][:batch]
        key_padding = torch.zeros(batch, n_keys, dtype=torch.bool)
        for b, length in enumerate(lengths):
            if kind == "padding_right":
                key_padding[b, :length] = True
            else:
                key_padding[b, n_keys - length :] = True
        allowed = build_allowed(n_queries, n_keys, causal=True, key_padding=key_padding)
        real_queries = key_padding[:, None, n_keys - n_queries :, None]
        return AttentionMask(allowed=allowed), real_queries
    if kind == "documents":
        doc_lengths = [[3, 2, n_keys - 5], [n_keys - 4, 4]][:batch]
        document_ids = torch.tensor(
            [[d for d, n in enumerate(lengths) for _ in range(n)] for lengths in doc_lengths]
        )
        allowed = build_allowed(n_queries, n_keys, causal=True, document_ids=document_ids)
        return AttentionMask(allowed=allowed), real_queries
    if kind == "sliding_window":
        allowed = build_allowed(n_queries, n_keys, causal=True, sliding_window=3)
        return AttentionMask(allowed=allowed), real_queries
    if kind == "alibi_causal":
        q_pos = torch.arange(n_keys - n_queries, n_keys)[None]
        k_pos = torch.arange(n_keys)[None]
        bias = alibi_bias(alibi_slopes(n_heads), q_pos, k_pos)  # (1, H, Tq, Tk)
        if n_queries == n_keys:
            return AttentionMask(bias=bias, is_causal=True), real_queries
        return AttentionMask(bias=bias, allowed=build_allowed(n_queries, n_keys, causal=True)), (
            real_queries
        )
    raise AssertionError(kind)


def _tiny_cfg(n_heads: int, n_kv_heads: int, backend: str, **overrides) -> ModelConfig:
    return ModelConfig(
        vocab_size=16,
        d_model=32,
        n_layers=1,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=8,
        max_seq_len=32,
        attention_backend=backend,
        **overrides,
    )


# --- eager == SDPA --------------------------------------------------------------------------


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_eager_equals_sdpa_functions(kind: str, heads: str) -> None:
    n_heads, n_kv_heads = HEADS[heads]
    B, D = 2, 8
    n_keys = 10
    n_queries = 4 if kind == "causal_short_query" else n_keys
    mask, real = _make_mask(kind, B, n_heads, n_queries, n_keys)
    q = torch.randn(B, n_heads, n_queries, D)
    k = torch.randn(B, n_kv_heads, n_keys, D)
    v = torch.randn(B, n_kv_heads, n_keys, D)
    eager, _ = eager_attention(q, k, v, mask, 1 / math.sqrt(D))
    fused = sdpa_attention(q, k, v, mask, 1 / math.sqrt(D))
    assert not torch.isnan(eager).any() and not torch.isnan(fused).any()
    real = real.expand_as(eager)
    torch.testing.assert_close(fused[real], eager[real], atol=ATOL, rtol=0)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_eager_equals_sdpa_modules(kind: str, heads: str) -> None:
    """Two Attention modules sharing weights, one per backend; queries shorter than keys come
    from a KV cache filled by an earlier call."""
    n_heads, n_kv_heads = HEADS[heads]
    B, C = 2, 32
    n_keys = 10
    n_queries = 4 if kind == "causal_short_query" else n_keys
    eager_mod = Attention(_tiny_cfg(n_heads, n_kv_heads, "eager")).eval()
    sdpa_mod = Attention(_tiny_cfg(n_heads, n_kv_heads, "sdpa")).eval()
    sdpa_mod.load_state_dict(eager_mod.state_dict())
    mask, real = _make_mask(kind, B, n_heads, n_queries, n_keys)
    x = torch.randn(B, n_keys, C)
    outs = []
    for module in (eager_mod, sdpa_mod):
        if n_queries < n_keys:
            cache = KVCache(1, B, n_kv_heads, n_keys, 8)
            prefix = n_keys - n_queries
            prefix_mask = AttentionMask(is_causal=True)
            for part, part_mask in ((slice(0, prefix), prefix_mask), (slice(prefix, None), mask)):
                positions = torch.arange(n_keys)[part]
                cache.begin(positions)
                out = module(x[:, part], part_mask, cache=cache, positions=positions)
            outs.append(out)
        else:
            outs.append(module(x, mask))
    eager, fused = outs
    assert not torch.isnan(eager).any() and not torch.isnan(fused).any()
    real = real[:, 0].expand_as(eager)  # (B, Tq, C)
    torch.testing.assert_close(fused[real], eager[real], atol=ATOL, rtol=0)


def test_causal_short_query_is_bottom_right_aligned() -> None:
    """Query i of Tq sees keys j <= Tk - Tq + i, whether the mask is explicit or is_causal."""
    n_queries, n_keys, D = 3, 7, 8
    hand = torch.tensor(
        [[j <= n_keys - n_queries + i for j in range(n_keys)] for i in range(n_queries)]
    )
    assert torch.equal(build_allowed(n_queries, n_keys, causal=True)[0, 0], hand)
    assert torch.equal(AttentionMask(is_causal=True).dense(n_queries, n_keys, None)[0, 0], hand)

    q, k, v = (
        torch.randn(1, 2, n_queries, D),
        torch.randn(1, 2, n_keys, D),
        torch.randn(1, 2, n_keys, D),
    )
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    expected = scores.masked_fill(~hand, float("-inf")).softmax(-1) @ v
    for mask in (AttentionMask(is_causal=True), AttentionMask(allowed=hand[None, None])):
        eager, _ = eager_attention(q, k, v, mask, 1 / math.sqrt(D))
        fused = sdpa_attention(q, k, v, mask, 1 / math.sqrt(D))
        torch.testing.assert_close(eager, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(fused, expected, atol=ATOL, rtol=0)


def test_alibi_short_query_eager_equals_sdpa() -> None:
    """ALiBi's bias with a bottom-right causal mask given as is_causal (decode with a cache)."""
    n_heads, n_queries, n_keys, D = 4, 3, 9, 8
    bias = alibi_bias(
        alibi_slopes(n_heads),
        torch.arange(n_keys - n_queries, n_keys)[None],
        torch.arange(n_keys)[None],
    )
    mask = AttentionMask(bias=bias, is_causal=True)
    q = torch.randn(1, n_heads, n_queries, D)
    k, v = torch.randn(1, n_heads, n_keys, D), torch.randn(1, n_heads, n_keys, D)
    eager, _ = eager_attention(q, k, v, mask, 0.3)
    fused = sdpa_attention(q, k, v, mask, 0.3)
    torch.testing.assert_close(fused, eager, atol=ATOL, rtol=0)


# --- eager weights --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_eager_weights_are_a_distribution_zero_where_masked(kind: str) -> None:
    B, H, D, n_keys = 2, 4, 8, 10
    n_queries = 4 if kind == "causal_short_query" else n_keys
    mask, _ = _make_mask(kind, B, H, n_queries, n_keys)
    q, k, v = (
        torch.randn(B, H, n_queries, D),
        torch.randn(B, H, n_keys, D),
        torch.randn(B, H, n_keys, D),
    )
    _, weights = eager_attention(q, k, v, mask, 1 / math.sqrt(D), return_weights=True)
    assert weights.shape == (B, H, n_queries, n_keys)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, n_queries), atol=1e-6, rtol=0)
    assert (weights >= 0).all()
    allowed = _dense(mask.dense(n_queries, n_keys, None), B, n_queries, n_keys)
    masked_weights = weights.masked_select(~allowed.expand(B, H, n_queries, n_keys))
    assert (masked_weights == 0).all()


# --- masks against brute force ----------------------------------------------------------------


def test_build_allowed_matches_brute_force() -> None:
    rng = random.Random(1234)
    for trial in range(150):
        batch = rng.randint(1, 3)
        n_keys = rng.randint(1, 9)
        n_queries = rng.randint(1, n_keys)
        causal = rng.random() < 0.6
        sliding_window = rng.choice([None, 1, 2, 3, 5])
        key_padding = None
        if rng.random() < 0.5:
            key_padding = [[rng.random() < 0.7 for _ in range(n_keys)] for _ in range(batch)]
        document_ids = None
        if rng.random() < 0.5:
            document_ids = []
            for _ in range(batch):
                row, doc = [], 0
                for _ in range(n_keys):
                    if row and rng.random() < 0.3:
                        doc += 1
                    row.append(doc)
                document_ids.append(row)
        got = build_allowed(
            n_queries,
            n_keys,
            causal=causal,
            sliding_window=sliding_window,
            key_padding=None if key_padding is None else torch.tensor(key_padding),
            document_ids=None if document_ids is None else torch.tensor(document_ids),
        )
        expected = torch.tensor(
            _reference_allowed(
                n_queries,
                n_keys,
                batch,
                causal=causal,
                sliding_window=sliding_window,
                key_padding=key_padding,
                document_ids=document_ids,
            )
        )[:, None]  # (B, 1, Tq, Tk)
        case = f"trial {trial}: Tq={n_queries} Tk={n_keys} causal={causal} w={sliding_window}"
        if got is None:  # None means "every key visible"
            assert bool(expected.all()), case
        else:
            assert got.dtype == torch.bool, case
            assert torch.equal(got.expand_as(expected), expected), case


def test_sliding_window_keeps_query_and_previous_window_minus_one() -> None:
    allowed = build_allowed(5, 5, causal=True, sliding_window=2)[0, 0]
    hand = torch.tensor([[i - 1 <= j <= i for j in range(5)] for i in range(5)])
    assert torch.equal(allowed, hand)


def test_build_allowed_returns_none_when_nothing_masked() -> None:
    assert build_allowed(4, 4, causal=False) is None
    assert build_allowed(1, 6, causal=True) is None
    assert build_allowed(3, 3, causal=False, key_padding=torch.ones(2, 3, dtype=torch.bool)) is None


# --- GQA / MQA --------------------------------------------------------------------------------


def _reference_multihead(
    x: torch.Tensor, module: Attention, allowed: torch.Tensor | None
) -> torch.Tensor:
    """Per-head attention in float64 from the module's weights, query head h using kv head
    h // (H / Hkv) (the repeat_interleave convention)."""
    H, Hkv, D = module.n_heads, module.n_kv_heads, module.head_dim
    w = module.qkv_proj.weight.double()
    wq, wk, wv = w[: H * D], w[H * D : (H + Hkv) * D], w[(H + Hkv) * D :]
    x = x.double()
    heads = []
    for h in range(H):
        g = h // (H // Hkv)
        q = x @ wq[h * D : (h + 1) * D].T  # (B, T, D)
        k = x @ wk[g * D : (g + 1) * D].T
        v = x @ wv[g * D : (g + 1) * D].T
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)
        if allowed is not None:
            scores = scores.masked_fill(~allowed[:, 0], float("-inf"))
        heads.append(scores.softmax(-1) @ v)
    concat = torch.cat(heads, dim=-1)  # (B, T, H*D)
    return (concat @ module.out_proj.weight.double().T).float()


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_attention_module_matches_per_head_reference(heads: str, backend: str) -> None:
    n_heads, n_kv_heads = HEADS[heads]
    module = Attention(_tiny_cfg(n_heads, n_kv_heads, backend)).eval()
    x = torch.randn(2, 7, 32)
    allowed = build_allowed(7, 7, causal=True)
    out = module(x, AttentionMask(allowed=allowed))
    torch.testing.assert_close(out, _reference_multihead(x, module, allowed), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_gqa_with_all_kv_heads_equals_mha(backend: str) -> None:
    mha = Attention(_tiny_cfg(4, 4, backend)).eval()
    gqa_cfg = _tiny_cfg(4, 4, backend)
    assert gqa_cfg.n_kv_heads == gqa_cfg.n_heads
    gqa = Attention(gqa_cfg).eval()
    gqa.load_state_dict(mha.state_dict())
    x = torch.randn(2, 6, 32)
    for mask in (AttentionMask(), AttentionMask(is_causal=True)):
        torch.testing.assert_close(gqa(x, mask), mha(x, mask), atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("heads", ["gqa", "mqa"])
def test_gqa_equals_mha_with_repeated_kv_weights(heads: str, backend: str) -> None:
    n_heads, n_kv_heads = HEADS[heads]
    D, C = 8, 32
    groups = n_heads // n_kv_heads
    gqa = Attention(_tiny_cfg(n_heads, n_kv_heads, backend, qkv_bias=True)).eval()
    mha = Attention(_tiny_cfg(n_heads, n_heads, backend, qkv_bias=True)).eval()
    q_size, kv_size = n_heads * D, n_kv_heads * D

    def repeat_kv(t: torch.Tensor) -> torch.Tensor:
        # (Hkv*D, ...) -> (H*D, ...): kv head g serves query heads g*groups .. g*groups+groups-1
        return t.reshape(n_kv_heads, D, *t.shape[1:]).repeat_interleave(groups, 0).flatten(0, 1)

    with torch.no_grad():
        for name in ("weight", "bias"):
            w = getattr(gqa.qkv_proj, name)
            wq, wk, wv = w[:q_size], w[q_size : q_size + kv_size], w[q_size + kv_size :]
            getattr(mha.qkv_proj, name).copy_(torch.cat([wq, repeat_kv(wk), repeat_kv(wv)]))
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(2, 6, C)
    padding = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    masks = [
        AttentionMask(),
        AttentionMask(is_causal=True),
        AttentionMask(allowed=build_allowed(6, 6, causal=True, key_padding=padding)),
    ]
    for mask in masks:
        torch.testing.assert_close(gqa(x, mask), mha(x, mask), atol=ATOL, rtol=0)


# --- the scale ------------------------------------------------------------------------------


def _np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_eager_attention_matches_numpy_softmax_qkt_over_sqrt_d() -> None:
    B, H, T, D = 2, 3, 5, 16
    q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
    out, _ = eager_attention(q, k, v, AttentionMask(), 1 / math.sqrt(D))
    qn, kn, vn = (t.double().numpy() for t in (q, k, v))
    expected = _np_softmax(qn @ kn.transpose(0, 1, 3, 2) / np.sqrt(D)) @ vn
    np.testing.assert_allclose(out.numpy(), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_module_scale_is_one_over_sqrt_head_dim(backend: str) -> None:
    """head_dim (12) is set apart from d_model / n_heads (8): the scale must follow head_dim."""
    cfg = ModelConfig(
        vocab_size=16, d_model=32, n_layers=1, n_heads=4, head_dim=12, attention_backend=backend
    )
    module = Attention(cfg).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        out = module(x, AttentionMask()).double().numpy()

    H, D = 4, 12
    w = module.qkv_proj.weight.detach().double().numpy()
    xn = x.double().numpy()
    q, k, v = np.split(xn @ w.T, 3, axis=-1)  # (B, T, H*D) each

    def heads(t: np.ndarray) -> np.ndarray:
        return t.reshape(2, 5, H, D).transpose(0, 2, 1, 3)

    att = _np_softmax(heads(q) @ heads(k).transpose(0, 1, 3, 2) / math.sqrt(D)) @ heads(v)
    expected = (
        att.transpose(0, 2, 1, 3).reshape(2, 5, H * D)
        @ module.out_proj.weight.detach().double().numpy().T
    )
    np.testing.assert_allclose(out, expected, atol=ATOL, rtol=0)
