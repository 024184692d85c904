"""One Transformer layer (seed 000 §5.4): attention and FFN, each wrapped in a residual and a
norm, pre-norm (x + f(norm(x)), modern) or post-norm (norm(x + f(x)), the 2017 paper)."""

from __future__ import annotations

from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.nn.attention import Attention, AttentionMask
from glassformer.nn.ffn import make_ffn
from glassformer.nn.kv_cache import CrossAttentionCache, KVCache
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

    def _residual(self, x: Tensor, norm: nn.Module, sublayer) -> Tensor:
        # residual=False is the ablation of §5.2: f(norm(x)) or norm(f(x)), no "x +"
        if self.pre_norm:
            out = self.dropout(sublayer(norm(x)))
            return x + out if self.residual else out
        out = self.dropout(sublayer(x))
        return norm(x + out if self.residual else out)

    def forward(
        self,
        x: Tensor,
        mask: AttentionMask,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
        context: Tensor | None = None,
        context_mask: AttentionMask | None = None,
        cross_cache: CrossAttentionCache | None = None,
    ) -> Tensor:
        x = self._residual(x, self.attn_norm, lambda h: self.attn(h, mask, rope, cache))
        if self.cross_attn is not None:
            x = self._residual(
                x,
                self.cross_norm,
                lambda h: self.cross_attn(
                    h, context_mask or AttentionMask(), cache=cross_cache, context=context
                ),
            )
        return self._residual(x, self.ffn_norm, self.ffn)
