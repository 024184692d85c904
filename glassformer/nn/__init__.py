"""The parts library: attention, positions, norms, FFN/MoE, blocks and the KV cache."""

from glassformer.nn.attention import (
    Attention,
    AttentionMask,
    attention_mask,
    eager_attention,
    sdpa_attention,
)
from glassformer.nn.block import Block
from glassformer.nn.cross_cache import CrossAttentionCache
from glassformer.nn.ffn import MLP, GatedMLP, MoE, make_ffn
from glassformer.nn.kv_cache import KVCache, SlidingWindowCache
from glassformer.nn.norm import LayerNorm, RMSNorm, make_norm
from glassformer.nn.position import (
    AbsolutePositions,
    RelativePositionBias,
    RotaryEmbedding,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    rope_inv_freq,
    sinusoidal_table,
)

__all__ = [
    "MLP",
    "AbsolutePositions",
    "Attention",
    "AttentionMask",
    "Block",
    "CrossAttentionCache",
    "GatedMLP",
    "KVCache",
    "LayerNorm",
    "MoE",
    "RMSNorm",
    "RelativePositionBias",
    "RotaryEmbedding",
    "SlidingWindowCache",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "attention_mask",
    "eager_attention",
    "make_ffn",
    "make_norm",
    "rope_inv_freq",
    "sdpa_attention",
    "sinusoidal_table",
]
