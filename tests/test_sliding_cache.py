"""The sliding-window (rolling buffer) KV cache (issue 5, Mistral's ring of W slots): decoding
with it equals recomputing the whole sequence under the window mask, its memory stays at W
positions however long the sequence, and misuse fails with a clear error."""

from __future__ import annotations

import pytest
import torch
from conftest import left_padded, tiny_model

import glassformer as gf
from glassformer.models.gpt import GPT
from glassformer.nn.attention import attention_mask
from glassformer.nn.kv_cache import KVCache, SlidingWindowCache

ATOL = 1e-5
VOCAB = 40


def _model(sliding_window: int | None = 5, weight_scale: float = 1.0, **overrides) -> GPT:
    """tiny_model with the window first. weight_scale > 1 gives peaked distributions: greedy
    text that varies, choices that are not near-ties. (Logits then grow, and with them fp32
    round-off: x3 keeps it near 2e-6.)"""
    fields = dict(vocab_size=VOCAB, max_seq_len=64, sliding_window=sliding_window)
    return tiny_model(**fields | overrides, scale=weight_scale)


def _recompute_last(model: GPT, ids: torch.Tensor) -> torch.Tensor:
    """Reference: the whole sequence from scratch, no cache, the window mask over all of it."""
    return model(ids)[:, -1]  # (B, V)


# --- decoding equals recomputing with the window mask -------------------------------------------


@pytest.mark.parametrize(
    "window, n_kv_heads, backend",
    [(4, 2, "sdpa"), (5, 1, "sdpa"), (8, 4, "sdpa"), (6, 2, "eager")],
)
def test_greedy_decode_past_the_window_equals_recompute(window, n_kv_heads, backend) -> None:
    """45 greedy tokens from a 3-token prompt: the ring wraps many times; every step's logits
    equal the full recompute's and so does every chosen token."""
    model = _model(window, weight_scale=3.0, n_kv_heads=n_kv_heads, attention_backend=backend)
    ids = torch.tensor([[3, 14, 15]])
    cache = model.new_cache(1)
    assert isinstance(cache, SlidingWindowCache)
    with torch.no_grad():
        logits = model(ids, torch.arange(3), cache=cache, last_token_only=True)[:, -1]
        for step in range(45):
            reference = _recompute_last(model, ids)
            torch.testing.assert_close(logits, reference, atol=ATOL, rtol=1e-5, msg=f"step {step}")
            next_id = logits.argmax(-1, keepdim=True)  # (1, 1)
            assert int(next_id) == int(reference.argmax()), f"step {step}"
            logits = model(next_id, torch.tensor([ids.shape[1]]), cache=cache)[:, -1]
            ids = torch.cat([ids, next_id], dim=1)
    assert ids.shape[1] == 48 and cache.nbytes == cache.kv_bytes_per_token * window


def test_one_layer_decode_equals_attending_to_the_last_window_only() -> None:
    """With one layer the window is the whole story: the last token's logits equal running the
    model on the last W tokens alone (their true positions, a plain causal mask), a reference
    that uses no sliding-window code at all."""
    window = 4
    model = _model(window, n_layers=1)
    plain = _model(None, n_layers=1)
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, VOCAB, (2, 20))
    cache = model.new_cache(2)
    with torch.no_grad():
        model(ids[:, :6], torch.arange(6), cache=cache)
        for t in range(6, 20):
            step = model(ids[:, t : t + 1], torch.tensor([t]), cache=cache)[:, -1]
            positions = torch.arange(t + 1 - window, t + 1)[None]
            alone = plain(ids[:, t + 1 - window : t + 1], position_ids=positions)[:, -1]
            torch.testing.assert_close(step, alone, atol=ATOL, rtol=0, msg=f"position {t}")


def test_prefill_longer_than_the_window_then_decode() -> None:
    model = _model(5)
    ids = torch.randint(0, VOCAB, (2, 30))
    cache = model.new_cache(2)
    with torch.no_grad():
        prefill = model(ids[:, :17], torch.arange(17), cache=cache)  # 17 > W = 5: sliding mask
        torch.testing.assert_close(prefill, model(ids[:, :17]), atol=ATOL, rtol=0)
        assert cache.row_bytes(17) * 2 == cache.kv_bytes_per_token * 5 * 2
        for t in range(17, 30):
            step = model(ids[:, t : t + 1], torch.tensor([t]), cache=cache)[:, -1]
            torch.testing.assert_close(
                step, _recompute_last(model, ids[:, : t + 1]), atol=ATOL, rtol=0
            )


