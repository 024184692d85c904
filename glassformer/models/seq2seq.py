"""The encoder-decoder Transformer of the 2017 paper (seed 000 §6.1, appendix), also T5 and BART.

Shapes: B batch, S source time, T target time, C channels (d_model), H heads, V vocab.

source ids -> embedding (* sqrt(C) when scaled) + positions -> N_enc x Block (bidirectional,
source padding masked) -> memory (B, S, C).
target ids -> embedding + positions -> N_dec x Block (causal self-attention, cross-attention on
the memory) -> final norm -> lm_head -> logits (B, T, V).

The same Block as GPT and BERT. Post-norm (the paper, BART) or pre-norm (T5) is the config's
norm_position; positions are sinusoidal (the paper), learned (BART, offset by position_offset)
or T5's bucketed relative bias (position="relative").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.models.common import LossOutput, check_token_ids, init_weights
from glassformer.nn.attention import AttentionMask, attention_mask
from glassformer.nn.block import Block
from glassformer.nn.cross_cache import CrossAttentionCache
from glassformer.nn.ffn import moe_aux_loss
from glassformer.nn.kv_cache import KVCache
from glassformer.nn.norm import make_norm
from glassformer.nn.position import (
    AbsolutePositions,
    RelativePositionBias,
    RotaryEmbedding,
    alibi_slopes,
)


@dataclass
class Seq2SeqCache:
    """Decoder state for generation (a Cache, nn/kv_cache.py): the self-attention KV cache is
    written at the target positions each decode call is given; the cross-attention keys/values
    are projected from the memory on the first decode call and reused after (the source does
    not change)."""

    self_attn: KVCache
    cross_attn: CrossAttentionCache

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows `index` (B',) of every cached tensor: beam search's parent beams."""
        self.self_attn.k = self.self_attn.k.index_select(1, index)
        self.self_attn.v = self.self_attn.v.index_select(1, index)
        self.cross_attn.reorder(index)

    def rows(self, start: int, stop: int) -> Seq2SeqCache:
        return Seq2SeqCache(self.self_attn.rows(start, stop), self.cross_attn.rows(start, stop))

    def swap_rows(self, a: int, b: int, n_positions: int | None = None) -> None:
        self.self_attn.swap_rows(a, b, n_positions)
        self.cross_attn.swap_rows(a, b)

    def reset(self) -> None:
        self.self_attn.reset()
        self.cross_attn.reset()

    @property
    def batch_size(self) -> int:
        return self.self_attn.batch_size

    @property
    def max_seq_len(self) -> int:
        return self.self_attn.max_seq_len

    @property
    def rewinds(self) -> bool:
        return self.self_attn.rewinds

    @property
    def nbytes(self) -> int:
        return self.self_attn.nbytes + self.cross_attn.nbytes

    def row_bytes(self, length: int) -> int:
        return self.self_attn.row_bytes(length) + self.cross_attn.row_bytes(length)


