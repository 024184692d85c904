"""BERT: the encoder-only Transformer (seed 000 §6.3; the Block of §5.4 stacked N times, seeing
both directions).

Shapes: B batch, T time, C channels (d_model), V vocab, N selected (masked) positions.

token ids -> token + position + token-type embeddings -> embedding norm -> N x Block
(bidirectional, padding masked) -> hidden states. On top, optionally: the pooler (tanh of a
dense layer on position 0, the [CLS] token) and the masked-LM head (dense, activation, norm,
then a decoder tied to the token embedding), a sequence classifier and the next-sentence head
(both linear layers on the pooled [CLS]). The same Block as GPT, with norm_position="post" and
no causal mask.

The task heads are config switches (n_classes, nsp_head) like pooler and mlm_head rather than
wrapper classes (transformers' BertForSequenceClassification): a checkpoint stays a config plus
one state dict, so build_model, save, load and fine-tuning from a pretrained encoder need no
second class, and `loss` picks its objective from the batch (targets, labels, nsp_labels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.models.common import LossOutput, check_token_ids, init_weights
from glassformer.nn.attention import AttentionMask, attention_mask
from glassformer.nn.block import Block
from glassformer.nn.ffn import ACTIVATIONS, moe_aux_loss
from glassformer.nn.norm import make_norm
from glassformer.nn.position import AbsolutePositions, RotaryEmbedding, alibi_slopes


class Pooler(nn.Module):
    """tanh(W h_[CLS] + b): one vector per sequence, what BERT's NSP/classifiers read."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))  # (B, T, C) -> (B, C)


