"""A pure-numpy GPT forward, checked against the torch one, and seed 002's worked example.

Every step of the decoder is written out with numpy arrays: the six attention steps (seed 000
§3.3), heads and GQA/MQA (§4.1-4.2), positions (§4.3), FFN and MoE (§5.1, §2.5.3), residuals
and norms (§5.2-5.4). Nothing here imports glassformer's torch modules: only the config is
shared, so a bug in glassformer/nn shows up as a difference in the tests.

Shapes: B batch, T time, C channels (d_model), H query heads, Hkv key/value heads, D head dim,
F FFN width, E experts, V vocab.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from glassformer.config import ModelConfig

if TYPE_CHECKING:
    from torch import nn

# --- the six steps of attention (seed 000 §3.3; seed 002 "20 行 numpy") -------------------------


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x) / sum(exp(x)) along `axis`; subtracting the max first keeps exp from overflowing
    and changes nothing (it cancels in the ratio). -inf entries get weight 0."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


class AttentionResult(NamedTuple):
    output: np.ndarray  # (..., Tq, D) the weighted sum of values
    weights: np.ndarray  # (..., Tq, Tk) each row sums to 1
    scores: np.ndarray  # (..., Tq, Tk) scaled scores (+ bias) before the mask and softmax


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    bias: np.ndarray | None = None,
    scale: float | None = None,
) -> AttentionResult:
    """softmax(q k^T / sqrt(D) + bias, masked) v for q (..., Tq, D), k and v (..., Tk, D).

    mask: bool, broadcastable to (..., Tq, Tk), True where the query may look at the key.
    bias: added to the scores before the mask (ALiBi's distance penalty).
    scale: defaults to 1/sqrt(D), the √d_k of §3.3 that keeps the softmax out of saturation.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ np.swapaxes(k, -1, -2)) * scale  # (..., Tq, Tk)  ③ score and scale
    if bias is not None:
        scores = scores + bias
    masked = scores if mask is None else np.where(mask, scores, -np.inf)  # ④ the future = -inf
    weights = softmax(masked, axis=-1)  # ④ every row sums to 1
    output = weights @ v  # (..., Tq, D)  ⑤ weighted sum of the values
    return AttentionResult(output, weights, scores)


def worked_example_vectors() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seed 002's made-up d=4 vectors: the Query of "它" (it), and the Keys and Values of "猫"
    (cat), "累" (tired) and "它"."""
    q_it = np.array([1.0, 0.5, 0.2, 0.8])  # "它" 的 Query
    K = np.array(
        [
            [1.1, 0.4, 0.3, 0.9],  # "猫" 的 Key: deliberately close to q_it
            [0.1, 0.9, 0.1, 0.0],  # "累" 的 Key
            [0.3, 0.2, 0.6, 0.3],  # "它" 的 Key
        ]
    )
    V = np.array(
        [
            [10.0, 0.0, 0.0, 0.0],  # "猫" 的 Value (round numbers, easy to spot in the output)
            [0.0, 10.0, 0.0, 0.0],  # "累" 的 Value
            [0.0, 0.0, 10.0, 0.0],  # "它" 的 Value
        ]
    )
    return q_it, K, V


def worked_example() -> AttentionResult:
    """Seed 002's hand-sized attention: how much "它" (it) attends to "猫" (cat), "累" (tired)
    and itself, with d=4 vectors the tutorial made up. The tutorial prints
    weights ≈ [0.503 0.237 0.260] and output ≈ [5.03 2.37 2.6 0.]."""
    q_it, K, V = worked_example_vectors()
    result = attention(q_it[None], K, V)  # one query: (1, 4) against (3, 4)
    return AttentionResult(result.output[0], result.weights[0], result.scores[0])


# --- parts: linear, norms, activations, FFN, MoE (seed 000 §5.1-5.3, §2.5.3) --------------------


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x W^T + b, with W stored (out, in) as torch.nn.Linear stores it."""
    y = x @ weight.T
    return y if bias is None else y + bias