@pytest.mark.parametrize("chunks", [(3, 4, 1, 9, 2, 6), (1, 1, 12, 5, 6), (7, 7, 7, 4)])
def test_chunked_prefill_equals_one_shot(chunks) -> None:
    """Chunks shorter and longer than the window, starting before and after it wraps: each
    query of a chunk sees exactly its own window of ring keys and chunk keys."""
    model = _model(6)
    ids = torch.randint(0, VOCAB, (2, sum(chunks) + 3))
    cache = model.new_cache(2)
    with torch.no_grad():
        one_shot = model(ids)
        pieces, start = [], 0
        for n in chunks:
            pieces.append(
                model(ids[:, start : start + n], torch.arange(start, start + n), cache=cache)
            )
            start += n
        torch.testing.assert_close(torch.cat(pieces, dim=1), one_shot[:, :start], atol=ATOL, rtol=0)
        for t in range(start, ids.shape[1]):  # and decoding carries on from the chunked ring
            step = model(ids[:, t : t + 1], torch.tensor([t]), cache=cache)
            torch.testing.assert_close(step, one_shot[:, t : t + 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_alibi_with_the_ring_builds_its_bias_from_each_slots_position(backend) -> None:
    """ALiBi's bias depends on distances, so slot order matters: the cache reports each slot's
    position and the bias is built from it."""
    model = _model(4, position="alibi", attention_backend=backend)
    ids = torch.randint(0, VOCAB, (1, 26))
    cache = model.new_cache(1)
    with torch.no_grad():
        full = model(ids)
        spans = ((0, 7), (7, 9), (9, 10))
        chunks = [model(ids[:, a:b], torch.arange(a, b), cache=cache) for a, b in spans]
        steps = [model(ids[:, t : t + 1], torch.tensor([t]), cache=cache) for t in range(10, 26)]
    torch.testing.assert_close(torch.cat(chunks + steps, dim=1), full, atol=ATOL, rtol=0)


def test_left_padded_batch_with_the_ring_equals_each_row_alone() -> None:
    """Batched generation's left padding: the padding mask (B, sequence) is indexed by each
    slot's position, so pad keys stay hidden after the ring wraps."""
    model = _model(5)
    # Row 1's pads 0..5 are still inside the first decode steps' windows after the ring wraps.
    lengths, width, n_new = [8, 2], 8, 10
    prompts = [torch.randint(1, VOCAB, (n,)) for n in lengths]
    continuations = torch.randint(1, VOCAB, (2, n_new))
    ids, padding_mask, position_ids = left_padded(prompts, width)
    cache = model.new_cache(2)
    with torch.no_grad():
        model(
            ids,
            torch.arange(width),
            position_ids=position_ids,
            padding_mask=padding_mask,
            cache=cache,
        )
        steps = []
        for t in range(n_new):
            padding_mask = torch.cat([padding_mask, torch.ones(2, 1, dtype=torch.bool)], dim=1)
            position_ids = position_ids[:, -1:] + 1
            step = model(
                continuations[:, t : t + 1],
                torch.tensor([width + t]),
                position_ids=position_ids,
                padding_mask=padding_mask,
                cache=cache,
            )
            steps.append(step[:, -1])
        for b, p in enumerate(prompts):
            alone = model(torch.cat([p, continuations[b]])[None])[0, -n_new:]
            got = torch.stack([s[b] for s in steps])
            torch.testing.assert_close(got, alone, atol=ATOL, rtol=0)


# --- what the ring holds ------------------------------------------------------------------------


def test_ring_slots_hold_the_full_caches_keys_at_key_positions() -> None:
    """After every step, slot s holds the same rotated key and value as a full KVCache at
    position key_positions(t, 1)[s]: the write-at-position-mod-W bookkeeping, checked directly."""
    model = _model(5)
    ids = torch.randint(0, VOCAB, (1, 23))
    ring, full = model.new_cache(1, kind="sliding"), model.new_cache(1, kind="full")
    assert isinstance(full, KVCache)
    with torch.no_grad():
        for cache in (ring, full):
            model(ids[:, :8], torch.arange(8), cache=cache)
        for t in range(8, 23):
            for cache in (ring, full):
                model(ids[:, t : t + 1], torch.tensor([t]), cache=cache)
            positions = ring.key_positions(t, 1)  # the positions the slots hold after step t
            assert sorted(positions.tolist()) == list(range(t + 1 - 5, t + 1))
            n = len(positions)
            torch.testing.assert_close(ring.k[..., :n, :], full.k[..., positions, :])
            torch.testing.assert_close(ring.v[..., :n, :], full.v[..., positions, :])


def test_memory_stays_at_the_window_whatever_the_length() -> None:
    model = _model(6)
    cfg = model.cfg
    cache = model.new_cache(3, max_seq_len=64)
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # k and v, fp32
    assert cache.kv_bytes_per_token == per_token
    assert cache.nbytes == per_token * 6 * 3  # W positions for each of 3 rows, not 64
    assert model.new_cache(3, kind="full").nbytes == per_token * 64 * 3
    filled = []
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (3, 2)), torch.arange(2), cache=cache)
        filled.append(3 * cache.row_bytes(2))
        for n in range(3, 43):
            model(torch.randint(0, VOCAB, (3, 1)), torch.tensor([n - 1]), cache=cache)
            filled.append(3 * cache.row_bytes(n))
    assert filled == [per_token * 3 * min(n, 6) for n in range(2, 43)]
    assert cache.nbytes == per_token * 6 * 3


