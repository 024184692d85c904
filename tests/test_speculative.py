"""Speculative decoding against plain decoding: greedy output token for token equal to
Engine(target).generate(temperature=0), and sampled output distributed as the target's own."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import needs_kernels, tiny_model

import glassformer as gf
from glassformer.infer.sampling import SamplingParams, sampling_distribution
from glassformer.infer.speculative import speculative_generate, verify_sampled
from glassformer.nn.kv_cache import KVCache

PROMPT = [3, 14, 15, 9, 2, 6]


def plain_greedy(model, prompt, max_new_tokens, eos_token_id=None):
    result = gf.Engine(model).generate(
        prompt, max_new_tokens=max_new_tokens, temperature=0.0, eos_token_id=eos_token_id
    )
    return result.token_ids, result.stats.stop_reason


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
def test_random_draft_gives_plain_greedy_output(k):
    target = tiny_model(seed=0)
    draft = tiny_model(seed=1, n_layers=1, d_model=16, n_heads=2, n_kv_heads=1)
    expected, _ = plain_greedy(target, PROMPT, 23)
    result = speculative_generate(target, draft, PROMPT, max_new_tokens=23, k=k)
    assert result.token_ids == expected
    stats = result.stats
    assert stats.generated_tokens == 23 and stats.stop_reason == "max_new_tokens"
    assert stats.accepted <= stats.proposed and stats.rounds >= 22 / (k + 1)
    # An unrelated random draft is rarely right: most rounds end at the first proposal.
    assert stats.acceptance_rate < 0.5


@needs_kernels
def test_fused_steps_propose_and_check_the_rounds():
    # Models the fused C step takes (widths multiples of 32): the draft's one-token passes go
    # through its fused step, the target checks each round through its `many`, and the tokens
    # and counts are those of the torch modules (fast=False).
    from glassformer.infer.speculative import SpeculativeDecoder

    target = tiny_model(seed=0, d_model=64)
    draft = tiny_model(seed=1, d_model=64, n_layers=1)
    fast, plain = (
        SpeculativeDecoder(target, draft, 3),
        SpeculativeDecoder(target, draft, 3, fast=False),
    )
    assert fast.draft_step is not None and plain.draft_step is None
    calls = []
    real = fast.draft_step

    class Spy:
        takes = real.takes

        def many(self, *args):
            calls.append(args[:2])
            return real.many(*args)

    fast.draft_step = Spy()
    checks, many = [], fast.fused.many
    fast.fused.many = lambda tokens, *args: checks.append(len(tokens)) or many(tokens, *args)
    a, b = (d.generate(PROMPT, 20, temperature=0.0) for d in (fast, plain))
    assert a.token_ids == b.token_ids == plain_greedy(target, PROMPT, 20)[0]
    assert (a.stats.proposed, a.stats.accepted) == (b.stats.proposed, b.stats.accepted)
    prefill, *rounds = checks  # the prompt's 6 tokens go through `many` too (FUSED_PREFILL)
    assert prefill == len(PROMPT) and len(rounds) == a.stats.rounds and max(rounds) == 4  # k + 1
    assert len(calls) > 0


@pytest.mark.parametrize("k", [1, 2, 4, 5])
def test_draft_equal_to_target_accepts_everything(k):
    target = tiny_model(seed=0)
    n_rounds = 4
    max_new = 1 + n_rounds * (k + 1)  # the prefill's token, then full rounds
    expected, _ = plain_greedy(target, PROMPT, max_new)
    result = speculative_generate(target, target, PROMPT, max_new_tokens=max_new, k=k)
    assert result.token_ids == expected
    stats = result.stats
    assert stats.acceptance_rate == 1.0 and stats.accepted == n_rounds * k
    assert stats.rounds == n_rounds and stats.tokens_per_target_forward == k + 1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 6, 11, 17])
def test_max_new_tokens_not_a_multiple_of_k_plus_one(max_new_tokens):
    target = tiny_model(seed=0)
    expected, _ = plain_greedy(target, PROMPT, max_new_tokens)
    for draft in (target, tiny_model(seed=2)):
        result = speculative_generate(target, draft, PROMPT, max_new_tokens=max_new_tokens, k=4)
        assert result.token_ids == expected
        assert result.stats.stop_reason == "max_new_tokens"


def test_eos_inside_a_proposal_stops_there():
    target = tiny_model(seed=0)
    free_run, _ = plain_greedy(target, PROMPT, 20)
    # A token first produced in the middle of the run, so with draft == target (all accepted,
    # k = 4) it sits inside a round's proposals, not at a round's end.
    index = next(i for i in range(2, 20) if free_run[i] not in free_run[:i] and i % 5 != 0)
    eos = free_run[index]
    expected, reason = plain_greedy(target, PROMPT, 20, eos_token_id=eos)
    assert expected == free_run[: index + 1] and reason == "eos"
    for draft in (target, tiny_model(seed=3)):
        result = speculative_generate(target, draft, PROMPT, 20, k=4, eos_token_id=eos)
        assert result.token_ids == expected and result.stats.stop_reason == "eos"


@pytest.mark.parametrize("position", ["learned", "rope", "alibi"])
def test_prompt_near_the_context_end(position):
    target = tiny_model(seed=0, position=position)
    draft = tiny_model(seed=0, position=position, n_layers=1)  # the target's first layer
    prompt = [(7 * i + 3) % 37 for i in range(44)]  # max_seq_len is 48
    expected, reason = plain_greedy(target, prompt, 30)
    assert reason == "context_full" and len(expected) == 48 - 44 + 1
    for candidate in (draft, target):
        result = speculative_generate(target, candidate, prompt, max_new_tokens=30, k=4)
        assert result.token_ids == expected
        assert result.stats.stop_reason == "context_full"


def test_draft_with_a_shorter_window_falls_back_to_plain_steps():
    target = tiny_model(seed=0)
    draft = tiny_model(seed=0, max_seq_len=12, position="learned")
    expected, _ = plain_greedy(target, PROMPT, 20)
    result = speculative_generate(target, draft, PROMPT, max_new_tokens=20, k=3)
    assert result.token_ids == expected
    # The draft proposes only while the context fits its 12 positions (len(context) <= 12,
    # growing by >= 1 a round from 7): at most 6 rounds of 3; the target then steps alone.
    assert 0 < result.stats.proposed <= 3 * (12 - len(PROMPT))
    assert result.stats.rounds == 19 - result.stats.accepted


def test_sliding_window_target_past_its_window():
    # Plain decoding uses the ring cache here; speculative decoding a full cache plus the mask.
    target = tiny_model(seed=0, sliding_window=8)
    expected, _ = plain_greedy(target, PROMPT, 30)
    for draft in (target, tiny_model(seed=4, sliding_window=4)):
        result = speculative_generate(target, draft, PROMPT, max_new_tokens=30, k=3)
        assert result.token_ids == expected


def test_bf16_draft_of_the_target():
    target = tiny_model(seed=0)
    draft = tiny_model(seed=0).to(torch.bfloat16)
    expected, _ = plain_greedy(target, PROMPT, 25)
    result = speculative_generate(target, draft, PROMPT, max_new_tokens=25, k=4)
    assert result.token_ids == expected
    assert result.stats.acceptance_rate > 0.5  # the same weights, rounded: mostly agrees


def test_refuses_a_draft_with_another_vocabulary():
    target = tiny_model(seed=0)
    draft = tiny_model(seed=1, vocab_size=40)
    with pytest.raises(ValueError, match=r"vocab_size=40 differs .* share one tokenizer"):
        speculative_generate(target, draft, PROMPT, max_new_tokens=5)


@pytest.mark.parametrize(
    "field", [{"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"logprobs": 2}]
)
def test_refuses_what_a_round_would_not_apply(field):
    """The draft proposes from plain logits: a penalty or logprobs would be silently dropped."""
    from glassformer.infer.speculative import SpeculativeDecoder

    model = tiny_model()
    (name,) = field
    with pytest.raises(ValueError, match=f"{name}=.* not supported with speculative decoding"):
        SpeculativeDecoder(model, model).add(PROMPT, SamplingParams(max_new_tokens=4, **field))


@pytest.mark.parametrize("k", [0, -1, 2.5, True])
def test_refuses_a_bad_k(k):
    model = tiny_model()
    with pytest.raises(ValueError, match=f"k={k!r} must be an integer >= 1"):
        speculative_generate(model, model, PROMPT, max_new_tokens=5, k=k)


def test_a_rollback_is_a_write_at_an_earlier_position():
    cache = KVCache(n_layers=1, batch_size=1, n_kv_heads=1, max_seq_len=8, head_dim=2)
    k = torch.arange(10.0).view(1, 1, 5, 2)
    cache.begin(torch.arange(5))
    cache.update(0, torch.arange(5), k, k)
    new, position = torch.full((1, 1, 1, 2), -1.0), torch.tensor([2])  # positions 2.. rejected
    cache.begin(position)
    keys, _ = cache.update(0, position, new, new)
    # The write lands at position 2 and the stale positions 3, 4 are not returned.
    assert torch.equal(keys, torch.cat([k[:, :, :2], new], dim=2))


# --- speculative sampling -------------------------------------------------------------------


def test_rejection_rule_reproduces_the_target_distribution():
    """One proposal x ~ q, then verify_sampled: the emitted first token must follow p.

    Chi-square goodness of fit over 4 tokens (3 degrees of freedom): 16.27 is the 0.1% critical
    value, so a correct rule fails this about once in a thousand seeds; a rule that skips the
    residual (emitting x unconditionally, i.e. q) scores in the hundreds."""
    p_logits = torch.tensor([[2.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # (K + 1, V)
    q = torch.tensor([[0.1, 0.6, 0.2, 0.1]])  # the draft's distribution (K, V)
    params = SamplingParams(temperature=1.0)
    p = sampling_distribution(p_logits, params)[0]
    generator = torch.Generator().manual_seed(0)
    n = 4000
    proposals = torch.multinomial(q[0], n, replacement=True, generator=generator).tolist()
    counts = torch.zeros(4)
    for x in proposals:
        counts[verify_sampled(p_logits, [x], q, params, generator)[0]] += 1
    chi_square = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi_square < 16.27


@pytest.mark.slow
def test_speculative_sampling_matches_the_target_joint_distribution():
    """The first three sampled tokens, over many seeds, against the target's exact joint
    distribution p(a) p(b | a) p(c | a, b) enumerated over a 4-token vocabulary (64 outcomes).
    The third token comes from a verification round, so both accepts and rejects matter."""
    shape = dict(vocab_size=4, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=16)
    target = tiny_model(seed=0, scale=3.0, **shape)
    draft = tiny_model(seed=5, scale=3.0, **shape)
    prompt = [1, 2]
    params = SamplingParams(temperature=1.0)
    exact = {}
    with torch.no_grad():
        for seq in itertools.product(range(4), repeat=3):
            ids = torch.tensor([prompt + list(seq)])
            probs = sampling_distribution(target(ids)[0], params)  # (T, V)
            exact[seq] = math.prod(float(probs[len(prompt) - 1 + i, t]) for i, t in enumerate(seq))
    n = 3000
    counts = dict.fromkeys(exact, 0)
    accepted = 0
    for seed in range(n):
        result = speculative_generate(
            target, draft, prompt, max_new_tokens=3, k=2, temperature=1.0, seed=seed
        )
        counts[tuple(result.token_ids)] += 1
        accepted += result.stats.accepted
    assert 0 < accepted < 2 * n  # both outcomes of the rejection rule were exercised
    # Pool outcomes expected fewer than 5 times into one bin, as chi-square requires.
    bins, rare_obs, rare_exp = [], 0, 0.0
    for seq, prob in exact.items():
        if n * prob >= 5:
            bins.append((counts[seq], n * prob))
        else:
            rare_obs, rare_exp = rare_obs + counts[seq], rare_exp + n * prob
    bins.append((rare_obs, rare_exp))
    chi_square = sum((obs - exp) ** 2 / exp for obs, exp in bins if exp > 0)
    dof = len(bins) - 1
    # Wilson-Hilferty: the 0.1% critical value of chi-square with dof degrees of freedom.
    z = 3.09
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi_square < critical


def test_sampling_with_the_target_as_draft_accepts_everything():
    # p == q: the rule accepts with probability min(1, p/q) = 1 (up to rounding).
    target = tiny_model(seed=0, scale=2.0)
    result = speculative_generate(
        target, target, PROMPT, max_new_tokens=16, k=3, temperature=0.8, top_k=10, seed=1
    )
    assert len(result.token_ids) == 16
    assert result.stats.acceptance_rate > 0.9
