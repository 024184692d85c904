"""The sampler: how one next token is picked from the logits (seed 002 "采样", seed 000 §2.5).

Step ⑥ of the seed's pipeline: temperature reshapes the distribution, top-k and top-p cut its
tail, then one token is drawn. Temperature 0 is greedy ("temperature=0 就是每步都选分数最高的词").
Shapes: B batch, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def _check_temperature(temperature: float) -> None:
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature < 0
    ):
        raise ValueError(
            f"temperature={temperature!r} is not allowed: use a finite number >= 0"
            " (0 = greedy, 1 = the model's own distribution, >1 = flatter)"
        )


def _check_top_k(top_k: int | None) -> None:
    if top_k is None:
        return
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(
            f"top_k={top_k!r} is not allowed: use an integer >= 1 (1 = greedy), or None to keep"
            " the whole vocabulary"
        )


def _check_top_p(top_p: float | None) -> None:
    if top_p is None:
        return
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(
            f"top_p={top_p!r} is not allowed: use a number in (0, 1] such as 0.9"
            " (1 = no cut), or None"
        )


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. Temperature is applied first, then top-k, then top-p (as HF)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)
        _check_top_k(self.top_k)
        _check_top_p(self.top_p)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set the logits that top-k and then top-p cut away to -inf; returns a new tensor [B, V].

    top-k keeps every token whose logit is >= the k-th largest, so a tie at the k-th place
    keeps all tied tokens (more than k). top-p keeps the smallest set of most likely tokens
    whose probability mass is >= top_p (at least the top token), again keeping every token
    tied with the least likely one kept, so the result never depends on how sort breaks ties.
    """
    _check_top_k(top_k)
    _check_top_p(top_p)
    vocab_size = logits.shape[-1]
    if top_k is not None and top_k < vocab_size:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values  # (B, V)
        sorted_probs = torch.softmax(sorted_logits.float(), dim=-1)
        # The mass of the tokens strictly ahead of each one: a token is in the nucleus while the
        # tokens before it have not yet reached top_p, which makes the set the smallest one.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        n_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)  # (B, 1)
        least_kept = sorted_logits.gather(-1, n_kept - 1)  # (B, 1)
        logits = logits.masked_fill(logits < least_kept, float("-inf"))
    elif top_k is None or top_k >= vocab_size:
        logits = logits.clone()  # always a new tensor, so callers may modify it in place
    return logits


def sampling_distribution(logits: Tensor, params: SamplingParams) -> Tensor:
    """The float32 probabilities [B, V] that `sample` draws from; one-hot argmax when greedy."""
    logits = logits.float()
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    # Subtracting the row max first changes no probability but keeps a tiny temperature from
    # overflowing the scaled logits to inf (inf - inf would turn softmax into NaN).
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scaled = shifted / params.temperature
    return torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)


def sample(
    logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> Tensor:
    """Pick one token id per row of `logits` [B, V]; returns a LongTensor [B]."""
    if logits.dim() != 2:
        raise ValueError(
            f"logits must be [batch, vocab], got shape {tuple(logits.shape)}: take the last"
            " position first, e.g. logits[:, -1, :]"
        )
    if params.is_greedy:
        return logits.argmax(dim=-1)
    probs = sampling_distribution(logits, params)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
