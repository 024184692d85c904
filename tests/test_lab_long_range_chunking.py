"""Claims 5 (long-range) and 18 (chunking) of the lab: the delayed-recall task, the packed-vs-
separate equality on a tiny random GPT, and which window scores which token, against hand
computations."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from glassformer.data.batching import get_batch, make_lm_examples
from glassformer.data.chunking import pack
from glassformer.lab.exp_chunking import (
    packed_differences,
    scoring_starts,
    token_losses,
    window_losses,
)
from glassformer.lab.exp_long_range import (
    IGNORE_INDEX,
    recall_accuracy,
    recall_batch,
    recall_batches,
)

# --- long-range: the delayed-recall task ---------------------------------------------------


def test_recall_targets_are_the_inputs_d_back() -> None:
    batch = recall_batch(3, 10, 4, torch.Generator().manual_seed(0))
    x, y = batch["input_ids"], batch["targets"]
    assert x.shape == y.shape == (3, 10)
    assert (y[:, :4] == IGNORE_INDEX).all()
    for t in range(4, 10):
        assert torch.equal(y[:, t], x[:, t - 4])


def test_recall_batches_are_a_function_of_the_step() -> None:
    batch = recall_batches(2, 8, 3, seed=1)
    assert torch.equal(batch(5)["input_ids"], batch(5)["input_ids"])
    assert not torch.equal(batch(5)["input_ids"], batch(6)["input_ids"])


def test_recall_batch_rejects_a_delay_outside_the_sequence() -> None:
    with pytest.raises(ValueError, match="delay=8"):
        recall_batch(1, 8, 8, torch.Generator())


class _Oracle(torch.nn.Module):
    """Predicts the input `delay` back (right where scored), or symbol 0 (wrong elsewhere)."""

    def __init__(self, delay: int, vocab: int = 16) -> None:
        super().__init__()
        self.delay, self.vocab = delay, vocab

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        shifted = torch.zeros_like(input_ids)
        shifted[:, self.delay :] = input_ids[:, : -self.delay]
        return torch.nn.functional.one_hot(shifted, self.vocab).float()


def test_recall_accuracy_counts_only_scored_positions() -> None:
    batch = recall_batch(4, 12, 3, torch.Generator().manual_seed(2))
    assert recall_accuracy(_Oracle(3), batch) == 1.0
    # a model one position off is right only by coincidence (inputs repeating at t-3 and t-2)
    x = batch["input_ids"]
    coincidences = (x[:, 1:-2] == x[:, :-3]).float().mean().item()
    assert recall_accuracy(_Oracle(2), batch) == pytest.approx(coincidences)


# --- chunking: which window scores which target ----------------------------------------------


def test_truncation_scores_each_target_in_its_own_chunk() -> None:
    # 9 tokens, chunks of 4 targets: windows start at 0 and 4 (tokens 0..4 and 4..8)
    assert scoring_starts(9, 4, 4) == [0, 0, 0, 0, 4, 4, 4, 4]


def test_sliding_scores_each_target_with_the_most_context() -> None:
    # 11 tokens, windows of 4 targets with stride 2 start at 0, 2, 4, 6; target t goes to the
    # earliest window holding it (s < t <= s + 4): context t - s is 3 or 4 after the first window
    owners = scoring_starts(11, 4, 2)
    assert owners == [0, 0, 0, 0, 2, 2, 4, 4, 6, 6]
    context = [t - s for t, s in enumerate(owners, start=1)]
    assert context == [1, 2, 3, 4, 3, 4, 3, 4, 3, 4]


def test_token_losses_read_the_owning_window() -> None:
    losses = {0: torch.tensor([10.0, 11.0, 12.0]), 2: torch.tensor([20.0, 21.0, 22.0])}
    # target t from window s is entry t - s - 1
    assert token_losses([0, 0, 0, 2, 2], losses).tolist() == [10, 11, 12, 21, 22]


MODEL = dict(vocab_size=32, n_kv_heads=None, max_seq_len=64, scale=1)


def test_window_losses_match_a_manual_cross_entropy() -> None:
    model = tiny_model(**MODEL)
    ids = torch.randint(0, 32, (20,), generator=torch.Generator().manual_seed(1))
    losses = window_losses(model, ids, [0, 5, 5, 11], max_len=8, batch=2)
    assert sorted(losses) == [0, 5, 11]
    with torch.no_grad():
        logits = model(ids[None, 5:13])[0]  # (8, V)
    expected = -logits.log_softmax(-1)[torch.arange(8), ids[6:14]]
    torch.testing.assert_close(losses[5], expected, atol=1e-5, rtol=1e-5)


# --- chunking: packed with a document mask == separate ---------------------------------------


def test_packed_with_mask_equals_separate_on_a_tiny_gpt() -> None:
    model = tiny_model(**MODEL)
    generator = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 32, (n,), generator=generator).tolist() for n in (5, 9, 7)]
    lengths, with_mask, without_mask = packed_differences(model, docs, max_len=24)
    assert lengths == [5, 9, 7]
    assert max(with_mask) < 1e-5
    assert without_mask[0] < 1e-5  # the first document has nothing before it
    assert min(without_mask[1:]) > 1e-3  # the later ones read the earlier ones


def test_packed_differences_match_an_independent_batch_from_batching() -> None:
    # the packed row as data.batching builds it for training: same logits on each document
    model = tiny_model(**MODEL)
    generator = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, 32, (n,), generator=generator).tolist() for n in (6, 4)]
    examples = make_lm_examples(docs, block_size=11, chunking="pack")
    batch = get_batch(examples, torch.tensor([0]))
    with torch.no_grad():
        packed = model(batch["input_ids"], document_ids=batch["document_ids"],
                       position_ids=batch["position_ids"])[0]  # fmt: skip
        second = model(torch.tensor([docs[1]]))[0]
    block = pack(docs, 12)[0]
    assert block.document_ids[:10] == [0] * 6 + [1] * 4
    torch.testing.assert_close(packed[6:10], second, atol=1e-5, rtol=1e-5)
