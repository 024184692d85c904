"""The formulas behind the calculators' costs: the KV-cache bytes of seed 002 ("about 0.5 MB per
token for a 7B fp16 model") and the FLOPs of a forward pass, whose attention part grows with the
context (seed 002's O(n²)). The parameter table they start from is calc/parameters.py's.
"""

from __future__ import annotations

from glassformer.calc.parameters import AnyConfig, MLAMoEConfig, parameter_rows
from glassformer.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not known: pick one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# --- KV cache ---------------------------------------------------------------------------------


def _mla_cache_numbers(cfg: MLAMoEConfig) -> int:
    # MLA caches, per layer and position, the kv latent and the one RoPE key all heads share:
    # the heads' K and V are re-expanded from it (or absorbed into W_UQ and W_O).
    return cfg.n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def kv_bytes_per_token(cfg: AnyConfig, dtype: str = "fp16") -> int:
    """Keys and values of one position in every layer, the one count of "KV bytes per token"
    (a cache's `kv_bytes_per_token` matches it): 2 x n_layers x n_kv_heads x head_dim numbers.
    For Llama-7B in fp16: 2 * 32 * 32 * 128 * 2 B = 0.5 MiB (seed 002). MLA: layers x (kv latent
    + rope key). A seq2seq model: its decoder's self-attention. An encoder (bert) has keys and
    values per position too, but caches none: kv_cache_bytes refuses it."""
    if isinstance(cfg, MLAMoEConfig):
        return _mla_cache_numbers(cfg) * _dtype_bytes(dtype)
    if cfg.family == "rnn":
        raise ValueError(_RNN_HAS_NO_KV)
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * _dtype_bytes(dtype)


_RNN_HAS_NO_KV = (
    "family='rnn' keeps one hidden state, not a KV cache: rnn_state_bytes(cfg, dtype) "
    "is its size at any length (seed 000 §2.5.1)"
)


def _check_has_kv_cache(cfg: AnyConfig) -> None:
    if isinstance(cfg, MLAMoEConfig):
        return
    if cfg.family == "bert":
        raise ValueError(
            "family='bert' is an encoder: it reads the whole input at once and caches nothing "
            "(seed 000 §6.3); pick a decoder (gpt-style or seq2seq) preset"
        )
    if cfg.family == "rnn":
        raise ValueError(_RNN_HAS_NO_KV)


def kv_cache_bytes(cfg: AnyConfig, tokens: int, dtype: str = "fp16", batch_size: int = 1) -> int:
    """Bytes of keys and values held after `tokens` positions (prompt + generated), per
    batch of `batch_size` sequences. A sliding-window model keeps only the last
    `sliding_window` positions (Mistral's rolling buffer), so its cache stops growing there.
    Equals the bytes model.new_cache() holds once filled (tests count its written slots)."""
    if tokens < 0 or batch_size < 1:
        raise ValueError(f"tokens={tokens}, batch_size={batch_size}: need tokens >= 0, batch >= 1")
    _check_has_kv_cache(cfg)
    kept = tokens
    window = getattr(cfg, "sliding_window", None)
    if window is not None:
        kept = min(tokens, window)
    return kv_bytes_per_token(cfg, dtype) * kept * batch_size


def rnn_state_bytes(cfg: ModelConfig, dtype: str = "fp32") -> int:
    """An RNN's whole generation "cache": one hidden vector per layer (two for an LSTM: h and
    c), the same at any context length (seed 000 §2.5.1: memory as lossy compression)."""
    per_layer = 2 if cfg.cell == "lstm" else 1
    return cfg.n_layers * per_layer * cfg.d_model * _dtype_bytes(dtype)


# --- FLOPs ------------------------------------------------------------------------------------


def attention_width(cfg: AnyConfig) -> tuple[int, int, int]:
    """(attention layers, q.k width and v width summed over the query heads). GQA/MQA share
    keys among heads but every query head still scores every key: n_heads x head_dim."""
    if isinstance(cfg, MLAMoEConfig):
        qk = cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        return cfg.n_layers, qk, cfg.n_heads * cfg.v_head_dim
    d_attn = cfg.n_heads * cfg.head_dim
    layers = cfg.n_layers
    if cfg.family == "seq2seq":  # encoder self, decoder self and decoder cross-attention
        layers = (cfg.n_encoder_layers or cfg.n_layers) + 2 * cfg.n_layers
    return layers, d_attn, d_attn


def flops_per_token(cfg: AnyConfig, context: int) -> dict[str, int]:
    """Forward and training FLOPs per token at a context of `context` positions.

    matmul: 2 x the weights one token multiplies (a multiply and an add each; MoE: only the
    top-k experts; a tied output head still multiplies). attention: QK^T and AV, each 2 x
    context x n_heads x head_dim per layer: it grows with the context (seed 002's O(n²) over a
    sequence). The full context is counted, as PaLM and nanoGPT do (a causal mask could skip
    about half); a sliding window caps it. training: backward costs twice the forward, so
    3 x forward = 6N + 12 x layers x context x d_attn. seq2seq: one source plus one target
    token. Embedding lookups, norms and biases are not matmuls and are left out.
    """
    if context < 1:
        raise ValueError(f"context={context} must be >= 1 token")
    if isinstance(cfg, ModelConfig) and cfg.family == "rnn":
        raise ValueError("family='rnn' has no attention: its cost per token does not grow")
    weights = sum(row.matmul for row in parameter_rows(cfg))
    window = getattr(cfg, "sliding_window", None)
    seen = min(context, window) if window is not None else context
    layers, qk, v = attention_width(cfg)
    matmul = 2 * weights
    attention = 2 * layers * seen * (qk + v)  # = 2 x 2 x layers x context x d_attn (qk = v)
    forward = matmul + attention
    return {
        "matmul_weights": weights,
        "matmul": matmul,
        "attention": attention,
        "forward": forward,
        "training": 3 * forward,
    }
