"""The lab's claims 21-26 (context lengths, activation memory, head split, position geometry,
RMSNorm cost, prefill vs decode): each experiment's computing pieces against an independent
reference: a hand count, a closed form, torch's own op, or calc's term-by-term formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from glassformer import calc
from glassformer.config import ModelConfig
from glassformer.lab.exp_activation_memory import doubled, measure, saved_bytes
from glassformer.lab.exp_context_lengths import Source, documented_checkpoint, in_seed_range
from glassformer.lab.exp_head_split_cost import attention_layer, closed_form_flops
from glassformer.lab.exp_head_split_cost import counted_flops as attention_flops
from glassformer.lab.exp_position_geometry import (
    decay_numbers,
    fit_shift_map,
    rope_scores,
    rotation,
)
from glassformer.lab.exp_prefill_decode import counted_flops, first_token_seconds
from glassformer.lab.exp_rmsnorm_cost import (
    count_ops,
    layer_norm_written,
    rms_norm_written,
)
from glassformer.nn.position import sinusoidal_table

# --- 21 context-lengths -------------------------------------------------------------------------


def test_documented_checkpoint_reads_the_bracketed_name() -> None:
    class Documented:
        """Builds a config like [org-x/model.v2] does; see [another/one]."""

    class Silent:
        pass

    assert documented_checkpoint(Documented) == "org-x/model.v2"
    assert documented_checkpoint(Silent) == "?"


@pytest.mark.parametrize(
    ("model", "positions", "inside"),
    [("BERT", 512, True), ("BERT", 513, False), ("Llama", 4096, True), ("Llama", 8192, True),
     ("Llama", 2048, False), ("Llama", 16384, False)],
)  # fmt: skip
def test_seed_range_includes_both_ends(model: str, positions: int, inside: bool) -> None:
    assert in_seed_range(Source(model, "test", positions)) is inside


# --- 22 activation-memory -----------------------------------------------------------------------


def test_saved_bytes_is_the_hand_count_without_weights() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(8, 16))
    # mm saves x (for the weight's gradient) and the weight (left out); tanh saves its output;
    # sum saves only a shape.
    got, storages = saved_bytes(lambda: (x @ weight).tanh().sum(), [weight])
    assert got == (4 * 8 + 4 * 16) * 4
    assert storages == 2


def test_a_tensor_saved_twice_counts_once() -> None:
    x = torch.randn(5, 7, requires_grad=True)
    got, _ = saved_bytes(lambda: (x * x).sum(), [])  # mul saves x as both operands
    assert got == 5 * 7 * 4


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_measured_activations_match_calc_memory(backend: str) -> None:
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, max_seq_len=32,
                      attention_backend=backend)  # fmt: skip
    point = measure(cfg, batch=2, seq_len=16, seed=0)
    assert point["bytes"] == pytest.approx(point["calc"], rel=0.05)


def test_doubling_width_keeps_the_head_size() -> None:
    base = ModelConfig(d_model=64, n_heads=2, n_layers=1, vocab_size=16, max_seq_len=16)
    wide, batch, seq_len = doubled(base, 3, 8, "width d")
    assert (wide.d_model, wide.n_heads, wide.head_dim, batch, seq_len) == (128, 4, 32, 3, 8)
    deep, _, _ = doubled(base, 3, 8, "layers")
    assert deep.n_layers == 2 and deep.d_model == 64
    assert doubled(base, 3, 8, "batch B")[1:] == (6, 8)
    assert doubled(base, 3, 8, "length T")[1:] == (3, 16)


# --- 23 head-split-cost -------------------------------------------------------------------------


@pytest.mark.parametrize("n_heads", [1, 8])
def test_counted_attention_flops_are_the_closed_form(n_heads: int) -> None:
    seq_len = 24
    x = torch.randn(1, seq_len, 512)
    counted = attention_flops(attention_layer(n_heads, "eager", seed=0), x)
    # by hand: 4 projections of 512 x 512 over 24 tokens, QK^T and AV over the 24 x 24 square
    by_hand = 4 * 2 * seq_len * 512 * 512 + 2 * 2 * seq_len * seq_len * 512
    assert counted == by_hand == closed_form_flops(seq_len)


# --- 24 position-geometry -----------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 7, 300])
def test_rotation_moves_the_table_by_k_positions(k: int) -> None:
    table = sinusoidal_table(1000, 64).double()
    shifted = table[:500] @ rotation(k)
    torch.testing.assert_close(shifted, table[k : 500 + k], atol=1e-6, rtol=0)


def test_fit_recovers_the_rotation_and_fails_on_noise() -> None:
    table = sinusoidal_table(70000, 64)
    order = torch.randperm(65536, generator=torch.Generator().manual_seed(0))
    fit, test = order[:256], order[256:512]
    m, residual, _ = fit_shift_map(table, 5, fit, test)
    assert residual < 1e-5
    torch.testing.assert_close(m, rotation(5), atol=1e-4, rtol=0)
    noise = torch.randn(70000, 64, generator=torch.Generator().manual_seed(1))
    assert fit_shift_map(noise, 5, fit, test)[1] > 0.5


def test_rope_score_of_all_ones_is_a_sum_of_cosines() -> None:
    distances = torch.arange(0, 200, 7)
    ones = torch.ones(1, 64)
    got = rope_scores(ones, ones, distances)[0]
    # each (i, i + 32) pair of all-ones vectors contributes 2 cos(Δ ω_i), ω_i = 10000^(-2i/64)
    want = [sum(2 * math.cos(int(d) * 10000 ** (-2 * i / 64)) for i in range(32))
            for d in distances]  # fmt: skip
    torch.testing.assert_close(got, torch.tensor(want), atol=1e-3, rtol=1e-4)


def test_decay_numbers_count_rises_and_the_far_ratio() -> None:
    assert decay_numbers([8.0, 4.0, 5.0, 2.0]) == (1, 0.25)
    assert decay_numbers([1.0, 1.0, 1.0]) == (0, 1.0)


# --- 25 rmsnorm-cost ----------------------------------------------------------------------------


def test_written_norms_match_torch() -> None:
    x = torch.randn(6, 48)
    weight, bias = torch.rand(48) + 0.5, torch.randn(48)
    torch.testing.assert_close(
        layer_norm_written(x, weight, bias), F.layer_norm(x, (48,), weight, bias, 1e-5)
    )
    torch.testing.assert_close(rms_norm_written(x, weight), F.rms_norm(x, (48,), weight, 1e-5))


def test_op_counter_counts_reductions_by_hand() -> None:
    ops = count_ops(lambda x: x.mean(-1) + x.sum(-1) * 2, torch.randn(3, 4))
    assert ops["mean"] == 1 and ops["sum"] == 1 and ops["mul"] == 1 and ops["add"] == 1


# --- 26 prefill-decode --------------------------------------------------------------------------


# 6 query heads sharing tiny_model's 2 key/value heads
GQA_MODEL = dict(vocab_size=64, d_model=48, n_heads=6, max_seq_len=64, scale=1)


def test_counted_prefill_and_decode_flops_match_calc_cost() -> None:
    model = tiny_model(**GQA_MODEL)
    ids = torch.randint(0, 64, (1, 20))
    cache = model.new_cache(batch_size=1, max_seq_len=32)
    assert counted_flops(model, ids, cache, 0) == calc.prefill_flops(model.cfg, 20)
    assert counted_flops(model, ids[:, -1:], cache, 20) == calc.decode_flops(model.cfg, 20, 1)


def test_first_token_seconds_are_positive_and_generate_one_token() -> None:
    from glassformer.infer.engine import Engine

    engine = Engine(tiny_model(**GQA_MODEL), max_rows=1, max_seq_len=32)
    cpu, wall = first_token_seconds(engine, list(range(10)), repeats=2)
    assert cpu > 0 and wall > 0
    assert not engine.rows  # the row left its slot: the next prompt reuses it
