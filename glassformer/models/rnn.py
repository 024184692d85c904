"""RNNLM: the recurrent language model that came before the Transformer (seed 000 §1).

Shapes: B batch, T time, C channels (d_model = hidden size), L layers, V vocab.

token ids -> embedding -> L x recurrent layer -> final norm -> lm_head -> logits. The cell is the
tutorial's h_t = tanh(W_xh x_t + W_hh h_{t-1} + b) written out (cell="rnn"), or torch's LSTM or
GRU. The lm_head is the tutorial's W_ho: o_t = W_ho h_t. The generation "cache" is the hidden
state: a fixed number of bytes however long the context, where a Transformer's KV cache grows with
every token (seed 000 §2.5.1).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.models.common import LossOutput, check_token_ids, init_weights
from glassformer.nn.norm import make_norm


class RNNCell(nn.Module):
    """The seed's MyRNNCell without its output matrix (the LM's lm_head plays W_ho):
    h_t = tanh(W_xh x_t + W_hh h_{t-1} + b), with b split over the two Linears as in torch."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.W_xh = nn.Linear(input_size, hidden_size)  # the current input
        self.W_hh = nn.Linear(hidden_size, hidden_size)  # the previous memory
        bound = 1.0 / math.sqrt(hidden_size)  # torch.nn.RNN's init
        for param in self.parameters():
            nn.init.uniform_(param, -bound, bound)

    def forward(self, x_t: Tensor, h_prev: Tensor) -> Tensor:
        """One time step: (B, C_in), (B, C) -> (B, C)."""
        return torch.tanh(self.W_xh(x_t) + self.W_hh(h_prev))


class RNNLayer(nn.Module):
    """RNNCell looped over time. Only the recurrence is sequential: W_xh x_t has no dependence
    on the past, so it runs for all T positions in one matmul first."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.cell = RNNCell(input_size, hidden_size)

    def forward(self, x: Tensor, h: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x (B, T, C_in), h (B, C) -> outputs (B, T, C), last h (B, C).

        keep: (B, T) 1.0 to carry the state into position t, 0.0 to restart it (a new document)."""
        x_proj = self.cell.W_xh(x)  # (B, T, C)
        outputs = []
        for t in range(x.shape[1]):
            if keep is not None:
                h = h * keep[:, t, None]
            h = torch.tanh(x_proj[:, t] + self.cell.W_hh(h))  # (B, C)
            outputs.append(h)
        return torch.stack(outputs, dim=1), h


class RNNState:
    """The RNN's generation cache: the hidden state of every layer (and the LSTM's cell state).

    It is a Cache (nn/kv_cache.py) like the KV caches (max_seq_len, rows, swap_rows, reset,
    row_bytes, nbytes), but its size does not depend on the context length. max_seq_len is
    bookkeeping, not memory: it defaults to the config's max_seq_len, the window the model was
    trained on, so the Engine stops (or shifts its window) where the model's training
    experience ends, as for GPT.
    """

    rewinds = False  # the state after n tokens cannot give back the state after fewer

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        hidden_size: int,
        cell: str,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        shape = (n_layers, batch_size, hidden_size)
        self.h = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, C)
        self.c = torch.zeros(shape, dtype=dtype, device=device) if cell == "lstm" else None
        self.max_seq_len = max_seq_len

    def layer_state(self, layer: int) -> Tensor | tuple[Tensor, Tensor]:
        """The state layer `layer` starts from: (B, C) h, or (h, c) for an LSTM."""
        if self.c is None:
            return self.h[layer]
        return self.h[layer], self.c[layer]

    def write(self, layer: int, state: Tensor | tuple[Tensor, Tensor]) -> None:
        if self.c is None:
            self.h[layer] = state
        else:
            self.h[layer], self.c[layer] = state

    def rows(self, start: int, stop: int) -> RNNState:
        """The state of batch rows start..stop-1 only: a view, so its writes land here."""
        view = copy.copy(self)
        view.h = self.h[:, start:stop]
        view.c = None if self.c is None else self.c[:, start:stop]
        return view

    def swap_rows(self, a: int, b: int, n_positions: int | None = None) -> None:
        """Exchange two rows' states (n_positions: unused, a state has no positions)."""
        for state in (self.h, self.c):
            if state is not None:
                state[:, [a, b]] = state[:, [b, a]]  # the right side is a copy

    @property
    def batch_size(self) -> int:
        return self.h.shape[1]

    def row_bytes(self, length: int) -> int:
        """One row's state: the same bytes at every length (none before the first token)."""
        return self.nbytes // self.batch_size if length else 0

    def reset(self) -> None:
        self.h.zero_()
        if self.c is not None:
            self.c.zero_()

    @property
    def nbytes(self) -> int:
        """Bytes of the state: L * B * C numbers (twice that for an LSTM), at any length."""
        return self.h.nbytes + (self.c.nbytes if self.c is not None else 0)


class RNNLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        C = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, C)
        self.drop = nn.Dropout(cfg.dropout)
        self.rnn_layers = nn.ModuleList(self._make_layer(cfg.cell, C) for _ in range(cfg.n_layers))
        # As in GPT: a pre-norm stack ends with a norm, so the head sees unit-scale features.
        self.final_norm = make_norm(cfg) if cfg.norm_position == "pre" else nn.Identity()
        self.lm_head = nn.Linear(C, cfg.vocab_size, bias=False)  # the tutorial's W_ho
        init_weights(self.lm_head, cfg.init_std)
        # The recurrent weights keep torch's U(-1/sqrt(C), 1/sqrt(C)). Embeddings get std
        # 1/sqrt(C) (unit-length vectors) so x_t enters the gates at the scale h_{t-1} does; at
        # GPT's N(0, 0.02) the input is ~20x weaker than the memory and learning starts slower
        # (tiny LSTM, 60 steps: val loss 2.41 vs 2.56).
        nn.init.normal_(self.tok_emb.weight, 0.0, 1.0 / math.sqrt(C))
        if cfg.tie_embeddings:  # the last hidden size is d_model, so the shapes always match
            self.lm_head.weight = self.tok_emb.weight

    @staticmethod
    def _make_layer(cell: str, size: int) -> nn.Module:
        if cell == "rnn":
            return RNNLayer(size, size)
        module = nn.LSTM if cell == "lstm" else nn.GRU
        return module(size, size, batch_first=True)

    def new_cache(
        self, batch_size: int = 1, max_seq_len: int | None = None, dtype: torch.dtype | None = None
    ) -> RNNState:
        """An empty (zero) hidden state for generation."""
        param = self.tok_emb.weight
        return RNNState(
            self.cfg.n_layers,
            batch_size,
            self.cfg.d_model,
            self.cfg.cell,
            max_seq_len or self.cfg.max_seq_len,
            dtype=dtype or param.dtype,
            device=param.device,
        )

    # --- forward ------------------------------------------------------------------------------

    def _run_layer(
        self, layer: nn.Module, x: Tensor, state: Tensor | tuple, keep: Tensor | None
    ) -> tuple[Tensor, Tensor | tuple]:
        """One layer over (B, T, C) from state ((B, C) h, or (h, c) for an LSTM)."""
        if isinstance(layer, RNNLayer):
            return layer(x, state, keep)
        batched = tuple(s[None] for s in state) if isinstance(state, tuple) else state[None]
        if keep is None:  # torch's fused kernel over the whole sequence
            out, last = layer(x, batched)
        else:  # a document boundary inside the sequence: step, restarting the state there
            outs = []
            for t in range(x.shape[1]):
                batched = _scale(batched, keep[None, :, t, None])  # restart: x 0
                out_t, batched = layer(x[:, t : t + 1], batched)
                outs.append(out_t)
            out, last = torch.cat(outs, dim=1), batched
        return out, tuple(s[0] for s in last) if isinstance(last, tuple) else last[0]

    def hidden_states(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        *,
        cache: RNNState | None = None,
        position_ids: Tensor | None = None,
        padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """(B, T) ids -> (B, T, C) final hidden states (after the final norm).

        positions, position_ids: ignored: an RNN gets order for free by reading in order
            (seed 000 §1.2).
        cache: an RNNState from new_cache(); the input continues from its hidden state.
        padding_mask: bool (B, cached + T), True for real tokens; only right padding is allowed
            (pads after the real tokens cannot reach them in a causal recurrence).
        document_ids: (B, cached + T) ids of packed documents; the state restarts at zero where
            a new document begins.
        """
        del positions, position_ids
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, time), got shape {tuple(input_ids.shape)}")
        check_token_ids(input_ids, self.cfg.vocab_size)
        B, T = input_ids.shape
        _check_right_padding(padding_mask)
        keep = _keep_state(document_ids, T, self.tok_emb.weight)
        if cache is None:
            cache = self.new_cache(B, dtype=self.tok_emb.weight.dtype)
            state_out = None
        else:
            state_out = cache
        x = self.drop(self.tok_emb(input_ids))  # (B, T, C)
        for i, layer in enumerate(self.rnn_layers):
            x, last = self._run_layer(layer, x.contiguous(), cache.layer_state(i), keep)
            if state_out is not None:
                state_out.write(i, last)
            if i < len(self.rnn_layers) - 1:
                x = self.drop(x)
        return self.final_norm(x)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        *,
        cache: RNNState | None = None,
        last_token_only: bool = False,
        **inputs: Tensor | None,
    ) -> Tensor:
        """(B, T) token ids -> (B, T, V) next-token logits ((B, 1, V) with last_token_only).
        The arguments are hidden_states'."""
        x = self.hidden_states(input_ids, positions, cache=cache, **inputs)
        if last_token_only:
            x = x[:, -1:]
        return self.lm_head(x)

    def loss(self, input_ids: Tensor, targets: Tensor, **kwargs) -> LossOutput:
        """Next-token cross-entropy at every position; targets -100 where no loss is wanted.
        The recurrence is sequential, but teacher forcing still gives T predictions per pass."""
        logits = self(input_ids, **kwargs)  # (B, T, V)
        ce = F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100
        )
        zero = ce.new_zeros(())
        return LossOutput(loss=ce, ce_loss=ce, aux_loss=zero)

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device