def layer_norm(x: np.ndarray, gain: np.ndarray, shift: np.ndarray | None, eps: float) -> np.ndarray:
    """Center and scale each token's vector (mean 0, variance 1), then γ and β (§5.3)."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)  # biased variance, as the paper
    y = (x - mean) / np.sqrt(var + eps) * gain
    return y if shift is None else y + shift


def rms_norm(x: np.ndarray, gain: np.ndarray, eps: float) -> np.ndarray:
    """Llama's RMSNorm: no centering, no shift, only x / rms(x) and a gain (§5.3)."""
    return x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps) * gain


_erf = np.vectorize(math.erf, otypes=[np.float64])  # numpy has no erf; math's is exact


def gelu(x: np.ndarray) -> np.ndarray:
    """x * Φ(x), Φ the standard normal CDF, with the exact erf."""
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(x.dtype)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GPT-2's tanh approximation of GELU."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x) (also called swish)."""
    return x / (1.0 + np.exp(-x))


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0)


# Gated FFNs name the activation of their gate: SwiGLU = SiLU gate, GeGLU = GELU gate.
ACTIVATIONS = {
    "relu": relu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "silu": silu,
    "swiglu": silu,
    "geglu": gelu,
    "geglu_tanh": gelu_tanh,
}
GATED = ("swiglu", "geglu", "geglu_tanh")


def dense_ffn(x: np.ndarray, w: dict[str, np.ndarray], prefix: str, kind: str) -> np.ndarray:
    """One position-wise FFN (§5.1): widen, nonlinearity, narrow back. (..., C) -> (..., C).

    Gated kinds fuse gate and up in one (2F, C) matrix `gate_up`: rows [0, F) are the gate,
    rows [F, 2F) the up projection."""
    act = ACTIVATIONS[kind]
    if kind in GATED:
        gate_up = linear(x, w[prefix + "gate_up.weight"], w.get(prefix + "gate_up.bias"))
        gate, up = np.split(gate_up, 2, axis=-1)  # (..., F) each
        return linear(act(gate) * up, w[prefix + "down.weight"], w.get(prefix + "down.bias"))
    hidden = act(linear(x, w[prefix + "fc_in.weight"], w.get(prefix + "fc_in.bias")))
    return linear(hidden, w[prefix + "fc_out.weight"], w.get(prefix + "fc_out.bias"))


def moe_ffn(x: np.ndarray, w: dict[str, np.ndarray], prefix: str, cfg: ModelConfig) -> np.ndarray:
    """Mixture of Experts (seed 000 §2.5.3): a router picks k of E expert FFNs per token.

    As glassformer.nn.ffn.MoE: router softmax over all E experts (no router bias), keep the k
    largest probabilities, renormalize them to sum to 1 (so with k=1 the chosen expert's output
    is used unscaled), output = sum of the k experts' outputs times those weights. Written
    densely here: every expert runs on every token and unchosen experts get gate 0."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # (N, C), N = B*T tokens
    probs = softmax(linear(x, w[prefix + "router.weight"]), axis=-1)  # (N, E)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, : cfg.n_experts_per_token]  # (N, k)
    top_probs = np.take_along_axis(probs, top, axis=-1)  # (N, k)
    gates = np.zeros_like(probs)  # (N, E), zero for experts a token does not use
    np.put_along_axis(gates, top, top_probs / top_probs.sum(axis=-1, keepdims=True), axis=-1)
    out = np.zeros_like(x)
    for e in range(cfg.n_experts):
        expert = dense_ffn(x, w, f"{prefix}experts.{e}.", cfg.moe_expert_ffn)  # (N, C)
        out = out + gates[:, e : e + 1] * expert
    return out.reshape(shape)


# --- positions (seed 000 §4.3) -----------------------------------------------------------------


def sinusoidal_table(n_positions: int, d_model: int) -> np.ndarray:
    """The paper's PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same): (T, C)."""
    pos = np.arange(n_positions, dtype=np.float64)[:, None]  # (T, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None]  # (1, C/2)
    angle = pos / 10000.0 ** (two_i / d_model)  # (T, C/2)
    table = np.zeros((n_positions, d_model))
    table[:, 0::2], table[:, 1::2] = np.sin(angle), np.cos(angle)
    return table


