"""Calculators (seed 000 §2.1's parameter table; seed 002's KV-cache memory): parameters by
component, and KV-cache bytes per token, from a config or a built model."""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from glassformer.config import ModelConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}


def component_of(name: str) -> str:
    """Which row of the parameter table a parameter name belongs to."""
    if name.startswith(("tok_emb", "dec_tok_emb")):  # dec_tok_emb: a seq2seq decoder's own
        return "embedding"
    if name.startswith(("pos_emb", "enc_pos", "dec_pos", "enc_rel", "dec_rel")):
        return "positions"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".ffn.router" in name:
        return "moe router"
    if "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1]:
        return "norms"
    if ".attn." in name or ".cross_attn." in name:
        return "attention"
    if ".ffn." in name:
        return "ffn"
    if name.startswith("rnn_layers."):
        return "recurrent"  # RNN family: W_xh, W_hh (and the LSTM/GRU gates)
    return "other"


def parameter_table(model: nn.Module) -> dict[str, int]:
    """Parameter counts by component; tied weights are counted once (under embedding)."""
    counts: dict[str, int] = defaultdict(int)
    for name, param in model.named_parameters():  # named_parameters skips tied duplicates
        counts[component_of(name)] += param.numel()
    return dict(counts)


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype: str = "fp16") -> int:
    """Keys and values of one position in every layer: 2 * n_layers * n_kv_heads * head_dim
    numbers. For Llama-7B in fp16: 2 * 32 * 32 * 128 * 2 B = 0.5 MiB (seed 002)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not known: pick one of {', '.join(DTYPE_BYTES)}")
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


def rnn_state_bytes(cfg: ModelConfig, dtype: str = "fp32") -> int:
    """An RNN's whole generation "cache": one hidden vector per layer (two for an LSTM: h and
    c), the same at any context length (seed 000 §2.5.1: memory as lossy compression)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not known: pick one of {', '.join(DTYPE_BYTES)}")
    per_layer = 2 if cfg.cell == "lstm" else 1
    return cfg.n_layers * per_layer * cfg.d_model * DTYPE_BYTES[dtype]
