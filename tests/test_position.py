"""Positional encodings (seed 000 §4.3): sinusoids against the seed's loop, RoPE against Hugging
Face transformers and its relative-position property, ALiBi against the paper's slopes, and
"attention alone is order-blind" as a permutation test."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from glassformer.config import ModelConfig
from glassformer.models.gpt import GPT
from glassformer.nn.attention import AttentionMask
from glassformer.nn.block import Block
from glassformer.nn.position import (
    AbsolutePositions,
    RotaryEmbedding,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    dynamic_ntk_inv_freq,
    rope_inv_freq,
    sinusoidal_table,
)

# --- sinusoids --------------------------------------------------------------------------------


def _seed_pe(pos: int, d: int) -> list[float]:
    """seed 000 §4.3, `pe(pos, d)`, with Python floats."""
    v = [0.0] * d
    for k in range(0, d, 2):
        v[k] = math.sin(pos / 10000 ** (k / d))
        v[k + 1] = math.cos(pos / 10000 ** (k / d))
    return v


@pytest.mark.parametrize("d_model", [2, 16, 64])
def test_sinusoidal_table_equals_seed_closed_form(d_model: int) -> None:
    n_positions = 100
    expected = torch.tensor([_seed_pe(pos, d_model) for pos in range(n_positions)])
    torch.testing.assert_close(sinusoidal_table(n_positions, d_model), expected, atol=1e-6, rtol=0)


def test_sinusoidal_module_looks_up_the_closed_form() -> None:
    module = AbsolutePositions("sinusoidal", max_seq_len=32, d_model=8)
    position_ids = torch.tensor([[3, 0, 31], [7, 7, 1]])
    expected = torch.tensor([[_seed_pe(p, 8) for p in row] for row in position_ids.tolist()])
    torch.testing.assert_close(module(position_ids), expected, atol=1e-6, rtol=0)


# --- RoPE: relative positions ----------------------------------------------------------------

SCALINGS = {
    "default": None,
    "linear": {"type": "linear", "factor": 4.0},
    "dynamic": {"type": "dynamic", "factor": 4.0, "original_max_seq_len": 16},
    "yarn": {"type": "yarn", "factor": 8.0, "original_max_seq_len": 16},
    "llama3": {
        "type": "llama3",
        "factor": 8.0,
        "original_max_seq_len": 16,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
}


def _rope_cfg(scaling: dict | None, head_dim: int = 16, theta: float = 10000.0) -> ModelConfig:
    return ModelConfig(
        vocab_size=16,
        d_model=2 * head_dim,
        n_layers=1,
        n_heads=2,
        max_seq_len=64,
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
    )


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_rope_scores_depend_only_on_relative_distance(scaling: str) -> None:
    rope = RotaryEmbedding(_rope_cfg(SCALINGS[scaling]))
    q = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    # All positions in one call, so dynamic NTK picks one base (it depends on the longest).
    pairs = [(5, 2), (45, 42), (30, 27), (9, 9), (50, 50), (2, 12), (22, 32)]
    positions = torch.tensor([[p for pair in pairs for p in pair]])  # (1, 2 * n_pairs)
    cos, sin = rope(positions)
    cos, sin = cos.double(), sin.double()

    def score(i: int) -> float:
        qi = apply_rope(q, cos[..., 2 * i : 2 * i + 1, :], sin[..., 2 * i : 2 * i + 1, :])
        ki = apply_rope(k, cos[..., 2 * i + 1 : 2 * i + 2, :], sin[..., 2 * i + 1 : 2 * i + 2, :])
        return float((qi * ki).sum())

    scores = [score(i) for i in range(len(pairs))]
    # distance 3: pairs 0, 1, 2; distance 0: pairs 3, 4; distance -10: pairs 5, 6
    for a, b in [(0, 1), (0, 2), (3, 4), (5, 6)]:
        assert scores[a] == pytest.approx(scores[b], abs=1e-4), (pairs[a], pairs[b])
    assert abs(scores[0] - scores[3]) > 1e-3  # a different distance gives a different score


# --- RoPE against transformers ----------------------------------------------------------------

_HF_KEYS = {"type": "rope_type", "original_max_seq_len": "original_max_position_embeddings"}


def _hf_config(
    scaling: dict | None, head_dim: int, theta: float, max_positions: int
) -> LlamaConfig:
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        params = {_HF_KEYS.get(k, k): v for k, v in scaling.items()} | {"rope_theta": theta}
    return LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters=params,
    )


def _hf_inv_freq(config: LlamaConfig, **kwargs) -> tuple[torch.Tensor, float]:
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config, None, **kwargs)


STATIC_SCALINGS = {
    "default": None,
    "linear": {"type": "linear", "factor": 4.0},
    "llama3": {
        "type": "llama3",
        "factor": 8.0,
        "original_max_seq_len": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    "llama3_short": {
        "type": "llama3",
        "factor": 4.0,
        "original_max_seq_len": 64,
        "low_freq_factor": 2.0,
        "high_freq_factor": 8.0,
    },
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_seq_len": 4096},
    "yarn_mscale": {
        "type": "yarn",
        "factor": 40.0,
        "original_max_seq_len": 4096,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "yarn_mscale_unequal": {
        "type": "yarn",
        "factor": 16.0,
        "original_max_seq_len": 2048,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "yarn_attention_factor": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_seq_len": 1024,
        "attention_factor": 1.25,
    },
    "yarn_betas": {
        "type": "yarn",
        "factor": 8.0,
        "original_max_seq_len": 2048,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    },
    "yarn_no_truncate": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_seq_len": 4096,
        "truncate": False,
    },
}


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("scaling", list(STATIC_SCALINGS))
def test_rope_inv_freq_equals_transformers(scaling: str, head_dim: int, theta: float) -> None:
    params = STATIC_SCALINGS[scaling]
    max_seq_len = 16384
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, params, max_seq_len)
    if params is not None and params["type"] == "yarn":  # keep transformers' factor check quiet
        max_seq_len = int(params["original_max_seq_len"] * params["factor"])
    hf_inv_freq, hf_attention_factor = _hf_inv_freq(
        _hf_config(params, head_dim, theta, max_seq_len)
    )
    torch.testing.assert_close(inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(hf_attention_factor, rel=1e-12)


def test_yarn_attention_factor_closed_form() -> None:
    # 0.1 * ln(s) + 1 (YaRN paper, eq. 22) when no mscale is given
    _, factor = rope_inv_freq(64, 10000.0, {"type": "yarn", "factor": 16.0}, 4096)
    assert factor == pytest.approx(0.1 * math.log(16.0) + 1.0)
    # DeepSeek's mscale / mscale_all_dim ratio
    scaling = {"type": "yarn", "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 0.5}
    _, factor = rope_inv_freq(64, 10000.0, scaling, 4096)
    assert factor == pytest.approx((0.1 * math.log(16) + 1) / (0.05 * math.log(16) + 1))


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("seq_len", [64, 65, 100, 257, 1000])
def test_dynamic_ntk_inv_freq_equals_transformers(seq_len: int, head_dim: int) -> None:
    original_len, factor, theta = 64, 4.0, 10000.0
    ours = dynamic_ntk_inv_freq(head_dim, theta, factor, original_len, seq_len)
    # transformers' dynamic NTK treats max_position_embeddings as the trained length
    config = _hf_config({"type": "dynamic", "factor": factor}, head_dim, theta, original_len)
    hf, hf_attention_factor = _hf_inv_freq(config, seq_len=seq_len)
    torch.testing.assert_close(ours, hf.float(), rtol=1e-6, atol=0)
    assert hf_attention_factor == 1.0


@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_rotary_cos_sin_equal_transformers(scaling: str) -> None:
    """The whole module, including dynamic NTK recomputing its base past the trained length."""
    params = SCALINGS[scaling]
    head_dim, theta = 16, 10000.0
    ours = RotaryEmbedding(_rope_cfg(params, head_dim, theta))
    # dynamic: transformers reads the trained length from max_position_embeddings
    hf_max = {"dynamic": 16, "yarn": 128}.get(scaling, 64)
    hf = LlamaRotaryEmbedding(_hf_config(params, head_dim, theta, hf_max))
    for length in (8, 40):
        position_ids = torch.arange(length)[None].expand(2, length)
        cos, sin = ours(position_ids)
        hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), position_ids)
        torch.testing.assert_close(cos[:, 0], hf_cos, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sin[:, 0], hf_sin, atol=1e-5, rtol=1e-5)


def _rotate_pairs_by_hand(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + D/2) pair by its angle with an explicit 2x2 rotation."""
    out = x.clone()
    half = x.shape[-1] // 2
    for i in range(half):
        c, s = angles[..., i].cos(), angles[..., i].sin()
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * c - b * s
        out[..., i + half] = a * s + b * c
    return out