def rope_frequencies(cfg: ModelConfig, seq_len: int) -> tuple[np.ndarray, float]:
    """The rotation speed of each of the D/2 pairs, and the factor cos/sin are multiplied by.

    Unscaled RoPE (RoFormer): pair i turns by theta^(-2i/D) radians per position. The scalings
    stretch the slow pairs so a model trained on L = original_max_seq_len positions reads
    longer inputs; they are config-to-number formulas (the Hugging Face rope_type definitions),
    written here from their descriptions:
      linear  (position interpolation): every frequency / factor.
      dynamic (NTK-aware): once seq_len > L, a larger base
              theta * (factor * seq_len / L - (factor - 1)) ^ (D / (D - 2)).
      llama3: pairs whose wavelength 2π/f is longer than L / low_freq_factor are divided by
              factor, shorter than L / high_freq_factor kept, the band between blended
              linearly in L / wavelength.
      yarn:   a ramp over pair index between the pairs that make beta_fast and beta_slow turns
              within L: fast pairs extrapolate (kept), slow ones interpolate (/ factor); plus an
              attention factor 0.1 ln(factor) + 1 (or its mscale ratio) on cos and sin.
    """
    D, theta = cfg.head_dim, cfg.rope_theta
    pair = np.arange(D // 2, dtype=np.float64)  # (D/2,)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("type")
    factor = float(scaling.get("factor", 1.0))
    L = int(scaling.get("original_max_seq_len", cfg.max_seq_len))
    if kind == "dynamic" and seq_len > L:
        theta = theta * (factor * seq_len / L - (factor - 1)) ** (D / (D - 2))
    freq = theta ** (-2 * pair / D)  # (D/2,) radians per position
    if kind == "linear":
        return freq / factor, 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        wavelength = 2 * math.pi / freq
        # 0 for long wavelengths (fully interpolated) .. 1 for short ones (kept as they are)
        keep = np.clip((L / wavelength - low) / (high - low), 0.0, 1.0)
        return keep * freq + (1 - keep) * freq / factor, 1.0
    if kind == "yarn":
        return _yarn_frequencies(freq, scaling, factor, L, D, theta)
    return freq, 1.0  # default, and dynamic while seq_len <= L


def _yarn_frequencies(
    freq: np.ndarray, scaling: dict, factor: float, L: int, D: int, theta: float
) -> tuple[np.ndarray, float]:
    # Pair i turns L / (2π theta^(2i/D)) times over L positions; solving "= r turns" for i:
    def pair_with_turns(r: float) -> float:
        return D * math.log(L / (2 * math.pi * r)) / (2 * math.log(theta))

    first = pair_with_turns(float(scaling.get("beta_fast") or 32))  # fast pairs end here
    last = pair_with_turns(float(scaling.get("beta_slow") or 1))  # slow pairs start here
    if scaling.get("truncate", True):
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, D - 1)
    if last == first:
        last += 0.001  # a zero-width ramp would divide by zero
    interpolate = np.clip((np.arange(D // 2) - first) / (last - first), 0.0, 1.0)  # (D/2,)
    freq = interpolate * freq / factor + (1 - interpolate) * freq

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)
    return freq, float(attention_factor)


def rotate(x: np.ndarray, positions: np.ndarray, freq: np.ndarray, factor: float) -> np.ndarray:
    """RoPE: turn each pair (x_i, x_{i+D/2}) of x (B, h, T, D) by the angle position * freq_i.

    The pairs are the two halves of the head ("rotate half", the Hugging Face layout)."""
    angle = positions[:, None] * freq[None]  # (T, D/2)
    cos, sin = np.cos(angle) * factor, np.sin(angle) * factor
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x1, x2 = np.split(x, 2, axis=-1)  # (B, h, T, D/2) each
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def alibi_slopes(n_heads: int) -> np.ndarray:
    """ALiBi (Press et al. 2022): head h (1-based) of n gets slope 2^(-8h/n). For n not a power
    of two: the slopes of the power of two just below n, then the odd-numbered slopes
    (2^(-4), 2^(-12), ... i.e. every other one) of twice that power, until there are n."""
    below = 2 ** math.floor(math.log2(n_heads))
    slopes = [2.0 ** (-8.0 * h / below) for h in range(1, below + 1)]
    extra = [2.0 ** (-8.0 * h / (2 * below)) for h in range(1, 2 * below + 1, 2)]
    return np.array(slopes + extra[: n_heads - below])


# --- masks (seed 000 §2.2, §3.3 step ④) ---------------------------------------------------------


def allowed_keys(cfg: ModelConfig, T: int, padding_mask: np.ndarray | None) -> np.ndarray:
    """bool (B or 1, 1, T, T): may query i look at key j? Causal (j <= i), within the sliding
    window (i - j < window), and the key is a real token. A query that may see nothing (a pad
    position in a left-padded row) is let see every key, as glassformer does, so its softmax is
    not 0/0; its output is padding and nothing real attends to it."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]  # (T, 1), (1, T)
    allowed = np.ones((T, T), dtype=bool)
    if cfg.causal:
        allowed &= j <= i
    if cfg.sliding_window is not None:
        allowed &= np.abs(i - j) < cfg.sliding_window
    allowed = allowed[None, None]  # (1, 1, T, T)
    if padding_mask is not None:
        allowed = allowed & np.asarray(padding_mask, dtype=bool)[:, None, None, :]
    return allowed | ~allowed.any(axis=-1, keepdims=True)


# --- the model (seed 000 §5.4, §6.2) -----------------------------------------------------------


def weights_from_model(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's state_dict as numpy copies (float16/bfloat16 become float32: numpy has no
    bfloat16), with lm_head.weight resolved to the embedding table when they are tied."""
    import torch  # only here: the forward itself never touches torch

    weights = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        if tensor.dtype in (torch.float16, torch.bfloat16):
            tensor = tensor.float()
        weights[name] = tensor.numpy().copy()
    if model.cfg.tie_embeddings:
        weights["lm_head.weight"] = weights["tok_emb.weight"]
    return weights


def self_attention(
    x: np.ndarray,
    w: dict[str, np.ndarray],
    prefix: str,
    cfg: ModelConfig,
    allowed: np.ndarray,
    rope: tuple[np.ndarray, float] | None,
    alibi: np.ndarray | None,
) -> np.ndarray:
    """Multi-head self-attention (§3.3 steps ②-⑥, §4.1-4.2): (B, T, C) -> (B, T, C)."""
    B, T, _ = x.shape
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    # ② one fused projection; its output rows are [q (H*D) | k (Hkv*D) | v (Hkv*D)]
    qkv = linear(x, w[prefix + "qkv_proj.weight"], w.get(prefix + "qkv_proj.bias"))
    q, k, v = np.split(qkv, [H * D, H * D + Hkv * D], axis=-1)
    q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
    k = k.reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)  # (B, Hkv, T, D)
    v = v.reshape(B, T, Hkv, D).transpose(0, 2, 1, 3)  # (B, Hkv, T, D)
    if rope is not None:  # RoPE turns q and k, never v: position enters the scores only
        freq, factor = rope
        positions = np.arange(T, dtype=np.float64)
        q, k = rotate(q, positions, freq, factor), rotate(k, positions, freq, factor)
    # GQA/MQA (§4.2): query heads [g*h, g*h + g) share key/value head h
    k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)  # (B, H, T, D)
    out = attention(q, k, v, allowed, bias=alibi, scale=cfg.attention_scale).output
    out = out.transpose(0, 2, 1, 3).reshape(B, T, H * D)  # ⑥ heads side by side again
    return linear(out, w[prefix + "out_proj.weight"], w.get(prefix + "out_proj.bias"))


