"""One Transformer layer (seed 000 §5.4): attention and FFN, each wrapped in a residual and a
norm, pre-norm (x + f(norm(x)), modern) or post-norm (norm(x + f(x)), the 2017 paper)."""

from __future__ import annotations

from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.nn.attention import Attention, AttentionMask
from glassformer.nn.cross_cache import CrossAttentionCache
from glassformer.nn.ffn import make_ffn
from glassformer.nn.kv_cache import AttentionCache
from glassformer.nn.norm import make_norm


class Block(nn.Module):
    """Self-attention, optional cross-attention (decoder of an encoder-decoder), FFN."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, cross_attention: bool = False):
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.residual = cfg.residual
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg, layer_idx)
        if cross_attention:
            self.cross_norm = make_norm(cfg)
            self.cross_attn = Attention(cfg, layer_idx, cross=True)
        else:
            self.cross_attn = None
        self.ffn_norm = make_norm(cfg)
        self.ffn = make_ffn(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: Tensor,
        mask: AttentionMask,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: AttentionCache | None = None,
        context: Tensor | None = None,
        context_mask: AttentionMask | None = None,
        cross_cache: CrossAttentionCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """positions: of x's tokens, where a cache writes their keys/values."""
        cross = self.cross_attn
        context_mask = context_mask or AttentionMask()
        if self.pre_norm:  # x + f(norm(x)): the stream itself is never normalized
            x = self._add(x, self.attn(self.attn_norm(x), mask, rope, cache, positions=positions))
            if cross is not None:
                h = self.cross_norm(x)
                x = self._add(x, cross(h, context_mask, cache=cross_cache, context=context))
            return self._add(x, self.ffn(self.ffn_norm(x)))
        # post-norm, the 2017 paper: norm(x + f(x))
        x = self.attn_norm(self._add(x, self.attn(x, mask, rope, cache, positions=positions)))
        if cross is not None:
            h = cross(x, context_mask, cache=cross_cache, context=context)
            x = self.cross_norm(self._add(x, h))
        return self.ffn_norm(self._add(x, self.ffn(x)))

    def _add(self, x: Tensor, out: Tensor) -> Tensor:
        """The residual connection of §5.2, x + f(...); residual=False is its ablation."""
        out = self.dropout(out)
        return x + out if self.residual else out
