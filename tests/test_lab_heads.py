"""The head experiments (claims 13, 14) and their shared char GPT: the cache round-trips through
safetensors and keys on the seed, ranking and evaluation windows never overlap, the pruning
evaluation is the plain loss with W_O's columns zeroed, the top share is a hand sum, and the
induction score, the held-out choice of a head and the copy losses are what a hand loop gives."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from glassformer.config import ModelConfig
from glassformer.inspect import capture
from glassformer.lab.base import RunContext
from glassformer.lab.char_gpt import cache_dir, recipe_for, trained
from glassformer.lab.exp_head_pruning import FixedEval, removal_curve, split_windows, top_share
from glassformer.lab.fit import random_windows
from glassformer.lab.induction import (
    chosen_head,
    copy_losses,
    induction_scores,
    repeated_random,
)
from glassformer.models import build_model


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=13, d_model=24, n_layers=2, n_heads=3, max_seq_len=32,
                      position="rope")  # fmt: skip
    return build_model(cfg).eval()


def test_char_gpt_is_cached_as_safetensors_and_reloaded(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GLASSFORMER_CACHE", str(tmp_path))
    ctx = RunContext(out_dir=tmp_path, tiny=True)
    recipe = recipe_for(ctx)
    first = trained(recipe, use_cache=True)
    files = list(cache_dir().glob("*.safetensors"))
    assert not first.cached and len(files) == 1 and files[0].parent == tmp_path / "lab"
    assert not list(cache_dir().glob("*.tmp"))  # the temporary file was renamed away
    second = trained(recipe, use_cache=True)
    assert second.cached and second.train_losses == pytest.approx(first.train_losses)
    for name, value in first.model.state_dict().items():
        torch.testing.assert_close(second.model.state_dict()[name], value, rtol=0, atol=0)
    other = trained(recipe_for(ctx, seed=1), use_cache=True)  # another seed: another file
    assert recipe_for(ctx, seed=1).seed == 1 and recipe_for(ctx).seed == ctx.seed
    assert not other.cached and len(list(cache_dir().glob("*.safetensors"))) == 2
    assert not torch.equal(other.model.state_dict()["blocks.0.attn.out_proj.weight"],
                           first.model.state_dict()["blocks.0.attn.out_proj.weight"])  # fmt: skip


def test_split_windows_never_share_a_character() -> None:
    ids = torch.arange(1000)  # each id is its own position
    ranking, evaluation = split_windows(ids, n=20, length=30, seed=3)
    seen_ranking = set(ranking["input_ids"].flatten().tolist())
    seen_ranking |= set(ranking["targets"].flatten().tolist())
    seen_eval = set(evaluation["input_ids"].flatten().tolist())
    seen_eval |= set(evaluation["targets"].flatten().tolist())
    assert max(seen_ranking) < 500 <= min(seen_eval)
    assert torch.equal(ranking["targets"][:, :-1], ranking["input_ids"][:, 1:])


def test_fixed_eval_is_the_loss_with_w_o_columns_zeroed() -> None:
    model = _gpt()
    val = torch.randint(0, 13, (300,), generator=torch.Generator().manual_seed(0))
    windows = random_windows(val, 3, 16, torch.Generator().manual_seed(5))
    evaluate = FixedEval(model, windows)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        assert evaluate([]) == pytest.approx(reference.loss(**windows).ce_loss.item(), rel=1e-6)
        reference.blocks[1].attn.out_proj.weight[:, 2 * 8 : 3 * 8] = 0.0  # head 2, D = 8
        expected = reference.loss(**windows).ce_loss.item()
    assert evaluate([(1, 2)]) == pytest.approx(expected, rel=1e-6)
    curve = removal_curve(evaluate, [(1, 2), (0, 0)])
    assert len(curve) == 3 and curve[0] == evaluate([]) and curve[1] == pytest.approx(expected)


def test_top_share_is_the_top_heads_part_of_the_positive_importance() -> None:
    importance = {(0, 0): 0.5, (0, 1): -0.2, (1, 0): 0.1, (1, 1): 0.4}
    ranked = [(0, 1), (1, 0), (1, 1), (0, 0)]  # least important first
    # positives 0.5 + 0.1 + 0.4 = 1.0 (the negative counts as 0); the top 2 carry 0.4 + 0.5
    assert top_share(ranked, importance, 2) == pytest.approx(0.9)
    # the ranking came from other windows: the top by ranking need not be the top here
    assert top_share([(0, 0), (1, 1), (0, 1), (1, 0)], importance, 1) == pytest.approx(0.1)


def test_repeated_random_repeats_common_characters() -> None:
    ids = repeated_random([3, 5, 7], n=4, length=6, seed=0)
    assert ids.shape == (4, 12)
    assert torch.equal(ids[:, :6], ids[:, 6:])
    assert set(ids.flatten().tolist()) <= {3, 5, 7}


def test_induction_score_matches_a_loop_over_positions() -> None:
    model = _gpt()
    length = 5
    ids = repeated_random(list(range(13)), n=2, length=length, seed=1)
    scores, loss = induction_scores(model, ids)
    with torch.no_grad(), capture(model, residual=False) as cap:
        logits = model(ids)
    assert scores.shape == (2, 2, 3)  # (B, L, H)
    for b in range(2):
        for layer in range(2):
            for head in range(3):
                weights = [cap.attention[layer][b, head, i, i - length + 1].item()
                           for i in range(length, 2 * length)]  # fmt: skip
                assert scores[b, layer, head].item() == pytest.approx(sum(weights) / len(weights))
    # the loss at position t is the cross-entropy of predicting token t + 1
    t = 7
    expected = F.cross_entropy(logits[1, t], ids[1, t + 1]).item()
    assert loss.shape == (2, 2 * length - 1) and loss[1, t].item() == pytest.approx(expected)


def test_chosen_head_is_picked_on_one_half_and_scored_on_the_other() -> None:
    scores = torch.zeros(4, 2, 3)  # (B, L, H)
    scores[:2, 1, 2] = 0.9  # best on the choosing half ...
    scores[2:, 1, 2] = 0.1  # ... weak on the measuring half
    scores[2:, 0, 0] = 0.8  # best on the measuring half only: never chosen
    head, held_out = chosen_head(scores)
    assert head == (1, 2) and held_out == pytest.approx(0.1)
    with pytest.raises(ValueError, match="at least 2 sequences"):
        chosen_head(torch.zeros(1, 2, 3))


def test_copy_losses_split_the_two_copies() -> None:
    length = 4  # positions 0..6 predict tokens 1..7; position 3 predicts x1 of the 2nd copy
    loss = torch.tensor([[1.0, 2.0, 3.0, 100.0, 0.5, 0.5, 0.2]])
    first, second = copy_losses(loss, length)
    assert first == pytest.approx(2.0) and second == pytest.approx(0.4)
