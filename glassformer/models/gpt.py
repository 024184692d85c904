"""GPT: the decoder-only Transformer (seed 000 §6.2; the Block of §5.4 stacked N times).

Shapes: B batch, T time, C channels (d_model), V vocab.

token ids -> embedding (+ absolute positions) -> N x Block -> final norm -> lm_head -> logits.
The same class is GPT-2, Llama, Mistral or Qwen2 depending on the config's component names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.models.common import LossOutput, check_token_ids, init_weights
from glassformer.nn.attention import AttentionMask, attention_mask
from glassformer.nn.block import Block
from glassformer.nn.ffn import moe_aux_loss
from glassformer.nn.kv_cache import KVCache, SlidingWindowCache
from glassformer.nn.norm import make_norm
from glassformer.nn.position import AbsolutePositions, RotaryEmbedding, alibi_slopes


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = AbsolutePositions.for_config(cfg)
        self.rope = RotaryEmbedding(cfg) if cfg.position == "rope" else None
        if cfg.position == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(cfg.n_heads), persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        # Pre-norm stacks leave the residual stream unnormalized: one last norm before the head.
        self.final_norm = make_norm(cfg) if cfg.norm_position == "pre" else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2N),
        # so the stream's variance does not grow with depth.
        for name, param in self.named_parameters():
            if name.endswith(("out_proj.weight", "fc_out.weight", "down.weight")):
                nn.init.normal_(param, 0.0, cfg.init_std / math.sqrt(2 * cfg.n_layers))

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.cfg.init_std)

    # --- caches and masks ---------------------------------------------------------------------

    def new_cache(
        self,
        batch_size: int = 1,
        max_seq_len: int | None = None,
        dtype: torch.dtype | None = None,
        kind: str = "auto",
    ) -> KVCache | SlidingWindowCache:
        """An empty preallocated KV cache for generation of up to max_seq_len positions.

        kind: "full" (KVCache, memory for every position), "sliding" (SlidingWindowCache, a ring
        of cfg.sliding_window positions) or "auto": sliding when the model has a window smaller
        than max_seq_len, else full.
        """
        if kind not in ("auto", "full", "sliding"):
            raise ValueError(f"kind={kind!r} is not known: pick 'auto', 'full' or 'sliding'")
        window, capacity = self.cfg.sliding_window, max_seq_len or self.cfg.max_seq_len
        if kind == "auto":
            kind = "sliding" if window is not None and capacity > window else "full"
        cache_class = SlidingWindowCache if kind == "sliding" else KVCache
        param = self.tok_emb.weight
        return cache_class.for_config(
            self.cfg, batch_size, max_seq_len, dtype or param.dtype, param.device
        )

    def _attention_mask(
        self,
        n_queries: int,
        cache: KVCache | SlidingWindowCache | None,
        padding_mask: Tensor | None,
        document_ids: Tensor | None,
        device: torch.device,
    ) -> AttentionMask:
        """The one mask of this forward, for every layer: queries at the positions this call
        fills, keys at the positions the cache returns (a ring cache's slots come in slot
        order), or the queries' own positions without a cache."""
        start = cache.length if cache is not None else 0
        queries = torch.arange(start, start + n_queries, device=device)
        if isinstance(cache, SlidingWindowCache):
            if cache.window != self.cfg.sliding_window:
                raise ValueError(
                    f"a SlidingWindowCache of window={cache.window} does not fit this model's "
                    f"sliding_window={self.cfg.sliding_window}: create it with model.new_cache()"
                )
            keys = cache.key_positions(n_queries, device)
        else:
            keys = torch.arange(start + n_queries, device=device)
        return attention_mask(
            queries,
            keys,
            causal=self.cfg.causal,
            sliding_window=self.cfg.sliding_window,
            padding_mask=padding_mask,
            document_ids=document_ids,
            alibi_slopes=getattr(self, "alibi_slopes", None),
        )

    # --- forward ------------------------------------------------------------------------------

    def hidden_states(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        cache: KVCache | SlidingWindowCache | None = None,
    ) -> Tensor:
        """(B, T) ids -> (B, T, C) final hidden states (after the final norm)."""
        cfg = self.cfg
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, time), got shape {tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        start = cache.length if cache is not None else 0
        check_token_ids(input_ids, cfg.vocab_size)
        if position_ids is None:
            # (1, T): broadcasts over the batch, and the position table's gradient gathers
            # T rows instead of B*T.
            position_ids = torch.arange(start, start + T, device=input_ids.device)[None]
        if self.pos_emb is not None and start + T > cfg.max_seq_len:
            raise ValueError(
                f"sequence of {start + T} tokens is longer than max_seq_len={cfg.max_seq_len}, "
                f"the most positions a model with {cfg.position} positions knows: shorten the "
                "input or use position='rope'/'alibi'"
            )

        x = self.tok_emb(input_ids)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(position_ids)
        x = self.drop(x)
        rope = self.rope(position_ids) if self.rope is not None else None
        mask = self._attention_mask(T, cache, padding_mask, document_ids, x.device)
        for block in self.blocks:
            x = block(x, mask, rope, cache)
        if cache is not None:
            cache.advance(T)
        return self.final_norm(x)

    def forward(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        cache: KVCache | SlidingWindowCache | None = None,
        last_token_only: bool = False,
    ) -> Tensor:
        """(B, T) token ids -> (B, T, V) next-token logits ((B, 1, V) with last_token_only).

        cache: a KVCache or SlidingWindowCache from new_cache(); the input continues where
            the cache ends.
        padding_mask: bool (B, cached + T), True for real tokens.
        document_ids: (B, cached + T) ids of packed documents, like padding_mask; attention
            stays inside each document.
        """
        x = self.hidden_states(
            input_ids,
            position_ids=position_ids,
            padding_mask=padding_mask,
            document_ids=document_ids,
            cache=cache,
        )
        if last_token_only:
            x = x[:, -1:]  # prefill needs only the last position's distribution
        return self.lm_head(x)

    def loss(self, input_ids: Tensor, targets: Tensor, **kwargs) -> LossOutput:
        """Teacher forcing (seed 000 §2.2): every position predicts its next token at once.

        targets: (B, T) ids, -100 where no loss is wanted (padding, document boundaries)."""
        logits = self(input_ids, **kwargs)  # (B, T, V)
        ce = F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
        )
        aux = self.moe_aux_loss()
        return LossOutput(loss=ce + self.cfg.moe_aux_loss_coef * aux, ce_loss=ce, aux_loss=aux)

    def moe_aux_loss(self) -> Tensor:
        """The load-balancing losses of the last forward pass, summed over MoE layers."""
        return moe_aux_loss(self)

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device
