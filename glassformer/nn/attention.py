"""Self- and cross-attention (seed 000 §3.3, §4.1-4.2) with every mask built in one place.

Shapes: B batch, T/Tq/Tk time (queries, keys), C channels (d_model), H query heads,
Hkv key/value heads (MHA: Hkv = H, GQA: 1 < Hkv < H, MQA: Hkv = 1), D head dim.

Two paths compute the same thing: `eager_attention` spells out the six steps of §3.3 and can
return the [B, H, Tq, Tk] weights; `sdpa_attention` is torch's fused kernel. Tests hold them
equal for every mask kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.nn.cross_cache import CrossAttentionCache
from glassformer.nn.kv_cache import AttentionCache
from glassformer.nn.norm import RMSNorm, upcast
from glassformer.nn.position import alibi_bias, apply_rope

# --- masks ------------------------------------------------------------------------------------


@dataclass
class AttentionMask:
    """Which keys each query may see, built once per forward and shared by every layer.

    allowed: bool (B or 1, 1, Tq, Tk), True where attending is allowed; None means "all keys",
    or, with is_causal, the plain lower-triangular mask that SDPA can apply by itself.
    bias: float (B or 1, H, Tq, Tk) added to the scores (ALiBi), or None.
    """

    allowed: Tensor | None = None
    bias: Tensor | None = None
    is_causal: bool = False

    def dense(self, n_queries: int, n_keys: int, device: torch.device) -> Tensor | None:
        """The mask as an explicit bool tensor (None when every key is visible). The causal
        triangle is aligned bottom-right: query i sits at key index n_keys - n_queries + i."""
        if self.is_causal:
            triangle = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
            return triangle.tril(diagonal=n_keys - n_queries)[None, None]  # (1, 1, Tq, Tk)
        return self.allowed

    def additive(
        self, n_queries: int, n_keys: int, dtype: torch.dtype, device: torch.device
    ) -> Tensor | None:
        """The mask as one float tensor added to the scores: the bias, and -inf where a key is
        not allowed (None when nothing is masked or biased)."""
        allowed = self.dense(n_queries, n_keys, device)
        bias = None if self.bias is None else self.bias.to(dtype)
        if allowed is None:
            return bias
        blocked = torch.zeros(allowed.shape, dtype=dtype, device=device)
        blocked = blocked.masked_fill(~allowed, float("-inf"))
        return blocked if bias is None else bias + blocked


def attention_mask(
    q_positions: Tensor,
    k_positions: Tensor,
    *,
    causal: bool,
    sliding_window: int | None = None,
    padding_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    simplify: bool = True,
) -> AttentionMask:
    """The one mask function: which keys each query may see, from the sequence positions of
    the queries, (Tq,) or per row (B, Tq), and of the keys, (Tk,) or (B, Tk), plus ALiBi's
    bias from the same positions.

    Every case is one of these rules: causal (a key after its query is hidden; with a KV cache
    the queries are the last positions, so the triangle is aligned bottom-right: aligning it
    top-left is the classic KV-cache bug), a sliding window of w keys (the query itself and
    the w - 1 before it, Mistral's convention), padding (padding_mask (B, total), True for real
    tokens) and packed documents (document_ids (B, total): attention never crosses them). Keys
    may come in any order, as a ring cache returns them, and rows of a batch may sit at
    different positions, as the Engine's rows do.

    simplify: return no tensor when nothing is masked (one decode step, a bidirectional
    encoder) and SDPA's own triangle for a plain causal square. It costs a device sync, so a
    compiled graph passes False and gets the dense mask.
    """
    plain = padding_mask is None and document_ids is None and sliding_window is None
    shared = q_positions.dim() == 1 and k_positions.dim() == 1  # the same for every row
    q = q_positions if q_positions.dim() == 2 else q_positions[None]  # (B or 1, Tq)
    k = k_positions if k_positions.dim() == 2 else k_positions[None]  # (B or 1, Tk)
    square = causal and shared and q.shape[1] == k.shape[1] > 1  # the training and prefill case
    if simplify and plain and alibi_slopes is None and square and q_positions.equal(k_positions):
        return AttentionMask(is_causal=True)
    bias = None if alibi_slopes is None else alibi_bias(alibi_slopes, q, k)  # (B or 1, H, Tq, Tk)
    q_index, k_index = q[:, :, None], k[:, None, :]  # (B or 1, Tq, 1), (B or 1, 1, Tk)
    allowed = torch.ones(1, 1, 1, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed & (k_index <= q_index)
    if sliding_window is not None:
        allowed = (
            allowed & (q_index - k_index < sliding_window) & (k_index - q_index < sliding_window)
        )
    allowed = allowed.expand(q.shape[0], q.shape[1], k.shape[1])[:, None]  # (B or 1, 1, Tq, Tk)
    if padding_mask is not None:
        allowed = allowed & _at(padding_mask.bool(), k)[:, None, None, :]
    if document_ids is not None:
        q_docs, k_docs = _at(document_ids, q), _at(document_ids, k)
        allowed = allowed & (q_docs[:, None, :, None] == k_docs[:, None, None, :])
    if simplify and bool(allowed.all()):
        return AttentionMask(bias=bias)
    # A query that may see nothing (a padding position) would softmax over all -inf: NaN.
    # Let such rows see everything instead; their outputs are padding and never used.
    return AttentionMask(allowed=allowed | ~allowed.any(dim=-1, keepdim=True), bias=bias)


def _at(per_position: Tensor, positions: Tensor) -> Tensor:
    """per_position (B, total) read at positions (1 or B, T) -> (B, T). A position past the
    end (a ring slot a row has not reached, hidden by the causal rule) reads the last one."""
    index = positions.clamp(max=per_position.shape[1] - 1).expand(per_position.shape[0], -1)
    return per_position.gather(1, index)


# --- the two attention paths ----------------------------------------------------------------


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: AttentionMask,
    scale: float,
    dropout_p: float = 0.0,
    return_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The six steps written out. q (B, H, Tq, D), k/v (B, Hkv, Tk, D) -> (B, H, Tq, D)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # GQA/MQA: each key/value head serves `groups` query heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = upcast(q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, Tk)  score and scale
    if mask.bias is not None:
        scores = scores + mask.bias
    allowed = mask.dense(q.shape[2], k.shape[2], q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))  # mask the future / other docs
    weights = scores.softmax(dim=-1).to(q.dtype)  # each row sums to 1
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    out = weights @ v  # (B, H, Tq, D)  weighted sum of values
    return out, (weights if return_weights else None)


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """torch's fused scaled_dot_product_attention with the same mask."""
    n_queries, n_keys = q.shape[2], k.shape[2]
    # SDPA's own causal triangle is aligned top-left, ours bottom-right (AttentionMask.dense): let
    # SDPA build it only when the two agree (as many queries as keys) and no bias is added.
    builtin_causal = mask.is_causal and mask.bias is None and n_queries == n_keys
    if builtin_causal:
        attn_mask = None
    elif mask.bias is not None:  # an additive float mask: the bias, with -inf where not allowed
        attn_mask = mask.additive(n_queries, n_keys, q.dtype, q.device)
    else:
        attn_mask = mask.dense(n_queries, n_keys, q.device)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=builtin_causal,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )


