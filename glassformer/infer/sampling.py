"""The sampler: how one next token is picked from the logits (seed 002 "采样", seed 000 §2.5).

Step ⑥ of the seed's pipeline: temperature reshapes the distribution, top-k and top-p cut its
tail, then one token is drawn. Temperature 0 is greedy ("temperature=0 就是每步都选分数最高的词").
Before that the logits processors move single logits: logit_bias, the min_tokens ban on the end
tokens, and the repetition penalties (infer/rows.py applies them per row).
Shapes: B batch, V vocab, N the token ids a processor touches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from glassformer import kernels
from glassformer.infer.constrain import Constraint, check_constraint, constraint_from
from glassformer.models.common import all_finite


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


def _check_thinking(think_ids: tuple[int, int] | None, budget: int | None) -> None:
    if budget is not None and not (_whole(budget) and budget >= 0):
        raise ValueError(
            f"thinking_budget={budget!r} is not allowed: use a whole number >= 0 (the most "
            "thinking tokens before the answer; 0 answers at once), or None for no limit"
        )
    if think_ids is not None and not (
        len(think_ids) == 2 and all(_whole(i) and i >= 0 for i in think_ids)
    ):
        raise ValueError(f"think_ids={think_ids!r} must be two token ids: (start, end) markers")
    if budget is not None and think_ids is None:
        raise ValueError(
            "thinking_budget needs the model's thinking markers (think_ids): this model's "
            "tokenizer has none, or they were not passed"
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


def _check_min_p(min_p: float | None) -> None:
    if min_p is None:
        return
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p <= 1:
        raise ValueError(
            f"min_p={min_p!r} is not allowed: use a number in [0, 1] such as 0.05 (keep tokens "
            "at least that fraction as likely as the most likely one), or None"
        )


def _stop_strings(stop: object) -> tuple[str, ...]:
    """`stop` as a tuple of non-empty strings (one string is one stop string, as in OpenAI's
    API); anything else is an error naming the entry and where token ids go."""
    entries = (stop,) if isinstance(stop, str) else stop
    if not isinstance(entries, (list, tuple)):
        raise ValueError(
            f"stop={stop!r} is not allowed: give a string or a list of strings; stop token "
            "ids go in stop_token_ids"
        )
    for entry in entries:
        if not isinstance(entry, str):
            hint = "put token ids in stop_token_ids" if _whole(entry) else "use strings"
            raise ValueError(
                f"stop entry {entry!r} ({type(entry).__name__}) is not a stop string: {hint}"
            )
        if not entry:
            raise ValueError("stop entry '' would stop at once: give non-empty strings")
    return tuple(entries)


MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one bias: -100 bans a token, 100 all but forces it
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias entries per request


def normalize_logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """logit_bias (a mapping {token id: bias}, or (id, bias) pairs) as (id, bias) pairs sorted
    by id, so the frozen SamplingParams stays hashable and equal params compare equal. The
    ids are checked against a vocabulary where one is known (check_logit_bias_ids)."""
    pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
    if not isinstance(pairs, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs
    ):
        raise ValueError(
            f"logit_bias={bias!r} is not allowed: give a mapping from token id to bias, e.g. "
            "{50256: -100}"
        )
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(
            f"logit_bias has {len(pairs)} entries: at most {MAX_LOGIT_BIAS_ENTRIES} are allowed "
            "(OpenAI's limit); bias fewer tokens"
        )
    checked: dict[int, float] = {}
    for token, value in pairs:
        if not (_whole(token) and token >= 0):
            raise ValueError(
                f"logit_bias key {token!r} is not a token id: use whole numbers >= 0 from the "
                "tokenizer"
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS  # NaN fails this too
        ):
            raise ValueError(
                f"logit_bias gives token {token} the bias {value!r}: use a number in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] (-100 bans the token, 100 all but "
                "forces it, 0 is off)"
            )
        if token in checked:
            raise ValueError(f"logit_bias gives token {token} two biases: give each id once")
        checked[token] = float(value)
    return tuple(sorted(checked.items()))


def check_logit_bias_ids(logit_bias: Mapping[int, float] | tuple, vocab_size: int) -> None:
    """Every logit_bias id inside the vocabulary: a bias on an id the model cannot produce
    would silently do nothing (and index past the logits)."""
    ids = logit_bias.keys() if isinstance(logit_bias, Mapping) else [t for t, _ in logit_bias]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"logit_bias names token {bad[0]}, outside the vocabulary of {vocab_size} tokens "
            f"(ids 0..{vocab_size - 1}): use ids from the model's tokenizer"
        )


def _check_min_tokens(min_tokens: object, max_new_tokens: int) -> None:
    if not (_whole(min_tokens) and min_tokens >= 0):
        raise ValueError(
            f"min_tokens={min_tokens!r} is not allowed: use a whole number >= 0 (0 = off)"
        )
    if min_tokens > max_new_tokens:
        raise ValueError(
            f"min_tokens={min_tokens} exceeds max_new_tokens={max_new_tokens}: the row could "
            "never generate that many; lower min_tokens or raise max_new_tokens"
        )


def _stop_token_ids(ids: object) -> tuple[int, ...]:
    entries = (ids,) if _whole(ids) else ids
    if not isinstance(entries, (list, tuple)) or not all(_whole(i) and i >= 0 for i in entries):
        raise ValueError(
            f"stop_token_ids={ids!r} is not allowed: give a list of token ids (whole numbers "
            ">= 0); stop strings go in stop"
        )
    return tuple(entries)


@dataclass(frozen=True)
class SamplingParams:
    """How one row picks its tokens and when it stops (vLLM's SamplingParams in miniature).

    Each logits row goes through repetition_penalty and the presence/frequency penalties (on
    the raw logits), then temperature, top-k, top-p and min-p, in transformers' order. A row
    stops at its end-of-sequence id (eos_token_id: None for the model's own, NO_EOS for none),
    at any of stop_token_ids, once its text contains a stop string (needs the Engine's
    tokenizer), or after max_new_tokens.
    min_tokens: vLLM's: neither the end-of-sequence id nor any stop token id can be sampled
    (their logits are -inf) until min_tokens tokens are generated, and stop strings match only
    in the text after them; at most max_new_tokens.
    logit_bias: OpenAI's {token id: bias}, bias in [-100, 100] added to the token's logit
    before the penalties and every sampling cut, greedy included (stored as sorted pairs).
    seed: the row's own generator, so its draws do not depend on the rows beside it.
    presence_penalty / frequency_penalty: OpenAI's penalties, subtracted from the logit of each
    token already generated (once, or once per time it was generated); see penalize_counts.
    logprobs: record each new token's log-probability and that many top candidates (0: the
    chosen token's only), under the distribution after the logits processors (logit_bias, the
    min_tokens ban, the penalties) and before temperature and the cuts; see token_logprobs.
    think_ids: (start, end) ids of the model's thinking markers (<think>, </think>; see
    infer/thinking.py): the row then tells thinking tokens from answer tokens.
    thinking_budget: at most this many tokens inside a thinking segment; when they are spent
    the row emits the end marker itself and the model goes on to answer (None: no limit).
    json_schema / regex / grammar: at most one; the answer must match it (infer/constrain.py):
    a JSON Schema (a dict or JSON text, stored as JSON text), a regex the whole answer matches,
    or a Lark grammar (llguidance's dialect). Each step's logits are masked to the tokens it
    allows after the penalties and before temperature and the cuts; the row stops ("stop")
    when the answer is complete. A thinking segment is not constrained, the answer after it is.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    think_ids: tuple[int, int] | None = None
    thinking_budget: int | None = None
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    json_schema: Mapping[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)
        _check_top_k(self.top_k)
        _check_top_p(self.top_p)
        _check_min_p(self.min_p)
        penalty = self.repetition_penalty
        if (
            isinstance(penalty, bool)
            or not isinstance(penalty, (int, float))
            or not (math.isfinite(penalty) and penalty > 0)
        ):
            raise ValueError(
                f"repetition_penalty={penalty!r} is not allowed: use a number > 0 (1 = off, "
                "1.1-1.3 discourages repeats)"
            )
        check_max_new_tokens(self.max_new_tokens)
        _check_min_tokens(self.min_tokens, self.max_new_tokens)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is not allowed: use a number (0 = off)")
            if not math.isfinite(value):
                raise ValueError(f"{name}={value!r} is not allowed: use a finite number")
        if self.logprobs is not None and not (_whole(self.logprobs) and self.logprobs >= 0):
            raise ValueError(
                f"logprobs={self.logprobs!r} is not allowed: use a whole number >= 0 (the top "
                "candidates to record per token), or None to record none"
            )
        _check_thinking(self.think_ids, self.thinking_budget)
        make_generator(self.seed)  # checks the seed
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", normalize_logit_bias(self.logit_bias))
        constraint = constraint_from(self.json_schema, self.regex, self.grammar)
        if constraint is not None:
            check_constraint(constraint)
            if constraint.kind == "json_schema":  # as JSON text, so the params stay hashable
                object.__setattr__(self, "json_schema", constraint.source)

    @property
    def constraint(self) -> Constraint | None:
        """What the answer must match (infer/constrain.py), or None."""
        return constraint_from(self.json_schema, self.regex, self.grammar)

    @property
    def is_greedy(self) -> bool:
        # Below GREEDY_BELOW every logit gap over 0.001 is scaled past exp()'s float32 range,
        # and a subnormal temperature is 0 in float32 (0/0 = NaN): both are argmax.
        return self.temperature < GREEDY_BELOW


def bias_logits(logits: Tensor, ids: Tensor, biases: Tensor) -> Tensor:
    """OpenAI's logit_bias: add biases (N,) to the logits (B, V) of the token ids (N,)."""
    return logits.index_add(-1, ids, biases.to(logits.dtype).expand(logits.shape[0], -1))


def ban_tokens(logits: Tensor, ids: Tensor) -> Tensor:
    """Make the token ids (N,) impossible: their logits (B, V) become -inf (min_tokens bans the
    end tokens so; softmax gives them probability 0 and argmax never picks them)."""
    return logits.index_fill(-1, ids, float("-inf"))


def penalize_repetition(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019), as transformers applies it: the logit of
    every token already in the sequence seen (B, S) is divided by `penalty` when positive and
    multiplied by it when negative, so a penalty > 1 always makes a repeat less likely."""
    if penalty == 1.0:
        return logits
    scores = logits.gather(-1, seen)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(-1, seen, scores)


def penalize_counts(logits: Tensor, generated: Tensor, presence: float, frequency: float) -> Tensor:
    """OpenAI's presence and frequency penalties on logits (1, V), given the ids generated so
    far (N,): a token generated c times loses presence * (c > 0) + frequency * c, so positive
    values push the text towards new tokens (vLLM likewise counts the generated tokens only)."""
    if (presence == 0 and frequency == 0) or generated.numel() == 0:
        return logits
    counts = torch.bincount(generated, minlength=logits.shape[-1]).to(logits.dtype)  # (V,)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and the most likely candidates at its step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


def token_logprobs(logits: Tensor, token_id: int, n_top: int) -> TokenLogprob:
    """The log-probability of token_id under softmax(logits (1, V)), and the n_top most likely
    tokens with theirs (no temperature, no cuts). A token a processor banned (-inf) is no
    candidate, so fewer than n_top come back when fewer are possible."""
    logp = torch.log_softmax(logits.float(), dim=-1)[0]  # (V,)
    n_top = min(n_top, int(torch.isfinite(logp).sum()))
    top = torch.topk(logp, n_top) if n_top else None
    pairs = (
        () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    )
    return TokenLogprob(token_id, float(logp[token_id]), pairs)


def filter_logits(
    logits: Tensor, top_k: int | None = None, top_p: float | None = None, min_p: float | None = None
) -> Tensor:
    """Set the logits that top-k, then top-p, then min-p cut away to -inf; a new tensor [B, V].

    top-k keeps every token whose logit is >= the k-th largest, so a tie at the k-th place
    keeps all tied tokens (more than k). top-p keeps the smallest set of most likely tokens
    whose probability mass is >= top_p (at least the top token), again keeping every token
    tied with the least likely one kept, so the result never depends on how sort breaks ties.
    """
    _check_top_k(top_k)
    _check_top_p(top_p)
    _check_min_p(min_p)
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
    if min_p is not None and min_p > 0:
        # Keep the tokens at least min_p times as likely as the most likely one (the top token
        # always survives: its ratio is 1).
        probs = torch.softmax(logits.float(), dim=-1)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def check_finite_logits(logits: Tensor, where: str) -> None:
    """Refuse to sample from logits with a NaN or infinite value: a model whose weights or
    adapter are broken would otherwise pick garbage (argmax of NaN is token 0) and succeed.
    One sum over the row's V values (models/common.all_finite), next to the forward pass that
    made them."""
    if all_finite(logits):
        return
    bad = logits.numel() - int(torch.isfinite(logits).sum())
    raise ValueError(
        f"{where} are NaN/inf ({bad:,} of {logits.numel():,} values): its weights or adapter "
        "are broken (a diverged training run, a damaged file, an adapter whose update "
        "overflows); load an earlier checkpoint, or the model without --adapter, to compare"
    )


def sampling_distribution(logits: Tensor, params: SamplingParams) -> Tensor:
    """The float32 probabilities [B, V] that `sample` draws from; one-hot argmax when greedy."""
    logits = logits.float()
    if params.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    # Subtracting the row max first changes no probability but keeps a tiny temperature from
    # overflowing the scaled logits to inf (inf - inf would turn softmax into NaN).
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    scaled = shifted / params.temperature
    return torch.softmax(filter_logits(scaled, params.top_k, params.top_p, params.min_p), dim=-1)


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
        return kernels.argmax(logits)  # torch's argmax, in a tenth of its time (matvec.c)
    probs = sampling_distribution(logits, params)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
