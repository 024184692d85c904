"""The computing pieces of the re-marked lab experiments (chunking, lost-in-the-middle,
gpt-bag-of-words, no-position-permutation, gqa-cache, quadratic) against hand computations and
closed forms."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from conftest import GPT2, tiny_model

from glassformer.config import ModelConfig
from glassformer.lab.exp_chunking import lower_bound
from glassformer.lab.exp_gpt_bag_of_words import LENGTH, N_SYMBOLS, accuracy, first_symbol_batch
from glassformer.lab.exp_gqa_cache import filled_cache_bytes
from glassformer.lab.exp_lost_in_the_middle import paired_gap
from glassformer.lab.exp_no_position_permutation import permutation_gap
from glassformer.lab.exp_quadratic import N_HEADS, attention_seconds


def test_lower_bound_is_the_mean_minus_two_standard_errors() -> None:
    values = [0.5, 1.5, 2.0, 3.0]
    mean, se, low = lower_bound(torch.tensor(values))
    assert mean == pytest.approx(statistics.mean(values))
    assert se == pytest.approx(statistics.stdev(values) / 2)  # sqrt(4) chunks
    assert low == pytest.approx(mean - 2 * se)
    assert lower_bound(torch.tensor([0.7]))[1:] == pytest.approx((0.0, 0.7))


def test_paired_gap_by_hand() -> None:
    # differences 1, 0, 0, 1: mean 0.5, sample sd sqrt(1/3), SE sqrt(1/3) / 2
    mean, se = paired_gap([1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0])
    assert mean == pytest.approx(0.5)
    assert se == pytest.approx(math.sqrt(1 / 3) / 2)
    assert paired_gap([2.0], [0.5]) == (1.5, 0.0)


class _Pointer(torch.nn.Module):
    """A GPT-shaped oracle whose last-position logits point at the symbol at `index`."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.cfg = ModelConfig(vocab_size=N_SYMBOLS + 1, d_model=8, n_layers=1, n_heads=1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        chosen = ids[:, self.index]  # (B,)
        return (
            torch.nn.functional.one_hot(chosen, N_SYMBOLS + 1)
            .float()[:, None]
            .expand(-1, ids.shape[1], -1)
        )


def test_bag_of_words_accuracy_scores_the_first_symbol_only() -> None:
    batch = first_symbol_batch(50, torch.Generator().manual_seed(0))
    assert accuracy(_Pointer(0), batch) == 1.0
    assert accuracy(_Pointer(LENGTH - 1), batch) == 0.0  # distinct symbols: never the first


# for tiny_model: one GPT-2-style layer, eager attention (the permutation test reads its mask)
MODEL = dict(GPT2, vocab_size=12, d_model=16, n_layers=1, n_heads=2, max_seq_len=16,
             attention_backend="eager", scale=1)  # fmt: skip


def test_permutation_gap_is_zero_only_without_positions_and_mask() -> None:
    ids, order = [3, 1, 4, 1, 5], [4, 2, 0, 3, 1]
    bert, no_positions = {"family": "bert"}, {"position": "none"}
    assert permutation_gap(tiny_model(**MODEL | bert | no_positions), ids, order) < 1e-5
    assert permutation_gap(tiny_model(**MODEL | bert), ids, order) > 1e-3
    assert permutation_gap(tiny_model(**MODEL | no_positions), ids, order) > 1e-3  # the causal mask


def test_filled_cache_bytes_by_hand() -> None:
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=16)  # fmt: skip
    filled, per_token = filled_cache_bytes(cfg, 10, seed=0)
    head_dim = 32 // 4
    assert per_token == 2 * 2 * 2 * head_dim * 4  # K and V x layers x KV heads x D x fp32
    assert filled == 10 * per_token


def test_eager_weights_are_heads_by_t_by_t() -> None:
    seconds, weights_bytes = attention_seconds("eager", 24, repeats=1, seed=0)
    assert seconds > 0
    assert weights_bytes == N_HEADS * 24 * 24 * 4  # (1, H, T, T) float32