class MLMHead(nn.Module):
    """dense -> activation -> norm -> decoder (+ its own bias): a vocabulary distribution for
    every position. The decoder's weight is the token embedding when embeddings are tied."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        # BERT uses its hidden activation here too; a gated FFN's activation is its gate's.
        self.act = ACTIVATIONS[cfg.moe_expert_ffn if cfg.ffn == "moe" else cfg.ffn]
        self.norm = make_norm(cfg)
        self.decoder = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.decoder(self.norm(self.act(self.dense(hidden))))  # (..., C) -> (..., V)


class BERT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = AbsolutePositions.for_config(cfg)
        self.type_emb = (
            nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        )
        self.rope = RotaryEmbedding(cfg) if cfg.position == "rope" else None
        if cfg.position == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(cfg.n_heads), persistent=False)
        self.emb_norm = make_norm(cfg) if cfg.embedding_norm else nn.Identity()
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        # Post-norm blocks end normalized; a pre-norm stack needs one last norm.
        self.final_norm = make_norm(cfg) if cfg.norm_position == "pre" else nn.Identity()
        self.pooler = Pooler(cfg) if cfg.pooler else None
        self.mlm_head = MLMHead(cfg) if cfg.mlm_head else None
        # Task heads on the pooled [CLS] (dropout before them, as in BERT's fine-tuning).
        self.classifier = nn.Linear(cfg.d_model, cfg.n_classes) if cfg.n_classes else None
        self.nsp_head = nn.Linear(cfg.d_model, 2) if cfg.nsp_head else None
        self.apply(self._init_weights)
        if self.mlm_head is not None and cfg.tie_embeddings:
            self.mlm_head.decoder.weight = self.tok_emb.weight

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.cfg.init_std)

    # --- masks --------------------------------------------------------------------------------

    def _attention_mask(
        self, batch_size: int, n_tokens: int, padding_mask: Tensor | None, device: torch.device
    ) -> AttentionMask:
        if padding_mask is not None and tuple(padding_mask.shape) != (batch_size, n_tokens):
            raise ValueError(
                f"padding_mask has shape {tuple(padding_mask.shape)}, input_ids "
                f"{(batch_size, n_tokens)}: give one True/1 per real token, False/0 per pad"
            )
        # Only keys are masked: a pad query still looks at the real tokens (as in transformers),
        # and its output is never used.
        positions = torch.arange(n_tokens, device=device)
        return attention_mask(
            positions,
            positions,
            causal=False,
            sliding_window=self.cfg.sliding_window,
            padding_mask=padding_mask,
            alibi_slopes=getattr(self, "alibi_slopes", None),
        )

    # --- forward ------------------------------------------------------------------------------

    def _embed(
        self, input_ids: Tensor, token_type_ids: Tensor | None, position_ids: Tensor
    ) -> Tensor:
        x = self.tok_emb(input_ids)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(position_ids)
        if self.type_emb is not None:
            if token_type_ids is None:  # one segment: every token is type 0
                x = x + self.type_emb.weight[0]
            else:
                x = x + self.type_emb(token_type_ids)
        return self.drop(self.emb_norm(x))

    def _check_inputs(
        self, input_ids: Tensor, token_type_ids: Tensor | None, position_ids: Tensor | None
    ) -> None:
        cfg = self.cfg
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, time), got shape {tuple(input_ids.shape)}")
        check_token_ids(input_ids, cfg.vocab_size)
        T = input_ids.shape[1]
        if self.pos_emb is not None:
            longest = T if position_ids is None else int(position_ids.max()) + 1
            if longest > cfg.max_seq_len:
                raise ValueError(
                    f"sequence of {longest} tokens is longer than max_seq_len={cfg.max_seq_len}, "
                    f"the most positions this model's {cfg.position} position table has: "
                    "truncate or split the input"
                )
        if token_type_ids is not None:
            if self.type_emb is None:
                raise ValueError(
                    "token_type_ids given, but this model has no token type embeddings "
                    "(type_vocab_size=0): drop them or set type_vocab_size"
                )
            if token_type_ids.shape != input_ids.shape:
                raise ValueError(
                    f"token_type_ids has shape {tuple(token_type_ids.shape)}, input_ids "
                    f"{tuple(input_ids.shape)}: give one type id per token"
                )
            low, high = int(token_type_ids.min()), int(token_type_ids.max())
            if low < 0 or high >= cfg.type_vocab_size:
                raise ValueError(
                    f"token type id {high if high >= cfg.type_vocab_size else low} is outside "
                    f"[0, {cfg.type_vocab_size}): segment A is 0, segment B is 1"
                )

    def forward(
        self,
        input_ids: Tensor,
        *,
        token_type_ids: Tensor | None = None,
        padding_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """(B, T) token ids -> (B, T, C) hidden states, every position seeing both directions.

        token_type_ids: (B, T) segment ids (0 for sentence A, 1 for B); None means all 0.
        padding_mask: bool or 0/1 (B, T), True for real tokens; pads are never attended to.
        position_ids: (B or 1, T); None means 0..T-1.
        """
        self._check_inputs(input_ids, token_type_ids, position_ids)
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None]  # (1, T)
        x = self._embed(input_ids, token_type_ids, position_ids)  # (B, T, C)
        rope = self.rope(position_ids) if self.rope is not None else None
        mask = self._attention_mask(B, T, padding_mask, x.device)
        for block in self.blocks:
            x = block(x, mask, rope)
        return self.final_norm(x)

    def pooled(self, hidden: Tensor) -> Tensor:
        """(B, T, C) hidden states -> (B, C) pooler output (from position 0, the [CLS])."""
        if self.pooler is None:
            raise ValueError("this model has no pooler (pooler=False): use the hidden states")
        return self.pooler(hidden)

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """(B, T, C) hidden states -> (B, T, V) masked-LM logits (any (..., C) works)."""
        if self.mlm_head is None:
            raise ValueError(
                "this model has no masked-LM head (mlm_head=False): load a BertForMaskedLM "
                "checkpoint or build with mlm_head=True"
            )
        return self.mlm_head(hidden)

    def classify(self, hidden: Tensor) -> Tensor:
        """(B, T, C) hidden states -> (B, n_classes) logits of the sequence classifier."""
        if self.classifier is None:
            raise ValueError("this model has no classifier (n_classes=0): build with n_classes")
        return self.classifier(self.drop(self.pooled(hidden)))  # (B, C) -> (B, n_classes)

    def nsp_logits(self, hidden: Tensor) -> Tensor:
        """(B, T, C) hidden states -> (B, 2) next-sentence logits: 0 = IsNext, 1 = NotNext."""
        if self.nsp_head is None:
            raise ValueError("this model has no next-sentence head: build with nsp_head=True")
        return self.nsp_head(self.pooled(hidden))

    def loss(
        self,
        input_ids: Tensor,
        targets: Tensor | None = None,
        *,
        labels: Tensor | None = None,
        nsp_labels: Tensor | None = None,
        **kwargs,
    ) -> LossOutput:
        """The objectives the batch asks for, summed: ce_loss reports the main one.

        targets: (B, T) masked LM (seed 000 §6.3, the cloze task): original ids at the selected
            positions of the already-corrupted input_ids, -100 everywhere else.
        labels: (B,) class ids for the sequence classifier (fine-tuning).
        nsp_labels: (B,) next-sentence labels (0 = B follows A, 1 = B is random), added to the
            MLM loss as in BERT's pretraining."""
        if (targets is None) == (labels is None):
            raise ValueError(
                "give targets (masked LM, shape (B, T)) or labels (classification, shape (B,)), "
                "exactly one of them"
            )
        hidden = self(input_ids, **kwargs)  # (B, T, C)
        if labels is not None:
            ce = F.cross_entropy(self.classify(hidden).float(), labels)
        else:
            ce = self._mlm_loss(hidden, targets)
        total = ce
        if nsp_labels is not None:
            total = total + F.cross_entropy(self.nsp_logits(hidden).float(), nsp_labels)
        aux = self.moe_aux_loss()
        return LossOutput(loss=total + self.cfg.moe_aux_loss_coef * aux, ce_loss=ce, aux_loss=aux)

    def _mlm_loss(self, hidden: Tensor, targets: Tensor) -> Tensor:
        selected = targets != -100  # (B, T)
        # Only the selected positions need the V-wide decoder: ~15% of the work.
        logits = self.mlm_logits(hidden[selected])  # (N, V)
        if logits.shape[0] == 0:  # nothing selected in this batch: no signal, no NaN
            return logits.sum() * 0.0
        return F.cross_entropy(logits.float(), targets[selected])

    def moe_aux_loss(self) -> Tensor:
        """The load-balancing losses of the last forward pass, summed over MoE layers."""
        return moe_aux_loss(self)

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device
