"""What every model family shares: the loss record, the token-id check, the weight init and
the finiteness check of a tensor's values.

GPT, BERT, seq2seq and the RNN import these from here rather than from a sibling family's module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassformer import kernels
from glassformer.nn.position import AbsolutePositions


@dataclass
class LossOutput:
    loss: Tensor  # what to backpropagate: cross-entropy + aux_loss_coef * aux_loss
    ce_loss: Tensor  # next-token cross-entropy averaged over target positions
    aux_loss: Tensor  # MoE load-balancing loss summed over layers (0 for dense models)


def init_weights(module: nn.Module, std: float) -> None:
    """N(0, std) for matrices and embedding tables, zeros for biases (GPT-2 / BERT init)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, 0.0, std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding) or (
        isinstance(module, AbsolutePositions) and module.kind == "learned"
    ):
        nn.init.normal_(module.weight, 0.0, std)


def check_token_ids(input_ids: Tensor, vocab_size: int) -> None:
    """A clear error for ids the embedding table does not have (instead of an index error)."""
    if input_ids.numel() == 0:
        raise ValueError("input_ids is empty: give at least one token")
    low, high = (int(x) for x in torch.aminmax(input_ids))
    if low < 0 or high >= vocab_size:
        bad = high if high >= vocab_size else low
        raise ValueError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size}): encode the text with "
            "the tokenizer saved with this model"
        )


# Up to this many values (32 rows of a 150k vocabulary's logits), all_finite asks the C kernel's
# one-thread pass; above, torch's threaded sum
LOGITS_SIZED = 1 << 23


def all_finite(tensor: Tensor) -> bool:
    """Whether no value of a float tensor is NaN or infinite. A step's logits (float32, up to
    LOGITS_SIZED values) go through kernels.all_finite, one pass in C. Otherwise its sum answers
    in one cheap reduction, as NaN and +-inf propagate through a sum: a twentieth of isfinite()
    over every value (6 ms vs 160 ms for SmolLM2's embedding; 10 vs 130 us for one row of its
    logits, one thread). Only a sum that overflowed, which large finite values can do, is
    checked value by value."""
    if tensor.numel() <= LOGITS_SIZED:  # a step's logits: the C kernel's one pass, if built
        found = kernels.all_finite(tensor)
        if found is not None:
            return found
    wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return bool(torch.isfinite(tensor.sum(dtype=wide))) or bool(torch.isfinite(tensor).all())
