"""Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023): a cheap draft model proposes k tokens one by one, the target model
checks all of them in ONE forward pass over its KV cache, and every proposal it agrees with is a
token gained for the price of a draft step.

Decoding is memory-bound (seed 000 §2.5.1): one target step reads every weight to make one
token, and a pass over k + 1 tokens reads them once too, so it costs about the same. Greedy
output is exactly the target's own greedy output; with temperature > 0 the rejection rule keeps
the output distributed exactly as the target's. Shapes: V vocab, K proposals in a round.

SpeculativeDecoder is the Engine with another step: one round (the draft's proposals, the
target's one verification pass at explicit positions, the accepted tokens) instead of one
token. Prefill, stop rules, statistics and streaming are the Engine's. Where the models have
fused C steps (infer/fused.py), the draft proposes through its own and the target checks the
round's tokens through its `many`, one call for all of them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassformer.infer.engine import Engine
from glassformer.infer.fused import FusedStep
from glassformer.infer.rows import GenerationStats, Row
from glassformer.infer.sampling import (
    SamplingParams,
    check_finite_logits,
    sample,
    sampling_distribution,
)


@dataclass
class SpeculativeStats(GenerationStats):
    """The Engine's statistics plus the rounds. time_to_first_token_s is the target's prefill
    and the first token; decode_tokens_per_s counts the draft's prefill of the prompt, which
    happens in the first round."""

    k: int = 0  # proposals asked of the draft per round (fewer near the end)
    rounds: int = 0  # verification passes of the target after the prefill
    proposed: int = 0  # draft tokens the target checked
    accepted: int = 0  # draft tokens the target agreed with
    draft_time_s: float = 0.0  # time spent in draft forward passes
    target_time_s: float = 0.0  # time spent in target verification passes

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """New tokens per verification pass (the prefill's token left out): plain decoding
        makes 1, a draft the target always agrees with makes k + 1."""
        return (self.generated_tokens - 1) / self.rounds if self.rounds else 0.0


@dataclass
class SpeculativeResult:
    token_ids: list[int]  # the new tokens only
    stats: SpeculativeStats


def check_draft(target: nn.Module, draft: nn.Module) -> None:
    """Refuse a draft whose token ids mean something else than the target's."""
    target_vocab, draft_vocab = target.cfg.vocab_size, draft.cfg.vocab_size
    if target_vocab != draft_vocab:
        raise ValueError(
            f"the draft's vocab_size={draft_vocab} differs from the target's "
            f"vocab_size={target_vocab}: speculative decoding needs both models to share one "
            "tokenizer; pick a draft trained with the target's tokenizer"
        )


def propose(
    draft: nn.Module,
    cache,
    held: int,
    context: list[int],
    n_proposals: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    step: FusedStep | None = None,
) -> tuple[list[int], Tensor | None, int]:
    """Let the draft continue `context` by n_proposals tokens, one forward pass each.

    The draft's cache holds positions 0..held-1 of the context, which may lag behind by a few
    tokens (the target's correction, or the last proposal after a full acceptance): the first
    pass feeds all of them at once. Passes of up to step.max_tokens go through `step`, the
    draft's fused C step, when it has one for this cache (the prompt's first pass is a prefill
    through the modules).
    Returns the tokens, when sampling the draft's distributions q (K, V) they came from, and
    the positions the cache holds after (the last proposal is not fed).
    """
    feed = context[held:]  # at least the last token: the cache holds context[:-1]
    tokens: list[int] = []
    q_rows: list[Tensor] = []
    for _ in range(n_proposals):
        if step is not None and step.takes(cache, len(feed)):
            logits = step.many(feed, held, cache)[-1:]  # (1, V)
        else:
            ids = torch.tensor([feed], device=draft.device)  # (1, T)
            positions = torch.arange(held, held + len(feed), device=draft.device)
            logits = draft(ids, positions, cache=cache, last_token_only=True)[:, -1]  # (1, V)
        held += len(feed)
        check_finite_logits(logits, f"the draft model's logits at position {held - 1}")
        if not params.is_greedy:
            q_rows.append(sampling_distribution(logits, params)[0])
        token = int(sample(logits, params, generator))
        tokens.append(token)
        feed = [token]
    return tokens, (torch.stack(q_rows) if q_rows else None), held


def verify_greedy(target_logits: Tensor, proposals: list[int]) -> list[int]:
    """The longest prefix of proposals equal to the target's argmax, then the target's own token.

    target_logits (K + 1, V): row i is the target's prediction after context + proposals[:i].
    Why the result equals plain greedy decoding: a proposal is kept only if it IS the target's
    argmax given everything before it, so every kept row was computed on the very prefix plain
    greedy decoding would have built. The one caveat is float rounding: a (K + 1)-token pass
    sums in a different order than K + 1 single steps, so two logits within ~1e-6 of each other
    could swap; with trained or random weights such a near-tie essentially never happens.
    """
    choices = target_logits.argmax(dim=-1).tolist()  # (K + 1,)
    n_accepted = 0
    while n_accepted < len(proposals) and proposals[n_accepted] == choices[n_accepted]:
        n_accepted += 1
    # Row n_accepted is the correction after a rejection, or the bonus token after k accepts.
    return [*proposals[:n_accepted], choices[n_accepted]]


def verify_sampled(
    target_logits: Tensor,
    proposals: list[int],
    draft_probs: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """Leviathan et al.'s rejection rule: keep proposal x ~ q with probability min(1, p(x)/q(x));
    at the first rejection draw from the residual max(0, p - q), normalized; after k accepts
    draw a bonus token from p. Each emitted token is then distributed exactly as p.

    target_logits (K + 1, V); draft_probs q (K, V): the distributions the proposals came from.
    """
    p = sampling_distribution(target_logits, params)  # (K + 1, V)
    for i, token in enumerate(proposals):
        u = torch.rand((), generator=generator, device=p.device)
        if u * draft_probs[i, token] < p[i, token]:  # u < p/q without dividing by q
            continue
        residual = (p[i] - draft_probs[i]).clamp(min=0)  # (V,)
        if float(residual.sum()) <= 0:
            # p == q up to rounding: a rejection was a rounding artefact; p itself is exact.
            residual = p[i]
        fix = torch.multinomial(residual / residual.sum(), 1, generator=generator)
        return [*proposals[:i], int(fix)]
    bonus = torch.multinomial(p[len(proposals)], 1, generator=generator)
    return [*proposals, int(bonus)]


class SpeculativeDecoder(Engine):
    """The Engine, one row at a time, whose step is a speculative round: `draft` proposes up
    to k tokens, `target` checks them in one pass, and the row accepts what survives."""

    def __init__(self, target: nn.Module, draft: nn.Module, k: int = 4, fast: bool = True):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"k={k!r} must be an integer >= 1: the draft tokens proposed per round"
            )
        check_draft(target, draft)
        super().__init__(target, fast=fast)
        self.draft, self.k = draft.eval(), k
        # The draft's proposals (and its catch-up after a round) through its fused C step.
        self.draft_step = FusedStep.for_model(self.draft) if fast else None
        self.draft_cache = None
        self._draft_row: Row | None = None  # whose context the draft cache holds
        self._draft_held = 0  # how many positions of it (the cache keeps no count)

    def add(self, prompt_ids, params: SamplingParams | None = None, **kwargs) -> Row:
        """Engine.add, refusing what a speculative round does not apply: the draft proposes
        from plain logits, so penalties would make its tokens differ from the target's rule."""
        for name, off in (
            ("repetition_penalty", 1.0),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("logprobs", None),
            ("min_tokens", 0),
            ("logit_bias", ()),
            ("json_schema", None),
            ("regex", None),
            ("grammar", None),
        ):
            value = getattr(params, name, off)
            if value != off:
                raise ValueError(
                    f"{name}={value!r} is not supported with speculative decoding: leave it at "
                    f"{off!r}, or generate without a draft (Engine(target))"
                )
        return super().add(prompt_ids, params, **kwargs)

    def reserve(self, n_rows: int, n_positions: int) -> None:
        """One row, in a full cache even for sliding-window models: a ring overwrites the key
        leaving the window, so rejected proposals could not be undone; the mask still limits
        attention to the window."""
        if n_rows != 1:
            raise ValueError(f"SpeculativeDecoder generates one row at a time, not {n_rows}")
        cache = self.cache
        if cache is None or cache.max_seq_len < n_positions:
            self.cache = self.model.new_cache(1, n_positions, kind="full")

    def new_stats(self, prompt_tokens: int) -> SpeculativeStats:
        return SpeculativeStats(prompt_tokens=prompt_tokens, k=self.k)

    def step(self) -> list[Row]:
        """One speculative round for the live row (a full context stops it)."""
        live = self.rows[: self.n_live]
        if not live:
            return []
        (row,) = live
        if row.length >= self.cache.max_seq_len:
            row.stop("context_full")
        else:
            with torch.inference_mode():
                self._round(row)
            self._update_bytes(row)
        if row.finished:
            self._leave(row)
        return live

    def _round(self, row: Row) -> None:
        params, context, stats = row.params, row.context, row.stats
        draft_max, target_max = self.draft.cfg.max_seq_len, self.cache.max_seq_len
        if self._draft_row is not row:  # a new row: the draft starts from an empty cache
            wanted = len(row.prompt) + params.max_new_tokens
            self.draft_cache = self.draft.new_cache(1, min(draft_max, wanted), kind="full")
            self._draft_row, self._draft_held = row, 0
        # Propose no more than fits: a round emits up to n_proposals + 1 tokens, the target's
        # pass writes positions len(context) - 1 ... + n_proposals, the draft's one fewer.
        remaining = params.max_new_tokens - len(row.tokens)
        n_proposals = min(
            self.k, remaining - 1, target_max - len(context), draft_max - len(context) + 1
        )
        n_proposals = max(n_proposals, 0)  # 0: a plain target step (e.g. draft window full)
        # A round emits up to n_proposals + 1 thinking tokens: no more than the budget left.
        # Once it is spent the round still writes the last token's keys, then closes the
        # segment, as Row.sample does.
        budget, force_end = params.thinking_budget, False
        if row.thinking and budget is not None:
            force_end = row.thought >= budget
            n_proposals = 0 if force_end else min(n_proposals, budget - row.thought - 1)
        t_draft = time.perf_counter()
        proposals, draft_probs, held = propose(
            self.draft,
            self.draft_cache,
            self._draft_held,
            context,
            n_proposals,
            params,
            row.generator,
            self.draft_step,
        )
        t_target = time.perf_counter()
        # The target's slot holds context[:-1]: the last token and the proposals go at the
        # next positions. Positions past the accepted tokens are simply written over later.
        checked = context[-1:] + proposals
        if self.fused is not None and self.fused.takes(self.cache, len(checked)):
            # the target's fused C step over the K + 1 tokens at once
            target_logits = self.fused.many(checked, row.length, self.cache, row.slot)
        else:
            ids = torch.tensor([checked], device=self.model.device)  # (1, K + 1)
            positions = torch.arange(row.length, row.length + ids.shape[1], device=ids.device)
            slot = self.cache.rows(row.slot, row.slot + 1)
            target_logits = self.model(ids, positions, cache=slot)[0]  # (K + 1, V)
        check_finite_logits(target_logits, f"the model's logits at step {len(row.tokens) + 1}")
        if force_end:
            row.stats.thinking_forced_end = True
            emitted = [params.think_ids[1]]
        elif params.is_greedy:
            emitted = verify_greedy(target_logits, proposals)
        else:
            emitted = verify_sampled(target_logits, proposals, draft_probs, params, row.generator)
        n_accepted = len(emitted) - 1
        # The draft's cache holds context[:-1] again after the rejected proposals go.
        self._draft_held = min(held, len(context) + n_accepted)  # later positions: rewritten
        stats.draft_time_s += t_target - t_draft
        stats.target_time_s += time.perf_counter() - t_target
        stats.rounds += 1
        stats.proposed += n_proposals
        stats.accepted += n_accepted
        for token in emitted:
            row.accept(token, rows_in_step=1)
            if row.finished:
                break


def speculative_generate(
    target: nn.Module,
    draft: nn.Module,
    prompt_ids: Sequence[int] | Tensor,
    max_new_tokens: int = 64,
    k: int = 4,
    eos_token_id: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> SpeculativeResult:
    """Generate up to max_new_tokens with `draft` proposing k tokens per target pass (batch 1).

    temperature 0 (the default) gives exactly Engine(target).generate(temperature=0)'s tokens;
    temperature > 0 (with top_k/top_p) samples from the same distribution as the target alone.
    Stops at eos_token_id (default: the target config's), max_new_tokens or the context end.
    """
    decoder = SpeculativeDecoder(target, draft, k)
    result = decoder.generate(
        prompt_ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_token_id=eos_token_id,
    )
    return SpeculativeResult(token_ids=result.token_ids, stats=result.stats)