class Seq2Seq(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n_encoder_layers = cfg.n_encoder_layers or cfg.n_layers
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)  # the encoder's table
        self.dec_tok_emb = (
            self.tok_emb if cfg.share_embeddings else nn.Embedding(cfg.vocab_size, cfg.d_model)
        )
        scaled = cfg.scale_embeddings
        if scaled is None:
            scaled = cfg.position == "sinusoidal"  # the paper: "multiply those weights by √d"
        self.emb_scale = math.sqrt(cfg.d_model) if scaled else 1.0
        absolute = cfg.position in ("learned", "sinusoidal")
        n_positions = cfg.max_seq_len + cfg.position_offset
        self.enc_pos = (
            AbsolutePositions(cfg.position, n_positions, cfg.d_model) if absolute else None
        )
        self.dec_pos = (
            AbsolutePositions(cfg.position, n_positions, cfg.d_model) if absolute else None
        )
        relative = cfg.position == "relative"
        self.enc_rel = RelativePositionBias(cfg, bidirectional=True) if relative else None
        self.dec_rel = RelativePositionBias(cfg, bidirectional=False) if relative else None
        self.rope = RotaryEmbedding(cfg) if cfg.position == "rope" else None
        if cfg.position == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(cfg.n_heads), persistent=False)
        self.enc_emb_norm = make_norm(cfg) if cfg.embedding_norm else nn.Identity()
        self.dec_emb_norm = make_norm(cfg) if cfg.embedding_norm else nn.Identity()
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(Block(cfg, i) for i in range(n_encoder_layers))
        self.decoder = nn.ModuleList(
            Block(cfg, i, cross_attention=True) for i in range(cfg.n_layers)
        )
        # Post-norm blocks end normalized; a pre-norm stack needs one last norm.
        pre = cfg.norm_position == "pre"
        self.enc_final_norm = make_norm(cfg) if pre else nn.Identity()
        self.dec_final_norm = make_norm(cfg) if pre else nn.Identity()
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.lm_head_bias)
        self.apply(self._init_weights)
        # Token tables keep init_std even when scaled by sqrt(C). fairseq's N(0, C^-1/2) gives the
        # scaled embedding unit variance, but with a tied output it makes the untrained model
        # predict its own input token with logit ~sqrt(C): small models then sit on a plateau
        # for hundreds of steps (measured on a copy task; untied it does not matter).
        for bias in (self.enc_rel, self.dec_rel):
            if bias is not None:
                nn.init.normal_(bias.weight, 0.0, cfg.init_std)
        if cfg.tie_embeddings:  # the output projection is the decoder's token table
            self.lm_head.weight = self.dec_tok_emb.weight

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.cfg.init_std)

    @property
    def decoder_start_token_id(self) -> int:
        start = self.cfg.decoder_start_token_id
        if start is None:
            start = self.cfg.bos_token_id
        if start is None:
            raise ValueError(
                "this model has neither decoder_start_token_id nor bos_token_id: set one in the "
                "config so decoding knows which token starts the target"
            )
        return start

    def new_cache(
        self, batch_size: int, max_seq_len: int | None = None, dtype: torch.dtype | None = None
    ) -> Seq2SeqCache:
        """An empty decoder cache for `batch_size` sources and up to max_seq_len target tokens."""
        param = self.tok_emb.weight
        self_attn = KVCache.for_config(
            self.cfg, batch_size, max_seq_len, dtype or param.dtype, param.device
        )
        cross_attn = CrossAttentionCache(self.cfg.n_layers, batch_size, self_attn.max_seq_len)
        return Seq2SeqCache(self_attn, cross_attn)

    # --- inputs and embeddings ----------------------------------------------------------------

    def _check_ids(self, ids: Tensor, name: str, end: int) -> None:
        if ids.dim() != 2:
            raise ValueError(f"{name} must be (batch, time), got shape {tuple(ids.shape)}")
        check_token_ids(ids, self.cfg.vocab_size)
        if self.enc_pos is not None and end > self.cfg.max_seq_len:
            raise ValueError(
                f"{name}: {end} positions is more than max_seq_len={self.cfg.max_seq_len}, the "
                f"most this model's {self.cfg.position} positions know: truncate the input"
            )

    def _embed(
        self, ids: Tensor, table: nn.Embedding, pos: nn.Module | None, norm: nn.Module, start: int
    ) -> Tensor:
        x = table(ids) * self.emb_scale  # (B, T, C)
        if pos is not None:
            T = ids.shape[1]
            offset = self.cfg.position_offset
            x = x + pos(torch.arange(start + offset, start + offset + T, device=ids.device)[None])
        return self.drop(norm(x))

    def _self_mask(
        self, n_queries: int, n_keys: int, causal: bool, padding_mask: Tensor | None, device
    ) -> AttentionMask:
        mask = attention_mask(
            torch.arange(n_keys - n_queries, n_keys, device=device),  # the newest positions
            torch.arange(n_keys, device=device),
            causal=causal,
            sliding_window=self.cfg.sliding_window,
            padding_mask=padding_mask,
            alibi_slopes=getattr(self, "alibi_slopes", None),
        )
        relative = self.dec_rel if causal else self.enc_rel
        if relative is not None:
            q_positions = torch.arange(n_keys - n_queries, n_keys, device=device)
            mask.bias = relative(q_positions, torch.arange(n_keys, device=device))
        return mask

    def _rope(self, start: int, n_tokens: int, device) -> tuple[Tensor, Tensor] | None:
        if self.rope is None:
            return None
        return self.rope(torch.arange(start, start + n_tokens, device=device)[None])

    @staticmethod
    def _check_padding(src_padding_mask: Tensor | None, batch_size: int, n_source: int) -> None:
        if src_padding_mask is not None and tuple(src_padding_mask.shape) != (
            batch_size,
            n_source,
        ):
            raise ValueError(
                f"src_padding_mask has shape {tuple(src_padding_mask.shape)}, the source "
                f"{(batch_size, n_source)}: give one True/1 per real token, False/0 per pad"
            )

    # --- encoder and decoder ------------------------------------------------------------------

    def encode(self, src_ids: Tensor, src_padding_mask: Tensor | None = None) -> Tensor:
        """(B, S) source ids -> (B, S, C) memory; every position sees the whole source."""
        self._check_ids(src_ids, "src_ids", src_ids.shape[1])
        B, S = src_ids.shape
        self._check_padding(src_padding_mask, B, S)
        x = self._embed(src_ids, self.tok_emb, self.enc_pos, self.enc_emb_norm, 0)  # (B, S, C)
        mask = self._self_mask(S, S, False, src_padding_mask, x.device)
        rope = self._rope(0, S, x.device)
        for block in self.encoder:
            x = block(x, mask, rope)
        return self.enc_final_norm(x)

    def decode(
        self,
        tgt_ids: Tensor,
        memory: Tensor,
        src_padding_mask: Tensor | None = None,
        cache: Seq2SeqCache | None = None,
        last_token_only: bool = False,
        start: int = 0,
    ) -> Tensor:
        """(B, T) target ids and (B, S, C) memory -> (B, T, V) next-token logits.

        Each target position sees itself and the positions before it, and the whole source.
        cache: from new_cache(), holding target positions 0..start-1 of every row.
        start: the target position of tgt_ids[:, 0] (the caller counts; the cache does not).
        """
        if start and cache is None:
            raise ValueError(
                f"start={start} without a cache: the target positions before it are not held "
                "anywhere; pass the cache that holds them, or the whole target with start=0"
            )
        self._check_ids(tgt_ids, "tgt_ids", start + tgt_ids.shape[1])
        B, T = tgt_ids.shape
        self._check_padding(src_padding_mask, B, memory.shape[1])
        x = self._embed(tgt_ids, self.dec_tok_emb, self.dec_pos, self.dec_emb_norm, start)
        self_mask = self._self_mask(T, start + T, True, None, x.device)
        cross_mask = attention_mask(
            torch.arange(T, device=x.device),
            torch.arange(memory.shape[1], device=x.device),
            causal=False,
            padding_mask=src_padding_mask,
        )
        rope = self._rope(start, T, x.device)
        positions = torch.arange(start, start + T, device=x.device)
        if cache is not None:
            cache.self_attn.begin(positions)  # the keys: positions 0..start + T - 1, as masked
        for block in self.decoder:
            x = block(
                x,
                self_mask,
                rope,
                cache.self_attn if cache is not None else None,
                context=memory,
                context_mask=cross_mask,
                cross_cache=cache.cross_attn if cache is not None else None,
                positions=positions,
            )
        x = self.dec_final_norm(x)
        if last_token_only:
            x = x[:, -1:]  # (B, 1, C)
        return self.lm_head(x * self.cfg.output_scale)  # (B, T, V)

    def forward(
        self, src_ids: Tensor, tgt_ids: Tensor, src_padding_mask: Tensor | None = None
    ) -> Tensor:
        """Teacher forcing: (B, S) source, (B, T) decoder input -> (B, T, V) logits."""
        memory = self.encode(src_ids, src_padding_mask)
        return self.decode(tgt_ids, memory, src_padding_mask)

    def loss(
        self,
        src_ids: Tensor,
        tgt_ids: Tensor,
        targets: Tensor,
        src_padding_mask: Tensor | None = None,
    ) -> LossOutput:
        """Label-smoothed cross-entropy (the paper's eps_ls, cfg.label_smoothing) over the target
        positions; ce_loss is the plain cross-entropy.

        tgt_ids: (B, T) decoder input, starting with the decoder start token.
        targets: (B, T) the next id at each position, -100 where no loss is wanted (padding)."""
        logits = self(src_ids, tgt_ids, src_padding_mask)  # (B, T, V)
        smoothed, ce = label_smoothed_cross_entropy(logits, targets, self.cfg.label_smoothing)
        aux = self.moe_aux_loss()
        return LossOutput(
            loss=smoothed + self.cfg.moe_aux_loss_coef * aux, ce_loss=ce.detach(), aux_loss=aux
        )

    def moe_aux_loss(self) -> Tensor:
        return moe_aux_loss(self)

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device


def label_smoothed_cross_entropy(
    logits: Tensor, targets: Tensor, smoothing: float
) -> tuple[Tensor, Tensor]:
    """(smoothed loss, plain cross-entropy), both averaged over targets != -100.

    The smoothed target puts 1 - eps on the right token and eps spread evenly over the whole
    vocabulary: loss = (1 - eps) * (-log p_y) + eps * mean_v(-log p_v)."""
    log_probs = logits.float().log_softmax(dim=-1)  # (B, T, V)
    keep = targets != -100  # (B, T)
    if not bool(keep.any()):  # nothing to predict in this batch: no signal, no NaN
        zero = logits.sum() * 0.0
        return zero, zero
    log_probs = log_probs[keep]  # (N, V)
    nll = -log_probs.gather(-1, targets[keep][:, None]).squeeze(-1)  # (N,)
    uniform = -log_probs.mean(dim=-1)  # (N,)
    smoothed = ((1.0 - smoothing) * nll + smoothing * uniform).mean()
    return smoothed, nll.mean()