def _scale(state: Tensor | tuple, factor: Tensor) -> Tensor | tuple:
    return tuple(s * factor for s in state) if isinstance(state, tuple) else state * factor


def _check_right_padding(padding_mask: Tensor | None) -> None:
    if padding_mask is None:
        return
    real_after_pad = padding_mask[:, 1:] & ~padding_mask[:, :-1]
    if bool(real_after_pad.any()):
        raise ValueError(
            "RNNLM supports only right padding (real tokens first, then pads): a pad before a "
            "real token would flow into its hidden state; pad on the right instead"
        )


def _keep_state(document_ids: Tensor | None, T: int, like: Tensor) -> Tensor | None:
    """(B, T) 1.0 where a position continues the previous one's document, 0.0 where a new one
    starts; None when no row changes document (then the fused kernels run)."""
    if document_ids is None or document_ids.shape[1] < 2:
        return None
    ids = document_ids[:, -T - 1 :] if document_ids.shape[1] > T else document_ids
    same = ids[:, 1:] == ids[:, :-1]  # (B, len - 1)
    if bool(same.all()):
        return None
    if ids.shape[1] == T:  # nothing before the first position: it continues the given state
        same = torch.cat([torch.ones_like(same[:, :1]), same], dim=1)
    return same.to(device=like.device, dtype=like.dtype)
