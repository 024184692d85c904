"""The length-extrapolation and lost-in-the-middle experiments' pieces, against independent
references: the model's own mean loss, a model configured with YaRN or a raised RoPE base from
the start, closed-form entropies, a manual log-softmax sum without a cache, and the engine's
greedy generation."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import GPT2, tiny_model

from glassformer.infer.engine import Engine
from glassformer.lab.exp_length_extrapolation import (
    FACTORS,
    loss_per_position,
    losses_by_length,
    rope_scaling,
    smooth,
    with_scaling,
)
from glassformer.lab.exp_lost_in_the_middle import (
    Fact,
    build_context,
    filler_pieces,
    make_facts,
    prompt_parts,
    score_continuation,
)
from glassformer.models import build_model

MODEL = dict(GPT2, vocab_size=23, d_model=16, n_heads=2, max_seq_len=64, scale=1)


# --- length extrapolation -----------------------------------------------------------------------


def test_loss_per_position_matches_the_models_mean_loss() -> None:
    model = tiny_model(**MODEL)
    ids = torch.randint(0, 23, (5, 13), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    curve = loss_per_position(model, inputs, targets, chunk=2)  # chunks of 2, 2 and 1 windows
    assert curve.shape == (12,)
    with torch.no_grad():
        assert float(curve.mean()) == pytest.approx(model.loss(inputs, targets).ce_loss.item(),
                                                    rel=1e-5)  # fmt: skip
        logits = model(inputs)
    by_hand = -logits.log_softmax(-1).gather(2, targets[..., None])[..., 0].mean(0)  # (T,)
    torch.testing.assert_close(curve, by_hand)


@pytest.mark.parametrize("method", ["alibi", "rope + YaRN"])
def test_losses_by_length_are_the_mean_loss_of_each_cut(method: str) -> None:
    train_len = 4
    model = tiny_model(
        **MODEL | {"position": "alibi" if method == "alibi" else "rope", "max_seq_len": train_len}
    )
    ids = torch.randint(0, 23, (3, FACTORS[-1] * train_len + 1),
                        generator=torch.Generator().manual_seed(2))  # fmt: skip
    windows = {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}
    losses, curve = losses_by_length(model, method, windows, train_len)
    assert len(losses) == len(FACTORS) and curve.shape == (FACTORS[-1] * train_len,)
    for factor, loss in zip(FACTORS, losses, strict=True):
        n = factor * train_len
        reference = model
        if method == "rope + YaRN" and factor > 1:  # a model configured with YaRN from the start
            yarn = {"type": "yarn", "factor": float(factor), "original_max_seq_len": train_len}
            reference = build_model(dataclasses.replace(model.cfg, rope_scaling=yarn)).eval()
            reference.load_state_dict(model.state_dict())
        with torch.no_grad():
            expected = reference.loss(ids[:, :n], ids[:, 1 : n + 1]).ce_loss.item()
        assert loss == pytest.approx(expected, rel=1e-5)


def test_ntk_at_k_times_l_is_rope_with_the_base_raised_by_k_to_d_over_d_minus_2() -> None:
    model = tiny_model(**MODEL | {"position": "rope", "max_seq_len": 8})  # head_dim 8
    ntk = with_scaling(model, rope_scaling("rope + NTK", 4, train_len=8))
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(ntk.state_dict()[name], tensor)
    d = model.cfg.head_dim
    raised = build_model(dataclasses.replace(model.cfg, rope_theta=10000.0 * 4 ** (d / (d - 2))))
    raised.load_state_dict(model.state_dict())
    short = torch.randint(0, 23, (2, 8))
    long = torch.randint(0, 23, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ntk(short), model(short))  # nothing changes up to L
        torch.testing.assert_close(ntk(long), raised.eval()(long))  # NTK-aware base at 4L
        assert not torch.allclose(ntk(long), model(long))


def test_yarn_at_the_trained_length_is_plain_rope() -> None:
    model = tiny_model(**MODEL | {"position": "rope", "max_seq_len": 8})
    assert rope_scaling("rope + YaRN", 1, train_len=8) is None
    assert with_scaling(model, None) is model
    yarn = rope_scaling("rope + YaRN", 16, train_len=8)
    assert yarn == {"type": "yarn", "factor": 16.0, "original_max_seq_len": 8}
    assert rope_scaling("rope", 16, train_len=8) is None


def test_smooth_is_a_centered_moving_mean() -> None:
    curve = torch.tensor([0.0, 3.0, 6.0, 3.0, 0.0])
    torch.testing.assert_close(smooth(curve, 3), torch.tensor([1.5, 3.0, 4.0, 3.0, 1.5]))
    torch.testing.assert_close(smooth(torch.full((9,), 2.0), 4), torch.full((9,), 2.0))
    assert smooth(curve, 1) is curve


# --- lost in the middle -------------------------------------------------------------------------


def test_facts_sit_in_order_and_evenly_spaced() -> None:
    rng = random.Random(0)
    facts = make_facts(5, rng)
    assert len({f.name for f in facts}) == 5 and len({f.number for f in facts}) == 5
    fillers = ["x" * 100] * 4
    context, offsets = build_context(facts, fillers)
    for fact, offset in zip(facts, offsets, strict=True):
        assert context[offset:].startswith(fact.sentence)
        assert context.count(str(fact.number)) == 1
    assert offsets[0] == 0
    assert context.endswith(facts[-1].sentence)  # the last fact is the context's end
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert max(gaps) - min(gaps) <= 2  # names differ in length by a few characters
    with pytest.raises(ValueError, match="fillers"):
        build_context(facts, fillers[:2])


def test_filler_pieces_are_single_lines_of_whole_words() -> None:
    text = " ".join(f"word{i}\n" for i in range(2000))
    pieces = filler_pieces(text, 3, 120, random.Random(0))
    assert len(pieces) == 3
    for piece in pieces:
        assert "\n" not in piece and 80 <= len(piece) <= 170
        assert all(w in text.split() for w in piece.split())


class TemplateTokenizer:
    """A stand-in with a ChatML-like template."""

    def apply_chat_template(self, messages, add_generation_prompt: bool) -> str:
        text = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


def test_prompt_parts_share_everything_before_the_question() -> None:
    a, b = Fact("Alice", 1234), Fact("Bruno", 5678)
    context = f"{a.sentence} filler {b.sentence}"
    shared_a, query_a = prompt_parts(TemplateTokenizer(), context, a)
    shared_b, query_b = prompt_parts(TemplateTokenizer(), context, b)
    assert shared_a == shared_b and shared_a.endswith(b.sentence)
    assert query_a.startswith("\n\nQuestion: What is the secret number of Alice?")
    assert query_a.endswith("<|assistant|>\nThe secret number of Alice is")
    assert "5678" not in query_b and "1234" in shared_b


def test_scores_match_a_manual_log_softmax_and_greedy_generation() -> None:
    model = tiny_model(**MODEL | {"position": "rope"})
    prefix, query = [3, 5, 7, 11, 2, 4], [9, 1, 6]
    greedy = Engine(model).generate(prefix + query, max_new_tokens=3, temperature=0).token_ids
    other = [(greedy[0] + 1) % 23, *greedy[1:]]
    cache = model.new_cache(batch_size=1, max_seq_len=32)
    with torch.no_grad():
        model(torch.tensor([prefix]), torch.arange(len(prefix)), cache=cache)
    for answer, hit in ((greedy, True), (other, False)):  # the second written over the first
        logprob, greedy_hit = score_continuation(model, cache, len(prefix), query, answer)
        ids = torch.tensor([prefix + query + answer])
        with torch.no_grad():
            logprobs = F.log_softmax(model(ids)[0], dim=-1)  # no cache: the reference
        start = len(prefix) + len(query)
        by_hand = sum(float(logprobs[start - 1 + i, t]) for i, t in enumerate(answer))
        assert logprob == pytest.approx(by_hand, abs=1e-4)
        assert greedy_hit is hit