# --- the module -----------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head attention with a fused QKV projection, GQA/MQA through n_kv_heads.

    Self-attention projects q, k and v from x with one matmul. Cross-attention (the
    encoder-decoder bridge, seed 000 §3.1) projects q from x and k, v from `context`.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, cross: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.cross = cross
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)  # the √d_k of §3.3
        if cfg.attention_scale is not None:  # T5 folds the scale into its weights' init
            self.scale = cfg.attention_scale
        self.dropout = cfg.dropout
        self.backend = cfg.attention_backend
        qkv_bias = cfg.has_bias("qkv")
        q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        if cross:
            self.q_proj = nn.Linear(cfg.d_model, q_size, bias=qkv_bias)
            self.kv_proj = nn.Linear(cfg.d_model, 2 * kv_size, bias=qkv_bias)
        else:
            self.qkv_proj = nn.Linear(cfg.d_model, q_size + 2 * kv_size, bias=qkv_bias)
        self.out_proj = nn.Linear(q_size, cfg.d_model, bias=cfg.has_bias("attn_out"))
        # Qwen3: each head's query and key vectors are RMS-normalised (with a learned gain of
        # D numbers shared by the heads) before RoPE, which keeps the scores' scale in check.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # Set by glassformer.inspect to record this layer's weights; None on the fast path.
        self.weights_sink: list[Tensor] | None = None

    def _split_heads(self, x: Tensor, n_heads: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n_heads, self.head_dim).transpose(1, 2)  # (B, h, T, D)

    def project_context(self, context: Tensor | None) -> tuple[Tensor, Tensor]:
        """Cross-attention keys/values from the encoder output: (B, S, C) -> 2 x (B, Hkv, S, D)."""
        if context is None:
            raise ValueError("cross-attention needs the encoder output as `context`")
        k, v = self.kv_proj(context).split(self.n_kv_heads * self.head_dim, dim=-1)
        return self._split_heads(k, self.n_kv_heads), self._split_heads(v, self.n_kv_heads)

    def project(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if self.cross:
            k, v = self.project_context(context)
            return self._split_heads(self.q_proj(x), self.n_heads), k, v
        else:
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        return (
            self._split_heads(q, self.n_heads),  # (B, H, Tq, D)
            self._split_heads(k, self.n_kv_heads),  # (B, Hkv, Tk, D)
            self._split_heads(v, self.n_kv_heads),  # (B, Hkv, Tk, D)
        )

    def forward(
        self,
        x: Tensor,
        mask: AttentionMask,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: AttentionCache | CrossAttentionCache | None = None,
        context: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """cache: an AttentionCache for self-attention, whose update writes this call's
        keys/values at `positions` (the ones the model gave cache.begin); for cross-attention a
        CrossAttentionCache, whose keys/values are projected from `context` on the first call
        and reused after."""
        B, T, _ = x.shape
        if self.cross and cache is not None:
            kv = cache.get(self.layer_idx)
            if kv is None:
                kv = self.project_context(context)
                cache.store(self.layer_idx, *kv)
            q, (k, v) = self._split_heads(self.q_proj(x), self.n_heads), kv
            cache = None  # nothing to append: the source does not grow
        else:
            q, k, v = self.project(x, context)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over D, per head (cached keys: once)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            # The cache stores rotated keys: position lives inside each cached vector.
            k, v = cache.update(self.layer_idx, positions, k, v)  # (B, Hkv, Tk, D)
            if k.dtype != q.dtype:  # a cache kept narrower (the Engine's kv_dtype): read back
                k, v = k.to(q.dtype), v.to(q.dtype)
        dropout_p = self.dropout if self.training else 0.0
        if self.backend == "eager" or self.weights_sink is not None:
            out, weights = eager_attention(
                q, k, v, mask, self.scale, dropout_p, return_weights=self.weights_sink is not None
            )
            if self.weights_sink is not None:
                self.weights_sink.append(weights.detach())
        else:
            out = sdpa_attention(q, k, v, mask, self.scale, dropout_p)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H*D)
        return self.out_proj(out)