def test_apply_rope_equals_transformers_and_hand_rotation() -> None:
    B, H, T, D = 2, 3, 7, 16
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    k = torch.randn(B, H, T, D, dtype=torch.float64)
    position_ids = torch.tensor([list(range(T)), [4, 9, 0, 2, 30, 31, 100]])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = position_ids[..., None].double() * inv_freq  # (B, T, D/2)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()  # (B, T, D)

    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours_q = apply_rope(q, cos[:, None], sin[:, None])
    ours_k = apply_rope(k, cos[:, None], sin[:, None])
    torch.testing.assert_close(ours_q, hf_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_k, hf_k, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_q, _rotate_pairs_by_hand(q, angles[:, None]), atol=1e-6, rtol=0)


# --- ALiBi ------------------------------------------------------------------------------------


def _press_get_slopes(n: int) -> list[float]:
    """get_slopes from the ALiBi authors' repository (ofirpress/attention_with_linear_biases)."""

    def get_slopes_power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (
        get_slopes_power_of_2(closest_power_of_2)
        + _press_get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2]
    )


def test_alibi_slopes_for_8_heads_are_powers_of_one_half() -> None:
    expected = torch.tensor([2.0 ** -(i + 1) for i in range(8)])
    torch.testing.assert_close(alibi_slopes(8), expected, atol=0, rtol=1e-6)


