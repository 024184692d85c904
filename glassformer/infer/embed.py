"""Sentence embeddings from an encoder (seed 000 §6.3: BERT's "understanding" line, alive today
in the embedding models of retrieval systems).

Token ids in, vectors out: pad the batch, run the encoder with a padding mask, average the
hidden states over the real tokens, L2-normalize. This is the sentence-transformers recipe
(Transformer -> Pooling(mean) -> Normalize) that all-MiniLM-L6-v2 is trained for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Right-pad id lists into (N, T) ids and a bool (N, T) mask, True for real tokens."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("embed needs at least one sequence, and no empty sequence")
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, : len(seq)] = True
    return ids, mask


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """(N, T, C) hidden states, (N, T) mask -> (N, C) average over the real tokens."""
    weights = mask.to(hidden.dtype)[..., None]  # (N, T, 1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


@torch.no_grad()
def embed(
    model: nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    batch_size: int = 32,
    normalize: bool = True,
) -> Tensor:
    """(N, C) sentence vectors for N token-id lists: mean-pooled, unit length by default.

    The model is an encoder (family "bert") whose forward returns (B, T, C) hidden states."""
    cfg = model.cfg
    if cfg.family != "bert":
        raise ValueError(
            f"embed needs an encoder (family 'bert'), got family {cfg.family!r}: load an "
            "embedding model such as --model minilm"
        )
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    device = model.device
    vectors = []
    for start in range(0, len(sequences), batch_size):
        ids, mask = pad_batch(sequences[start : start + batch_size], pad_id)
        ids, mask = ids.to(device), mask.to(device)
        hidden = model(ids, padding_mask=mask)  # (n, T, C)
        vectors.append(mean_pool(hidden.float(), mask))
    if not vectors:
        raise ValueError("embed needs at least one sequence")
    out = torch.cat(vectors)  # (N, C)
    return F.normalize(out, p=2, dim=-1) if normalize else out


def cosine_similarity_matrix(vectors: Tensor) -> Tensor:
    """(N, C) -> (N, N) cosine similarities."""
    unit = F.normalize(vectors.float(), p=2, dim=-1)
    return unit @ unit.T
