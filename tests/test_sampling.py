"""The sampler (seed 002 "采样"): each filter against a brute-force or closed-form reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from glassformer.infer.sampling import SamplingParams, filter_logits, sample, sampling_distribution
from glassformer.models.common import all_finite

torch.set_num_threads(1)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _nucleus_reference(logits_row: np.ndarray, top_p: float) -> tuple[set[int], bool]:
    """The smallest set of most likely tokens with mass >= top_p, by plain sort and sum.

    Also says whether float32 rounding could flip the answer (mass too close to top_p).
    """
    probs = _softmax(logits_row.astype(np.float64))
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    ambiguous = any(abs(m - top_p) < 1e-5 for m in np.cumsum(probs[order]))
    return kept, ambiguous


def _nucleus_brute_force(probs: np.ndarray, top_p: float) -> set[int]:
    """The same set found by trying every subset, smallest first (only for tiny vocabularies)."""
    n = len(probs)
    for size in range(1, n + 1):
        best = None
        for mask in range(1 << n):
            members = [i for i in range(n) if mask >> i & 1]
            if len(members) != size:
                continue
            mass = sum(probs[i] for i in members)
            if mass >= top_p and (best is None or mass > best[0]):
                best = (mass, set(members))
        if best is not None:
            return best[1]
    raise AssertionError("the whole vocabulary always has mass 1")


def _kept(filtered: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(filtered)).flatten().tolist())


# --- params -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.5}, "temperature=-0.5"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"temperature": float("inf")}, ">= 0"),
        ({"top_k": 0}, "top_k=0"),
        ({"top_k": 2.5}, "integer >= 1"),
        ({"top_k": True}, "top_k=True"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "(0, 1]"),
        ({"top_p": -0.1}, "top_p=-0.1"),
    ],
)
def test_invalid_params_name_the_value_and_range(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert needle in str(err.value)


def test_invalid_filter_arguments_raise() -> None:
    with pytest.raises(ValueError, match="top_k=0"):
        filter_logits(torch.zeros(1, 4), top_k=0)
    with pytest.raises(ValueError, match="top_p=2"):
        filter_logits(torch.zeros(1, 4), top_p=2)


def test_params_defaults_and_greedy_flag() -> None:
    assert SamplingParams() == SamplingParams(temperature=1.0, top_k=None, top_p=None)
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=5, top_p=0.9).is_greedy


# --- top-k ------------------------------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=gen)
    for k in (1, 3, 10, 50, 80):
        filtered = filter_logits(logits, top_k=k)
        for row in range(logits.shape[0]):
            values = logits[row].tolist()
            expected = set(sorted(range(50), key=lambda i: -values[i])[: min(k, 50)])
            assert _kept(filtered[row]) == expected
            kept = list(expected)
            assert torch.equal(filtered[row, kept], logits[row, kept])  # survivors untouched


def test_top_k_ties_keep_every_tied_token() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    assert _kept(filter_logits(logits, top_k=2)[0]) == {0, 2, 3}


def test_top_k_samples_never_leave_the_k_most_likely() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=gen)
    allowed = [set(torch.topk(logits[b], 5).indices.tolist()) for b in range(4)]
    params = SamplingParams(temperature=2.0, top_k=5)  # a flat distribution tries the edges
    draws = torch.stack([sample(logits, params, generator=gen) for _ in range(500)])  # (N, B)
    for b in range(4):
        seen = set(draws[:, b].tolist())
        assert seen <= allowed[b]
        assert len(seen) == 5  # and at T=2 every one of the five shows up


# --- top-p ------------------------------------------------------------------------------------


def test_top_p_matches_sort_and_cumsum_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(32, 40, generator=gen) * 2.0
    checked = 0
    for top_p in (1e-6, 0.01, 0.1, 0.25, 0.5, 0.63, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0):
        filtered = filter_logits(logits, top_p=top_p)
        for row in range(logits.shape[0]):
            expected, ambiguous = _nucleus_reference(logits[row].numpy(), top_p)
            if ambiguous and top_p < 1.0:
                continue  # mass within float32 rounding of top_p: either answer is right
            if top_p == 1.0:
                expected = set(range(40))  # p = 1 cuts nothing, however small the tail
            assert _kept(filtered[row]) == expected, (top_p, row)
            checked += 1
    assert checked > 300


def test_top_p_tiny_keeps_only_the_top_token() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    assert _kept(filter_logits(logits, top_p=1e-9)[0]) == {1}


def test_top_p_matches_brute_force_over_all_subsets() -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = torch.randn(1, 7, generator=gen) * 1.5
        probs = _softmax(logits[0].double().numpy())
        for top_p in (0.05, 0.3, 0.5, 0.7, 0.9, 0.97):
            if any(abs(m - top_p) < 1e-5 for m in np.cumsum(np.sort(probs)[::-1])):
                continue
            assert _kept(filter_logits(logits, top_p=top_p)[0]) == _nucleus_brute_force(
                probs, top_p
            )


def test_top_p_hand_computed_case() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: p=0.8 needs {0.5, 0.3}; p=0.81 also needs the 0.15
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert _kept(filter_logits(logits, top_p=0.79)[0]) == {0, 1}
    assert _kept(filter_logits(logits, top_p=0.81)[0]) == {0, 1, 2}
    assert _kept(filter_logits(logits, top_p=0.96)[0]) == {0, 1, 2, 3}


def test_top_k_is_applied_before_top_p() -> None:
    # probs 0.4, 0.3, 0.2, 0.1; top-k=2 renormalises {0.4, 0.3} to {4/7, 3/7}, and then
    # top-p=0.5 keeps only the first (4/7 >= 0.5); top-p alone at 0.5 would keep two.
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    assert _kept(filter_logits(logits, top_p=0.5)[0]) == {0, 1}
    assert _kept(filter_logits(logits, top_k=2, top_p=0.5)[0]) == {0}


def test_filter_returns_a_new_tensor() -> None:
    logits = torch.randn(2, 5)
    before = logits.clone()
    for kwargs in ({}, {"top_k": 2}, {"top_p": 0.5}):
        out = filter_logits(logits, **kwargs)
        out.fill_(0.0)
        assert torch.equal(logits, before)


# --- temperature and sampling -----------------------------------------------------------------


def test_temperature_zero_is_argmax() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 100, generator=gen)
    params = SamplingParams(temperature=0.0, top_k=50, top_p=0.5)
    assert torch.equal(sample(logits, params, generator=gen), logits.argmax(dim=-1))
    dist = sampling_distribution(logits, params)
    assert torch.equal(dist, torch.nn.functional.one_hot(logits.argmax(-1), 100).float())


def test_same_seed_same_tokens_different_seed_differs() -> None:
    logits = torch.zeros(64, 1000)  # uniform: any two independent draws are unlikely to agree
    params = SamplingParams(temperature=1.0)

    def draw(seed: int) -> torch.Tensor:
        return sample(logits, params, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(123), draw(123))
    assert not torch.equal(draw(123), draw(124))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_frequencies_match_softmax_over_temperature(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    expected = np.exp(logits.double().numpy() / temperature)
    expected /= expected.sum()
    n = 20000
    gen = torch.Generator().manual_seed(5)
    draws = sample(logits.expand(n, -1), SamplingParams(temperature=temperature), generator=gen)
    counts = np.bincount(draws.numpy(), minlength=6)
    chi_square = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001
    assert chi_square < 20.5, (counts, n * expected)


def test_sampling_distribution_closed_form() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    dist = sampling_distribution(logits, SamplingParams(temperature=0.5, top_k=2))
    # top-2 at T=0.5 keeps logits 3 and 4, i.e. exp(6) and exp(8)
    expected = torch.tensor([[0.0, 0.0, 1 / (1 + math.e**2), 1 / (1 + math.e**-2)]])
    torch.testing.assert_close(dist, expected)
    assert dist.dtype == torch.float32


def test_bf16_logits_sample_in_float32() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(6)).bfloat16()
    params = SamplingParams(temperature=0.8, top_p=0.9)
    dist = sampling_distribution(logits, params)
    assert dist.dtype == torch.float32
    torch.testing.assert_close(dist.sum(-1), torch.ones(3))
    tokens = sample(logits, params, generator=torch.Generator().manual_seed(0))
    assert tokens.dtype == torch.long and tokens.shape == (3,)


def test_tiny_temperature_stays_finite_and_approaches_greedy() -> None:
    logits = torch.tensor([[10.0, 9.0, -5.0]])
    dist = sampling_distribution(logits, SamplingParams(temperature=1e-30))
    assert torch.equal(dist, torch.tensor([[1.0, 0.0, 0.0]]))


def test_sample_rejects_3d_logits() -> None:
    with pytest.raises(ValueError, match=r"logits\[:, -1, :\]"):
        sample(torch.zeros(1, 2, 3), SamplingParams())


# --- min-p and the repetition penalty, against transformers' own processors -------------------


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.2, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_min_p_after_temperature_equals_transformers(min_p, temperature):
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper

    torch.manual_seed(3)
    logits = torch.randn(4, 50) * 3
    ids = torch.zeros(4, 1, dtype=torch.long)
    expected = MinPLogitsWarper(min_p)(ids, TemperatureLogitsWarper(temperature)(ids, logits))
    expected = torch.softmax(expected, dim=-1)
    got = sampling_distribution(logits, SamplingParams(temperature=temperature, min_p=min_p))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("penalty", [0.7, 1.0, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from glassformer.infer.sampling import penalize_repetition

    torch.manual_seed(4)
    logits = torch.randn(2, 30) * 4  # positive and negative logits among the seen tokens
    seen = torch.tensor([[1, 5, 5, 7, 29], [0, 2, 4, 6, 8]])
    expected = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone())
    torch.testing.assert_close(penalize_repetition(logits, seen, penalty), expected)


def test_the_engine_applies_the_repetition_penalty_to_the_rows_own_tokens():
    """A greedy row with a huge penalty never repeats a token of its prompt or its own."""
    import glassformer as gf

    torch.manual_seed(0)
    cfg = gf.ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=64)
    model = gf.build_model(cfg).eval()
    prompt = [1, 2, 3]
    plain = gf.Engine(model).generate(prompt, 20, temperature=0.0, eos_token_id=-1).token_ids
    assert len(set(prompt + plain)) < len(prompt + plain)  # the plain model repeats itself
    penalized = (
        gf.Engine(model)
        .generate(prompt, 20, temperature=0.0, eos_token_id=-1, repetition_penalty=1e6)
        .token_ids
    )
    assert len(set(prompt + penalized)) == len(prompt + penalized)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_all_finite_agrees_with_numpy_on_nan_inf_and_sums_that_overflow(dtype) -> None:
    """all_finite sums first; a NaN or an inf anywhere, or both infinities at once, must still
    be found, and finite values whose sum overflows (float32, float64, bf16 here) must pass."""
    g = torch.Generator().manual_seed(0)
    bases = [
        torch.randn(3, 50, generator=g).to(dtype),
        torch.full((4, 8), torch.finfo(dtype).max / 2, dtype=dtype),
    ]
    cases = list(bases)
    for base in bases:
        for bad in (float("nan"), float("inf"), float("-inf")):
            case = base.clone()
            case.view(-1)[int(torch.randint(case.numel(), (1,), generator=g))] = bad
            cases.append(case)
        both = base.clone()
        both.view(-1)[:2] = torch.tensor([float("inf"), float("-inf")])
        cases.append(both)
    verdicts = [all_finite(case) for case in cases]
    assert verdicts == [bool(np.isfinite(case.double().numpy()).all()) for case in cases]
    assert verdicts.count(True) == 2  # the two bases
