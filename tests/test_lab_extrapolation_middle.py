"""The length-extrapolation and lost-in-the-middle experiments' pieces, against independent
references: hand-computed band means, the model's own mean loss, the unscaled model, a manual
log-softmax sum without a cache, and the engine's greedy generation."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from glassformer.config import ModelConfig
from glassformer.infer.engine import Engine
from glassformer.lab.exp_length_extrapolation import (
    band_means,
    loss_per_position,
    rope_scalings,
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


def tiny_gpt(position: str = "rope", max_seq_len: int = 64):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=2, max_seq_len=max_seq_len,
                      position=position)  # fmt: skip
    return build_model(cfg).eval()


# --- length extrapolation -----------------------------------------------------------------------


def test_band_means_by_hand() -> None:
    curve = torch.arange(16, dtype=torch.float32)  # L = 4, T = 4L
    bands = band_means(curve, 4)
    assert bands == {"[0, L)": 1.5, "[L, 2L)": 5.5, "[2L, 4L)": 11.5}


def test_loss_per_position_matches_the_models_mean_loss() -> None:
    model = tiny_gpt("learned")
    ids = torch.randint(0, 23, (3, 13), generator=torch.Generator().manual_seed(1))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    curve = loss_per_position(model, inputs, targets)
    assert curve.shape == (12,)
    with torch.no_grad():
        assert float(curve.mean()) == pytest.approx(model.loss(inputs, targets).ce_loss.item(),
                                                    rel=1e-5)  # fmt: skip
        logits = model(inputs)
    by_hand = -logits.log_softmax(-1).gather(2, targets[..., None])[..., 0].mean(0)  # (T,)
    torch.testing.assert_close(curve, by_hand)


def test_scaled_copy_has_the_same_weights_and_ntk_waits_for_long_inputs() -> None:
    model = tiny_gpt("rope", max_seq_len=8)
    scalings = rope_scalings(train_len=8, eval_len=32)
    ntk = with_scaling(model, scalings["rope + NTK (dynamic)"])
    yarn = with_scaling(model, scalings["rope + YaRN"])
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(ntk.state_dict()[name], tensor)
    short = torch.randint(0, 23, (2, 8))
    long = torch.randint(0, 23, (2, 32))
    with torch.no_grad():
        # dynamic NTK changes nothing up to the original length, everything past it
        torch.testing.assert_close(ntk(short), model(short))
        assert not torch.allclose(ntk(long), model(long))
        assert not torch.allclose(yarn(long), model(long))


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
    model = tiny_gpt("rope")
    prefix, query = [3, 5, 7, 11, 2, 4], [9, 1, 6]
    greedy = Engine(model).generate(prefix + query, max_new_tokens=3, temperature=0).token_ids
    other = [(greedy[0] + 1) % 23, *greedy[1:]]
    cache = model.new_cache(batch_size=1, max_seq_len=32)
    with torch.no_grad():
        model(torch.tensor([prefix]), cache=cache)
    for answer, hit in ((greedy, True), (other, False)):
        logprob, greedy_hit = score_continuation(model, cache, query, answer)
        assert cache.length == len(prefix)  # rolled back for the next question
        ids = torch.tensor([prefix + query + answer])
        with torch.no_grad():
            logprobs = F.log_softmax(model(ids)[0], dim=-1)  # no cache: the reference
        start = len(prefix) + len(query)
        by_hand = sum(float(logprobs[start - 1 + i, t]) for i, t in enumerate(answer))
        assert logprob == pytest.approx(by_hand, abs=1e-4)
        assert greedy_hit is hit