def test_reset_starts_a_fresh_sequence() -> None:
    model = _model(4)
    first, second = torch.randint(0, VOCAB, (1, 15)), torch.randint(0, VOCAB, (1, 11))
    cache = model.new_cache(1)
    with torch.no_grad():
        model(first, torch.arange(15), cache=cache)
        cache.reset()
        again = [model(second[:, :6], torch.arange(6), cache=cache)]
        again += [model(second[:, t : t + 1], torch.tensor([t]), cache=cache) for t in range(6, 11)]
        torch.testing.assert_close(torch.cat(again, dim=1), model(second), atol=ATOL, rtol=0)


def test_attention_mask_over_ring_keys_matches_a_brute_force_loop() -> None:
    """The mask over out-of-order ring keys, against the rule spelled out key by key."""
    q_positions = torch.tensor([9, 10, 11])
    k_positions = torch.tensor([5, 6, 7, 8, 4, 9, 10, 11])
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :6] = False
    allowed = attention_mask(
        q_positions, k_positions, causal=True, sliding_window=4, padding_mask=padding
    ).allowed
    for b in range(2):
        for i, q in enumerate(q_positions.tolist()):
            for j, k in enumerate(k_positions.tolist()):
                expected = k <= q and q - k < 4 and bool(padding[b, k])
                assert bool(allowed[b, 0, i, j]) == expected, (b, q, k)


# --- the engine and new_cache -------------------------------------------------------------------


def test_engine_generates_with_the_ring_and_reports_bounded_cache_bytes() -> None:
    model = _model(6, weight_scale=8.0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    result = gf.Engine(model).generate(prompt, max_new_tokens=40, temperature=0.0)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(40):
            ids = torch.cat([ids, _recompute_last(model, ids).argmax(-1, keepdim=True)], dim=1)
    assert result.token_ids == ids[0, len(prompt) :].tolist()
    per_token = model.new_cache(1).kv_bytes_per_token
    assert result.stats.kv_cache_bytes == per_token * 6
    assert result.stats.kv_cache_capacity_bytes == per_token * 6


def test_batched_generation_with_the_ring_equals_each_prompt_recomputed() -> None:
    """Engine.generate_batch left-pads the prompts; with the ring each row still decodes what
    a cache-less recompute of that row alone picks."""
    model = _model(5, weight_scale=8.0)
    prompts = [[5, 7, 1, 30, 2, 8, 9, 11], [3, 14], [2, 7, 18, 28, 1]]
    results = gf.Engine(model).generate_batch(prompts, max_new_tokens=20, temperature=0.0)
    for prompt, result in zip(prompts, results, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(20):
                next_id = _recompute_last(model, ids).argmax(-1, keepdim=True)
                ids = torch.cat([ids, next_id], dim=1)
        assert result.token_ids == ids[0, len(prompt) :].tolist()


def test_engine_runs_up_to_max_seq_len_past_the_window() -> None:
    model = _model(4, max_seq_len=24)
    result = gf.Engine(model).generate([1, 2, 3], max_new_tokens=100, temperature=0.0)
    assert result.stats.stop_reason == "context_full"
    assert 3 + len(result.token_ids) == 24 + 1  # the last token is sampled, never fed back


def test_new_cache_chooses_the_ring_only_when_it_saves_memory() -> None:
    model = _model(8)
    assert isinstance(model.new_cache(1), SlidingWindowCache)  # max_seq_len 64 > W 8
    assert isinstance(model.new_cache(1, max_seq_len=8), KVCache)  # fits in the window
    assert isinstance(model.new_cache(1, kind="full"), KVCache)
    assert isinstance(_model(None).new_cache(1), KVCache)


# --- misuse -------------------------------------------------------------------------------------


def test_ring_for_a_model_without_a_window_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"sliding_window=None: .* use KVCache"):
        _model(None).new_cache(1, kind="sliding")


def test_unknown_cache_kind_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"kind='ring' is not known: pick 'auto', 'full'"):
        _model(4).new_cache(1, kind="ring")


