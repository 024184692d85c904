"""Induction heads, measured (seed 000 §4.2; Olsson et al. 2022): the attention-only GPT they were
first described in, rows of random tokens repeated twice, each head's prefix-matching score (the
attention a second-copy query puts on the token after its earlier occurrence), and the losses on
the two copies with and without chosen heads. lab/exp_induction_heads.py runs the experiment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.inspect import capture
from glassformer.models import build_model


class NoFFN(nn.Module):
    """What a block's FFN adds to the residual stream in an attention-only model: nothing.
    (ModelConfig has no ffn="none"; the block's x + ffn(norm(x)) then passes x through.)"""

    def forward(self, x: Tensor) -> Tensor:
        return torch.zeros_like(x)


def attention_only(cfg: ModelConfig) -> nn.Module:
    """A glassformer GPT of `cfg` with every FFN (and its norm) removed: attention layers only,
    the setting in which induction heads were first described."""
    model = build_model(cfg)
    for block in model.blocks:
        block.ffn, block.ffn_norm = NoFFN(), nn.Identity()
    return model


def repeated_random(vocab: list[int], n: int, length: int, seed: int) -> Tensor:
    """(n, 2 * length) rows [x1..xR, x1..xR] of tokens drawn uniformly from `vocab`."""
    return repeated(vocab, n, length, torch.Generator().manual_seed(seed))


def repeated(vocab: list[int], n: int, length: int, generator: torch.Generator) -> Tensor:
    """repeated_random's rows, drawn from `generator` (a training step's own, for fresh rows)."""
    picks = torch.randint(0, len(vocab), (n, length), generator=generator)
    first = torch.tensor(vocab)[picks]  # (n, R)
    return torch.cat([first, first], dim=1)  # (n, 2R)


@torch.no_grad()
def induction_scores(model: nn.Module, ids: Tensor) -> tuple[Tensor, Tensor]:
    """(B, L, H) each sequence's mean attention from second-copy positions i to i - R + 1, and
    the per-position next-token loss (B, 2R - 1) of the same forward pass."""
    length = ids.shape[1] // 2
    with capture(model, residual=False) as cap:
        logits = model(ids)  # (B, 2R, V)
    queries = torch.arange(length, 2 * length)  # the second copy
    keys = queries - length + 1  # the token after the previous occurrence
    scores = torch.stack(
        [
            cap.attention[layer][:, :, queries, keys].float().mean(dim=2)  # (B, H)
            for layer in range(len(cap.attention))
        ],
        dim=1,
    )
    return scores, next_token_loss(logits, ids)  # (B, L, H), (B, 2R - 1)


def next_token_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """(B, T - 1): the cross-entropy of each position's prediction of the token after it."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), ids[:, 1:], reduction="none")


def chosen_head(scores: Tensor) -> tuple[tuple[int, int], float]:
    """The (layer, head) scoring highest on the first half of the sequences of `scores`
    (B, L, H), and its mean score on the second half: choosing and measuring are disjoint."""
    half = scores.shape[0] // 2
    if half == 0:
        raise ValueError("choosing a head on held-out sequences needs at least 2 sequences")
    choose, measure = scores[:half].mean(dim=0), scores[half:].mean(dim=0)  # (L, H) each
    layer, head = divmod(int(choose.argmax()), choose.shape[1])
    return (layer, head), measure[layer, head].item()


def as_spec(heads: list[tuple[int, int]]) -> dict[int, list[int]]:
    """[(layer, head), ...] as ablate_heads' {layer: [head, ...]}."""
    spec: dict[int, list[int]] = {}
    for layer, head in heads:
        spec.setdefault(layer, []).append(head)
    return spec


def copy_losses(loss: Tensor, length: int) -> tuple[float, float]:
    """Mean loss predicting x2..xR in the first copy and in the second. Prediction at position
    t targets token t + 1; the step from the first copy into the second (x1 again) is left out."""
    first = loss[:, : length - 1]  # targets x2..xR of the first copy
    second = loss[:, length:]  # targets x2..xR of the second copy
    return first.mean().item(), second.mean().item()


def copying_lost(first: float, second: float, ablated_second: float) -> float:
    """The share of the 2nd copy's advantage over the 1st that is gone with a head switched
    off: 0 the head does not matter, 1 the 2nd copy is as unpredictable as the 1st."""
    gain = first - second
    return (ablated_second - second) / gain if gain > 0 else float("nan")
