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
    if not _whole(top_k) or top_k < 1:
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


def _whole(value: object) -> bool:
    """An int that is not a bool (True is an int in Python; as a count it is a mistake)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_max_new_tokens(max_new_tokens: int) -> None:
    if not _whole(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens!r} is not allowed: use a whole number >= 1"
        )


GREEDY_BELOW = 1e-5  # temperatures this small sample as greedy (see SamplingParams.is_greedy)
MAX_SEED = 2**64 - 1  # torch.Generator takes a 64-bit unsigned seed


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with `seed` (None: the global RNG, so no generator)."""
    if seed is None:
        return None
    if not _whole(seed) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed!r} is not allowed: use a whole number in 0..2**64-1")
    return torch.Generator(device=device).manual_seed(seed)


NO_EOS = -1  # eos_token_id=NO_EOS: generate all max_new_tokens, whatever the model samples


def resolve_eos(eos_token_id: int | None, cfg) -> int | None:
    """The end-of-sequence id to stop at (default: the model config's; NO_EOS: none), checked
    against the vocabulary: an id the model can never produce would silently stop nothing."""
    if eos_token_id == NO_EOS:
        return None
    if eos_token_id is None:
        # A config's own id outside its vocabulary (tiny test models keep GPT-2's 50256) can
        # never be sampled, so it stops nothing: the same as no end token.
        eos = cfg.eos_token_id
        return eos if eos is not None and 0 <= eos < cfg.vocab_size else None
    if not _whole(eos_token_id) or not 0 <= eos_token_id < cfg.vocab_size:
        raise ValueError(
            f"eos_token_id={eos_token_id!r} is outside the vocabulary: use an id in "
            f"0..{cfg.vocab_size - 1}, None for the model's own, or NO_EOS (-1) for none"
        )
    return eos_token_id


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
        # Below GREEDY_BELOW every logit gap over 0.001 is scaled past exp()'s float32 range,
        # and a subnormal temperature is 0 in float32 (0/0 = NaN): both are argmax.
        return self.temperature < GREEDY_BELOW


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
