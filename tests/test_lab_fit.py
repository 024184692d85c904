"""The lab's small training loop: it learns a copy task, stops on a non-finite loss, and its
batches and evaluation are what they say."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import GPT2, tiny_model

from glassformer.lab.fit import (
    Schedule,
    eval_loss,
    fit,
    random_windows,
    unigram_entropy,
    window_batches,
)

MODEL = dict(GPT2, vocab_size=8, n_layers=1, n_heads=2, max_seq_len=16, scale=1)


def test_fit_learns_a_constant_sequence() -> None:
    model = tiny_model(**MODEL)
    ids = torch.full((4, 8), 3)
    losses = fit(model, lambda step: {"input_ids": ids, "targets": ids}, Schedule(40, 1e-2))
    assert len(losses) == 40
    assert losses[0] > math.log(8) - 1 and losses[-1] < 0.05  # from ~uniform to certain


def test_fit_stops_at_a_non_finite_loss() -> None:
    model = tiny_model(**MODEL)
    with torch.no_grad():
        model.tok_emb.weight.fill_(float("nan"))
    ids = torch.zeros((1, 4), dtype=torch.long)
    losses = fit(model, lambda step: {"input_ids": ids, "targets": ids}, Schedule(10))
    assert len(losses) == 1 and math.isnan(losses[0])


def test_windows_are_shifted_slices_and_repeat_by_seed() -> None:
    ids = torch.arange(100)
    batch = random_windows(ids, 5, 10, torch.Generator().manual_seed(0))
    assert batch["input_ids"].shape == (5, 10)
    assert torch.equal(batch["targets"], batch["input_ids"] + 1)
    make = window_batches(ids, 5, 10, seed=1)
    assert torch.equal(make(3)["input_ids"], make(3)["input_ids"])
    assert not torch.equal(make(3)["input_ids"], make(4)["input_ids"])
    with pytest.raises(ValueError, match="window of 100"):
        random_windows(ids, 1, 100, torch.Generator())


def test_eval_loss_is_the_mean_cross_entropy() -> None:
    model = tiny_model(**MODEL)
    ids = torch.randint(0, 8, (200,), generator=torch.Generator().manual_seed(0))
    loss = eval_loss(model, ids, 12, 6, seed=2)
    windows = random_windows(ids, 6, 12, torch.Generator().manual_seed(2))
    logits = model(windows["input_ids"])
    logits = logits.logits if hasattr(logits, "logits") else logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 8), windows["targets"].reshape(-1))
    assert loss == pytest.approx(ref.item(), rel=1e-5)


def test_unigram_entropy_is_the_closed_form() -> None:
    assert unigram_entropy(torch.arange(8).repeat(5)) == pytest.approx(math.log(8))
    skewed = torch.tensor([0, 1, 1, 1, 5, 5, 5, 5])  # ids need not be contiguous
    p = (1 / 8, 3 / 8, 4 / 8)
    assert unigram_entropy(skewed) == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-12)