@pytest.mark.parametrize("n_heads", [1, 2, 4, 6, 12, 16, 20, 24])
def test_alibi_slopes_equal_reference_algorithm(n_heads: int) -> None:
    expected = torch.tensor(_press_get_slopes(n_heads))
    torch.testing.assert_close(alibi_slopes(n_heads), expected, atol=0, rtol=1e-6)


def test_alibi_slopes_known_values_for_6_and_12_heads() -> None:
    # 6 heads: the 4-head slopes (1/4 .. 1/256) then every other 8-head slope (1/2, 1/8)
    torch.testing.assert_close(
        alibi_slopes(6), torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8])
    )
    # 12 heads: the 8-head slopes, then every other 16-head slope 2^-0.5, 2^-1.5, ...
    twelve = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(k + 0.5) for k in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(twelve))


def test_alibi_bias_is_minus_slope_times_distance() -> None:
    H, T = 4, 6
    slopes = alibi_slopes(H)
    positions = torch.arange(T)[None]
    bias = alibi_bias(slopes, positions, positions)  # (1, H, T, T)
    for h in range(H):
        for i in range(T):
            for j in range(i + 1):
                assert float(bias[0, h, i, j]) == pytest.approx(-float(slopes[h]) * (i - j))


def test_gpt_alibi_mask_carries_the_bias() -> None:
    cfg = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=4, position="alibi")
    model = GPT(cfg)
    slopes = _press_get_slopes(4)
    # a decode step: 2 new queries after 3 cached keys, masked as the model masks them
    cache = model.new_cache(max_seq_len=8)
    positions = torch.tensor([3, 4])
    mask = model._attention_mask(positions, cache.begin(positions), None, None)
    for h in range(4):
        for i, qi in enumerate((3, 4)):
            for j in range(qi + 1):
                assert float(mask.bias[0, h, i, j]) == pytest.approx(-slopes[h] * (qi - j))


# --- order: attention alone is permutation-equivariant ---------------------------------------

KINDS = ["none", "learned", "sinusoidal", "rope", "alibi"]


def _block_stack_output(
    kind: str, cfg: ModelConfig, blocks: list[Block], x: torch.Tensor, extra: dict
) -> torch.Tensor:
    """A bidirectional Block stack with positions of the given kind for positions 0..T-1."""
    T = x.shape[1]
    positions = torch.arange(T)[None]
    rope, bias = None, None
    if kind in ("learned", "sinusoidal"):
        x = x + extra["table"](positions)
    elif kind == "rope":
        rope = extra["rope"](positions)
    elif kind == "alibi":
        bias = alibi_bias(alibi_slopes(cfg.n_heads), positions, positions)
    mask = AttentionMask(bias=bias)  # every query sees every key
    for block in blocks:
        x = block(x, mask, rope)
    return x


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", KINDS)
def test_permuting_tokens_permutes_outputs_only_without_positions(kind: str, backend: str) -> None:
    cfg = ModelConfig(
        family="bert",
        vocab_size=16,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=16,
        position=kind,
        attention_backend=backend,
    )
    blocks = [Block(cfg, i).eval() for i in range(cfg.n_layers)]
    extra: dict = {}
    if kind in ("learned", "sinusoidal"):
        extra["table"] = AbsolutePositions(kind, cfg.max_seq_len, cfg.d_model)
        if kind == "learned":
            torch.nn.init.normal_(extra["table"].weight, std=1.0)
    if kind == "rope":
        extra["rope"] = RotaryEmbedding(cfg)
    x = torch.randn(1, 9, cfg.d_model)
    perm = torch.randperm(9)
    while bool((perm == torch.arange(9)).all()):
        perm = torch.randperm(9)
    with torch.no_grad():
        out = _block_stack_output(kind, cfg, blocks, x, extra)
        out_of_permuted = _block_stack_output(kind, cfg, blocks, x[:, perm], extra)
    if kind == "none":
        torch.testing.assert_close(out_of_permuted, out[:, perm], atol=1e-5, rtol=0)
    else:
        assert (out_of_permuted - out[:, perm]).abs().max() > 1e-3
