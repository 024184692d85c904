"""Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023): a cheap draft model proposes k tokens one by one, the target model
checks all of them in ONE forward pass over its KV cache, and every proposal it agrees with is a
token gained for the price of a draft step.

Decoding is memory-bound (seed 000 §2.5.1): one target step reads every weight to make one
token, and a pass over k + 1 tokens reads them once too, so it costs about the same. Greedy
output is exactly the target's own greedy output; with temperature > 0 the rejection rule keeps
the output distributed exactly as the target's. Shapes: V vocab, K proposals in a round.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassformer.infer.rows import GenerationStats, Row, prompt_tensor
from glassformer.infer.sampling import (
    SamplingParams,
    resolve_eos,
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


def rollback(cache, length: int) -> None:
    """Drop the cache's positions from `length` on; only caches that keep them can do it."""
    if not hasattr(cache, "truncate"):
        raise TypeError(
            f"{type(cache).__name__} cannot roll back rejected tokens (no truncate()): use "
            "the plain KVCache for speculative decoding"
        )
    cache.truncate(length)


def propose(
    draft: nn.Module,
    cache,
    context: list[int],
    n_proposals: int,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], Tensor | None]:
    """Let the draft continue `context` by n_proposals tokens, one forward pass each.

    The draft's cache may lag behind the context by a few tokens (the target's correction, or
    the last proposal after a full acceptance): the first pass feeds all of them at once.
    Returns the tokens and, when sampling, the draft's distributions q (K, V) they came from.
    """
    feed = context[cache.length :]  # at least the last token: the cache holds context[:-1]
    tokens: list[int] = []
    q_rows: list[Tensor] = []
    for _ in range(n_proposals):
        ids = torch.tensor([feed], device=draft.device)  # (1, T)
        logits = draft(ids, cache=cache, last_token_only=True)[:, -1]  # (1, V)
        if not params.is_greedy:
            q_rows.append(sampling_distribution(logits, params)[0])
        token = int(sample(logits, params, generator))
        tokens.append(token)
        feed = [token]
    return tokens, (torch.stack(q_rows) if q_rows else None)


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


@torch.inference_mode()
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
    Stops at eos_token_id (default: the target config's), max_new_tokens or the context end:
    the Engine's Row applies the stop rules and keeps the statistics.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be an integer >= 1: the draft tokens proposed per round")
    check_draft(target, draft)
    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
    )  # fmt: skip
    target_max, draft_max = target.cfg.max_seq_len, draft.cfg.max_seq_len
    prompt = prompt_tensor(prompt_ids, target_max)[0].tolist()
    row = Row(prompt, params, resolve_eos(eos_token_id, target.cfg), target.device)
    stats = row.stats = SpeculativeStats(prompt_tokens=len(prompt), k=k)
    generator, context = row.generator, row.context  # context grows as the row accepts tokens
    target.eval()
    draft.eval()
    # Full caches even for sliding-window models: a ring buffer overwrites the slot of the key
    # leaving the window, so rejected proposals could not be rolled back; the mask still
    # limits attention to the window.
    n_positions = len(prompt) + max_new_tokens
    target_cache = target.new_cache(1, min(target_max, n_positions), kind="full")
    draft_cache = draft.new_cache(1, min(draft_max, n_positions), kind="full")

    ids = torch.tensor([prompt], device=target.device)  # (1, T)
    logits = target(ids, cache=target_cache, last_token_only=True)[:, -1]  # (1, V)
    row.accept(int(sample(logits, params, generator)), rows_in_step=1)
    # Invariant between rounds: both caches hold at most context[:-1]; the target's exactly.
    while not row.finished:
        if target_cache.length >= target_max:
            row.stop("context_full")
            break
        remaining = max_new_tokens - len(row.tokens)
        # Propose no more than fits: a round emits up to n_proposals + 1 tokens, the target's
        # pass writes positions len(context) - 1 ... + n_proposals, the draft's one fewer.
        n_proposals = min(k, remaining - 1, target_max - len(context), draft_max - len(context) + 1)
        n_proposals = max(n_proposals, 0)  # 0: a plain target step (e.g. draft window full)

        t_draft = time.perf_counter()
        proposals, draft_probs = propose(
            draft, draft_cache, context, n_proposals, params, generator
        )
        t_target = time.perf_counter()
        n_cached = target_cache.length
        ids = torch.tensor([context[-1:] + proposals], device=target.device)  # (1, K + 1)
        target_logits = target(ids, cache=target_cache)[0]  # (K + 1, V)
        if params.is_greedy:
            emitted = verify_greedy(target_logits, proposals)
        else:
            emitted = verify_sampled(target_logits, proposals, draft_probs, params, generator)
        n_accepted = len(emitted) - 1
        # Roll back the rejected proposals' keys/values: the caches hold context[:-1] again.
        rollback(target_cache, n_cached + 1 + n_accepted)
        rollback(draft_cache, min(draft_cache.length, len(context) + n_accepted))
        stats.draft_time_s += t_target - t_draft
        stats.target_time_s += time.perf_counter() - t_target
        stats.rounds += 1
        stats.proposed += n_proposals
        stats.accepted += n_accepted
        for token in emitted:
            row.accept(token, rows_in_step=1)
            if row.finished:
                break
    return SpeculativeResult(token_ids=row.tokens, stats=stats)
