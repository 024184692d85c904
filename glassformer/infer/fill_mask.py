"""Fill-mask (seed 000 §6.3, BERT's cloze task): the top candidates for every [MASK] position.

Token ids in, (ids, probabilities) out: one bidirectional forward pass, the masked-LM head at
the masked positions only, a softmax over the vocabulary. Text is the caller's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class MaskCandidates:
    position: int  # index of the [MASK] in the input ids
    token_ids: list[int]  # the top-k ids, most probable first
    probs: list[float]  # their softmax probabilities (sum <= 1)


@torch.no_grad()
def fill_mask(
    model: nn.Module, ids: Sequence[int], mask_token_id: int, top_k: int = 5
) -> list[MaskCandidates]:
    """The top_k candidates at each position of `ids` that holds mask_token_id."""
    cfg = model.cfg
    if cfg.family != "bert" or not cfg.mlm_head:
        raise ValueError(
            f"fill-mask needs a BERT with a masked-LM head, got family={cfg.family!r} "
            f"mlm_head={cfg.mlm_head}: use a BertForMaskedLM folder or an mlm-trained checkpoint"
        )
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=model.device)  # (1, T)
    positions = (input_ids[0] == mask_token_id).nonzero().squeeze(1).tolist()
    if not positions:
        raise ValueError("the input has no [MASK] token: put [MASK] where a word should go")
    hidden = model(input_ids)  # (1, T, C)
    logits = model.mlm_logits(hidden[0, positions])  # (M, V)
    probs = logits.float().softmax(-1)
    top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    return [
        MaskCandidates(position, ids_.tolist(), values.tolist())
        for position, ids_, values in zip(positions, top.indices, top.values, strict=True)
    ]