def norm(x: np.ndarray, w: dict[str, np.ndarray], prefix: str, cfg: ModelConfig) -> np.ndarray:
    if cfg.norm == "rms":
        return rms_norm(x, w[prefix + "weight"], cfg.norm_eps)
    return layer_norm(x, w[prefix + "weight"], w.get(prefix + "bias"), cfg.norm_eps)


def forward(
    weights: dict[str, np.ndarray],
    cfg: ModelConfig,
    ids: np.ndarray,
    padding_mask: np.ndarray | None = None,
) -> np.ndarray:
    """(B, T) token ids -> (B, T, V) logits of a GPT-family model, in pure numpy.

    weights: names as in GPT.state_dict() (see weights_from_model). Computes in float64 when
    the embedding table is float64, else float32. padding_mask: bool (B, T), True for real
    tokens; positions still count from 0 at the first column, as GPT.forward does.
    """
    if cfg.family != "gpt":
        raise ValueError(f"numpy_ref runs family='gpt' models, got family={cfg.family!r}")
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be (batch, time), got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(
            f"token ids {ids.min()}..{ids.max()} fall outside the vocabulary [0, "
            f"{cfg.vocab_size}): encode with the model's own tokenizer"
        )
    T = ids.shape[1]
    if cfg.position in ("learned", "sinusoidal") and cfg.max_seq_len < T:
        raise ValueError(
            f"{T} tokens exceed max_seq_len={cfg.max_seq_len}, the most positions "
            f"{cfg.position} positions know: shorten the input"
        )
    dtype = np.float64 if weights["tok_emb.weight"].dtype == np.float64 else np.float32
    w = {name: np.asarray(array, dtype=dtype) for name, array in weights.items()}

    # Embeddings: token vector + absolute position vector (§4.3: x_i = Embedding + PE(i))
    x = w["tok_emb.weight"][ids]  # (B, T, C)
    if cfg.position == "learned":
        x = x + w["pos_emb.weight"][:T]
    elif cfg.position == "sinusoidal":
        x = x + sinusoidal_table(T, cfg.d_model).astype(dtype)
    rope = rope_frequencies(cfg, T) if cfg.position == "rope" else None
    alibi = None
    if cfg.position == "alibi":  # -slope * distance, per head: (1, H, T, T)
        distance = np.abs(np.arange(T)[:, None] - np.arange(T)[None, :])
        alibi = (-alibi_slopes(cfg.n_heads)[:, None, None] * distance)[None].astype(dtype)
    allowed = allowed_keys(cfg, T, padding_mask)  # (B or 1, 1, T, T)

    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}."

        def attend(h: np.ndarray, p: str = p) -> np.ndarray:
            return self_attention(h, w, p + "attn.", cfg, allowed, rope, alibi)

        def ffn(h: np.ndarray, p: str = p) -> np.ndarray:
            if cfg.ffn == "moe":
                return moe_ffn(h, w, p + "ffn.", cfg)
            return dense_ffn(h, w, p + "ffn.", cfg.ffn)

        # §5.2 residual around each sublayer; §5.3 pre-norm x + f(norm(x)) or post-norm
        # norm(x + f(x)) (the 2017 paper)
        for sublayer, norm_name in ((attend, "attn_norm."), (ffn, "ffn_norm.")):
            keep = x if cfg.residual else 0.0  # residual=False: the §5.2 ablation, no "x +"
            if cfg.norm_position == "pre":
                x = keep + sublayer(norm(x, w, p + norm_name, cfg))
            else:
                x = norm(keep + sublayer(x), w, p + norm_name, cfg)

    if cfg.norm_position == "pre":  # a pre-norm stack leaves the residual stream unnormalized
        x = norm(x, w, "final_norm.", cfg)
    head = w["tok_emb.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
    return linear(x, head)  # (B, T, V)