def test_ring_of_another_window_is_a_clear_error() -> None:
    model = _model(4)
    cache = SlidingWindowCache.for_config(_model(6).cfg, 1, None, torch.float32, None)
    with pytest.raises(ValueError, match=r"window=6 does not fit this model's sliding_window=4"):
        model(torch.randint(0, VOCAB, (1, 3)), torch.arange(3), cache=cache)


def test_ring_past_its_position_limit_is_a_clear_error() -> None:
    model = _model(4)
    cache = model.new_cache(1, max_seq_len=10)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 10)), torch.arange(10), cache=cache)
        with pytest.raises(ValueError, match=r"10 fed \+ 1 new positions > max_seq_len 10"):
            model(torch.randint(0, VOCAB, (1, 1)), torch.tensor([10]), cache=cache)


@pytest.mark.parametrize(
    "field, value, message",
    [("window", 0, r"window=0 must be >= 1"), ("max_seq_len", 0, r"max_seq_len=0 must be >= 1")],
)
def test_bad_ring_sizes_are_clear_errors(field, value, message) -> None:
    sizes = dict(n_layers=1, batch_size=1, n_kv_heads=1, window=4, head_dim=8, max_seq_len=16)
    with pytest.raises(ValueError, match=message):
        SlidingWindowCache(**(sizes | {field: value}))


# --- grad mode: the caches hold values, not graphs ----------------------------------------------


@pytest.mark.parametrize("kind, window", [("full", None), ("sliding", 4)])
def test_cached_forward_in_grad_mode_frees_its_graph(kind, window) -> None:
    """A forward with a cache outside no_grad used to write tensors with a graph into the
    buffers in place: a reference cycle through autograd that gc cannot free (SmolLM2 leaked
    ~700 MB per prompt). The buffers must be collectable once the cache is dropped."""
    import gc
    import weakref

    model = _model(window)
    cache = model.new_cache(max_seq_len=16, kind=kind)
    model(torch.tensor([[1, 2, 3, 4, 5, 6]]), torch.arange(6), cache=cache)  # a chunk, with grad
    model(torch.tensor([[7]]), torch.tensor([6]), cache=cache)  # one decode step, with grad
    buffers = weakref.ref(cache.k)
    assert not cache.k.requires_grad
    del cache
    gc.collect()
    assert buffers() is None


@pytest.mark.parametrize("kind, window", [("full", None), ("sliding", 4)])
def test_gradients_through_a_cached_call_equal_the_uncached_ones(kind, window) -> None:
    """Gradients flow through the call's own keys and values: a cached prefill of the whole
    sequence gives the same parameter gradients as the plain forward; a decode step after a
    cached prefix gives the same logits as the full forward (earlier positions as constants)."""
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    plain, cached = _model(window), _model(window)
    plain(ids)[:, -1].sum().backward()
    cache = cached.new_cache(max_seq_len=16, kind=kind)
    cached(ids, torch.arange(7), cache=cache)[:, -1].sum().backward()
    for (name, p), q in zip(plain.named_parameters(), cached.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=ATOL, rtol=1e-4, msg=name)
    step = cached(torch.tensor([[6]]), torch.tensor([7]), cache=cache)[:, -1]
    assert step.requires_grad
    full = plain(torch.cat([ids, torch.tensor([[6]])], dim=1))[:, -1]
    torch.testing.assert_close(step, full, atol=ATOL, rtol=1e-4)
