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
from glassformer.nn.kv_cache import AttentionCache, KVCache, SlidingWindowCache
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
        positions: Tensor,
        key_positions: Tensor,
        padding_mask: Tensor | None,
        document_ids: Tensor | None,
        simplify: bool = True,
    ) -> AttentionMask:
        """The one mask of this forward, for every layer: queries at `positions`, keys at the
        positions the cache returns (a ring cache's slots come in slot order), or the queries'
        own positions without a cache."""
        return attention_mask(
            positions,
            key_positions,
            causal=self.cfg.causal,
            sliding_window=self.cfg.sliding_window,
            padding_mask=padding_mask,
            document_ids=document_ids,
            alibi_slopes=getattr(self, "alibi_slopes", None),
            simplify=simplify,
        )

    def _check_inputs(self, input_ids: Tensor, position_ids: Tensor, cache) -> None:
        """Token ids inside the vocabulary, positions the position table knows, a ring cache of
        this model's window: one-line errors instead of an index error deep in a layer."""
        check_token_ids(input_ids, self.cfg.vocab_size)
        n_positions = int(position_ids.max()) + 1 if self.pos_emb is not None else 0
        if n_positions > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {n_positions} tokens is longer than max_seq_len="
                f"{self.cfg.max_seq_len}, the most positions a model with {self.cfg.position} "
                "positions knows: shorten the input or use position='rope'/'alibi'"
            )
        window = getattr(cache, "window", None)
        if window is not None and window != self.cfg.sliding_window:
            raise ValueError(
                f"a SlidingWindowCache of window={window} does not fit this model's "
                f"sliding_window={self.cfg.sliding_window}: create it with model.new_cache()"
            )

    # --- forward ------------------------------------------------------------------------------

    def hidden_states(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        *,
        cache: AttentionCache | None = None,
        position_ids: Tensor | None = None,
        padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """(B, T) ids at `positions` -> (B, T, C) final hidden states (after the final norm).

        positions: where the tokens sit in their sequence, (T,) for every row or (B, T) per
            row: the slots the cache writes, the causal order, the angles RoPE turns. Required
            with a cache (the caller counts what each row holds; the cache keeps no count);
            0..T-1 without one.
        cache: from new_cache(); it holds positions 0..p-1 of each row the tokens continue.
        position_ids: what the position encoding sees when it differs from `positions` (HF's
            position_ids): packed documents restart at 0, left-padded rows count real tokens.
        padding_mask: bool (B, cached + T), True for real tokens.
        document_ids: (B, cached + T) ids of packed documents, like padding_mask; attention
            stays inside each document.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, time), got shape {tuple(input_ids.shape)}")
        T, device = input_ids.shape[1], input_ids.device
        if positions is None:
            if cache is not None:
                raise ValueError(
                    "a forward with a cache needs the positions of its tokens: pass "
                    "positions=torch.arange(p, p + T), p being how many positions the cache "
                    "holds for the row (0 for a prompt)"
                )
            positions = torch.arange(T, device=device)
        if position_ids is None:
            # (1, T) broadcasts over the batch, so the position table's gradient gathers T rows.
            position_ids = positions if positions.dim() == 2 else positions[None]
        static = getattr(cache, "static", False)  # a compiled step: no host syncs, dense masks
        if not static:
            self._check_inputs(input_ids, position_ids, cache)
        key_positions = cache.begin(positions) if cache is not None else positions

        x = self.tok_emb(input_ids)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(position_ids)
        x = self.drop(x)
        rope = self.rope(position_ids) if self.rope is not None else None
        mask = self._attention_mask(
            positions, key_positions, padding_mask, document_ids, simplify=not static
        )
        if static:  # one additive tensor: inside a compiled graph a bool mask is far slower
            mask = AttentionMask(bias=mask.additive(T, len(key_positions), torch.float32, device))
        for block in self.blocks:
            x = block(x, mask, rope, cache, positions=positions)
        return self.final_norm(x)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        *,
        cache: AttentionCache | None = None,
        last_token_only: bool = False,
        **inputs: Tensor | None,
    ) -> Tensor:
        """(B, T) token ids at `positions` -> (B, T, V) next-token logits ((B, 1, V) with
        last_token_only). The arguments are hidden_states'."""
        x = self.hidden_states(input_ids, positions, cache=cache, **inputs)
        if last_token_only:
            x = x[:, -1:]  # prefill needs only the last position's distribution
        return self.lm_head(x)

    def loss(self, input_ids: Tensor, targets: Tensor, **kwargs) -> LossOutput:
        """Teacher forcing (seed 000 §2.2): every position predicts its next token at once.

        targets: (B, T) ids, -100 where no loss is wanted (padding, document boundaries, the
        prompt of a chat example). The head runs only where a loss is taken: its V-wide logits
        are the largest matmul of a small model, and a chat fine-tune learns a minority of the
        tokens it reads."""
        x = self.hidden_states(input_ids, **kwargs)  # (B, T, C)
        keep = targets != -100
        if not bool(keep.all()):
            x, targets = x[keep], targets[keep]  # (N, C), (N,): the positions that are learned
        logits = self.lm_head(x)  # (B, T, V) or (N, V)
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
