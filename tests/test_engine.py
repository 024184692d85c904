"""The generation engine against a full recompute without cache (seed 000 §2.5.1)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import glassformer as gf
from glassformer.infer.sampling import SamplingParams, sampling_distribution


def greedy_by_recompute(model, prompt: list[int], n: int) -> list[int]:
    """Reference: run the whole sequence from scratch for every new token, no cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "rope", "alibi", "none"])
def test_greedy_generation_equals_recompute(position):
    model = tiny_model(position=position)
    prompt = [3, 14, 15, 9, 2, 6]
    result = gf.Engine(model).generate(prompt, max_new_tokens=20, temperature=0.0)
    assert result.token_ids == greedy_by_recompute(model, prompt, 20)
    assert result.stats.stop_reason == "max_new_tokens"


def test_stream_yields_what_generate_returns_and_fills_stats():
    model = tiny_model()
    engine = gf.Engine(model)
    prompt = [1, 2, 3, 4, 5]
    stream = engine.stream(prompt, max_new_tokens=12, temperature=0.9, top_k=10, seed=7)
    streamed = list(stream)
    result = engine.generate(prompt, max_new_tokens=12, temperature=0.9, top_k=10, seed=7)
    assert streamed == result.token_ids
    stats = stream.stats
    assert stats.prompt_tokens == 5 and stats.generated_tokens == 12
    assert stats.time_to_first_token_s > 0 and stats.decode_tokens_per_s > 0
    cfg = model.cfg
    # The cache holds the prompt and every generated token but the last (never fed back).
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # fp32
    assert stats.kv_cache_bytes == per_token * (5 + 12 - 1)
    assert stats.kv_cache_capacity_bytes == per_token * (5 + 12)


def test_same_seed_same_output_and_seeds_differ():
    engine = gf.Engine(tiny_model())
    runs = [
        engine.generate([1, 2], max_new_tokens=30, temperature=1.5, seed=s).token_ids
        for s in (0, 0, 1)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_top_k_one_is_greedy():
    engine = gf.Engine(tiny_model())
    greedy = engine.generate([4, 5, 6], max_new_tokens=15, temperature=0.0).token_ids
    top1 = engine.generate([4, 5, 6], max_new_tokens=15, temperature=2.0, top_k=1, seed=3)
    assert top1.token_ids == greedy


def test_sampled_tokens_come_from_the_sampling_distribution():
    # Each sampled token must have nonzero probability under the top-k/top-p distribution
    # computed from the logits of a full recompute.
    model = tiny_model()
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.8)
    prompt = [7, 8, 9]
    result = gf.Engine(model).generate(prompt, max_new_tokens=15, top_k=5, top_p=0.8, seed=11)
    ids = list(prompt)
    with torch.no_grad():
        for token in result.token_ids:
            probs = sampling_distribution(model(torch.tensor([ids]))[:, -1], params)[0]
            assert probs[token] > 0
            ids.append(token)


def test_stops_at_eos_and_at_full_context():
    model = tiny_model()
    engine = gf.Engine(model)
    greedy = engine.generate([1, 2, 3], max_new_tokens=10, temperature=0.0).token_ids
    eos = greedy[3]
    first = greedy.index(eos)  # the eos id may already appear earlier
    stopped = engine.generate([1, 2, 3], max_new_tokens=10, temperature=0.0, eos_token_id=eos)
    assert stopped.token_ids == greedy[: first + 1]
    assert stopped.stats.stop_reason == "eos"

    full = engine.generate([i % 37 for i in range(40)], max_new_tokens=100, temperature=0.0)
    assert full.stats.stop_reason == "context_full"
    assert 40 + len(full.token_ids) == model.cfg.max_seq_len + 1


def test_cache_is_reused_and_reset_between_generations():
    engine = gf.Engine(tiny_model())
    a = engine.generate([5, 6, 7], max_new_tokens=8, temperature=0.0).token_ids
    engine.generate([1] * 30, max_new_tokens=8, temperature=0.0)
    b = engine.generate([5, 6, 7], max_new_tokens=8, temperature=0.0).token_ids
    assert a == b


@pytest.mark.parametrize(
    ("prompt", "kwargs", "match"),
    [
        ([], {}, "empty"),
        (list(range(30)) * 2, {}, "context window is max_seq_len=48"),
        ([1, 99], {}, "token id 99 is outside the vocabulary"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"top_k": 0}, "top_k"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_input_gives_a_clear_error(prompt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gf.Engine(tiny_model()).generate(prompt, **kwargs)


def test_shift_on_full_context_equals_recomputing_the_kept_window():
    """With on_full_context="shift", a full window keeps its second half; the reference
    recomputes the logits of that window from scratch at every step."""
    model = tiny_model(position="learned")  # absolute positions: the window must restart at 0
    L, keep = model.cfg.max_seq_len, model.cfg.max_seq_len // 2
    prompt = [i % 37 for i in range(40)]
    result = gf.Engine(model).generate(
        prompt, max_new_tokens=60, temperature=0.0, on_full_context="shift"
    )
    context, expected = list(prompt), []
    with torch.no_grad():
        for _ in range(60):
            token = int(model(torch.tensor([context]))[0, -1].argmax())
            expected.append(token)
            if len(context) == L:  # feeding one more would overflow: cut to the second half
                context = context[len(context) - keep + 1 :]
            context.append(token)
    assert result.token_ids == expected
    assert result.stats.context_shifts >= 2 and result.stats.stop_reason == "max_new_tokens"
