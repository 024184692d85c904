"""Seed 002: "去掉它，GPT 会变成一个不懂语序的词袋子" — without positional encoding, GPT
becomes a bag of words that cannot tell word order.

A task only word order can solve: L distinct random symbols, then a query symbol; the answer
is the symbol that came first. Every order of the same symbols has a different answer, so a
bag of words (which sees only the set) can do no better than chance, 1/L. Three small models
of the same size train on the same batches:

- GPT with RoPE: the precondition that the task is learnable at this size and this budget;
- a bidirectional encoder (family="bert") without positions: the bag of words the claim
  describes, whose attention is permutation-equivariant (the no-position-permutation claim),
  so it should stay near chance: the precondition that the task really needs order;
- GPT without positions (causal mask): the claim itself. The mask tells positions apart by
  itself (the first token sees one token, the t-th sees t), so a causal model can find the
  first symbol without any position encoding (Haviv et al. 2022, "Transformer Language Models
  without Positional Encodings Still Learn Positional Information").
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.fit import Batch, Schedule, fit, step_generator
from glassformer.models import build_model

N_SYMBOLS, LENGTH = 16, 8  # L = 8 distinct symbols out of 16, then the query symbol
QUERY = N_SYMBOLS  # its own id, never among the symbols
CHANCE = 1 / LENGTH
# Thresholds, fixed before the run. The claim fails when position-free GPT answers at least
# three times as often as chance (a bag of words cannot beat chance on this task). The setup
# is sound when the RoPE GPT learns the task (>= 90% held out) and the position-free encoder
# stays within twice chance (it is the order-blind control).
MIN_BEATS_CHANCE = 3.0
MIN_ROPE_ACCURACY, MAX_CONTROL_RATIO = 0.9, 2.0
MODELS = {
    "GPT, RoPE": ("gpt", "rope"),
    "encoder, no positions": ("bert", "none"),
    "GPT, no positions": ("gpt", "none"),
}


def first_symbol_batch(batch_size: int, generator: torch.Generator) -> Batch:
    """(B, L + 1) symbols then the query; the target at the query is the first symbol."""
    symbols = torch.rand(batch_size, N_SYMBOLS, generator=generator).argsort(dim=-1)[:, :LENGTH]
    query = torch.full((batch_size, 1), QUERY)
    input_ids = torch.cat([symbols, query], dim=1)
    targets = torch.full_like(input_ids, -100)
    targets[:, -1] = symbols[:, 0]
    return {"input_ids": input_ids, "targets": targets}


def batches(batch_size: int, seed: int) -> Callable[[int], Batch]:
    """batch(step) for fit(): the same batches for every model of one seed."""
    return lambda step: first_symbol_batch(batch_size, step_generator(seed, step))


def build(family: str, position: str, seed: int, ctx: lab.RunContext) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        family=family, vocab_size=N_SYMBOLS + 1, d_model=ctx.pick(64, 64, 32),
        n_layers=2, n_heads=4, max_seq_len=LENGTH + 1, position=position, dropout=0.0,
        **({"mlm_head": True} if family == "bert" else {}),
    )  # fmt: skip
    return build_model(cfg)


@torch.no_grad()
def accuracy(model: torch.nn.Module, batch: Batch) -> float:
    """Share of held-out sequences whose query is answered with the first symbol."""
    ids, answer = batch["input_ids"], batch["targets"][:, -1]
    if model.cfg.family == "bert":
        logits = model.mlm_logits(model(ids)[:, -1])
    else:
        logits = model(ids)[:, -1]
    return float((logits.argmax(dim=-1) == answer).float().mean())


@lab.register("gpt-bag-of-words")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    seeds = [ctx.seed + i for i in range(ctx.pick(3, 2, 1))]
    schedule = Schedule(max_steps=ctx.pick(1500, 600, 20), learning_rate=3e-3, warmup_steps=20)
    held_out = first_symbol_batch(2000, torch.Generator().manual_seed(2**62))  # unseen in training
    scores: dict[str, list[float]] = {name: [] for name in MODELS}
    for seed in seeds:
        for name, (family, position) in MODELS.items():
            model = build(family, position, seed, ctx)
            fit(model, batches(ctx.pick(64, 64, 8), seed), schedule)
            scores[name].append(accuracy(model.eval(), held_out))
    rows = [
        {"model": name, "mean accuracy": statistics.mean(s), "min": min(s), "max": max(s),
         "x chance": statistics.mean(s) / CHANCE, "seeds": len(s)}
        for name, s in scores.items()
    ]  # fmt: skip
    rope = min(scores["GPT, RoPE"])
    control_worst = max(scores["encoder, no positions"])
    nope = min(scores["GPT, no positions"])
    checks = [
        lab.precondition(lab.at_least("GPT with RoPE: held-out accuracy (worst seed)", rope,
                                      MIN_ROPE_ACCURACY)),
        lab.precondition(lab.at_most("position-free encoder: accuracy / chance (best seed)",
                                     control_worst / CHANCE, MAX_CONTROL_RATIO)),
        # The claim says a position-free GPT is a bag of words: at most chance on this task.
        # Evidence against it is the worst seed beating chance threefold.
        lab.at_most("position-free GPT: accuracy / chance (worst seed), bag of words <= 3",
                    nope / CHANCE, MIN_BEATS_CHANCE, group="a causal GPT without positions"),
    ]  # fmt: skip
    notes = [
        f"task: {LENGTH} distinct symbols of {N_SYMBOLS}, then a query; answer the first one "
        f"(chance {CHANCE:.3f}); {schedule.max_steps} steps per model, seeds {seeds}, "
        f"{held_out['input_ids'].shape[0]} held-out sequences",
        "a causal mask is itself a source of order: position t sees t + 1 tokens, so the "
        "first token is the only one that sees only itself; the bag of words is the "
        "bidirectional model without positions, not GPT",
    ]
    return lab.Result.from_checks(rows, checks, figure=_plot(scores), notes=notes,
                                  data={"accuracy": scores})  # fmt: skip


def _plot(scores: dict[str, list[float]]):
    fig, ax = lab.new_figure(6.4, 3.4)
    names = list(scores)
    means = [statistics.mean(scores[n]) for n in names]
    spread = [[m - min(scores[n]) for m, n in zip(means, names, strict=True)],
              [max(scores[n]) - m for m, n in zip(means, names, strict=True)]]  # fmt: skip
    ax.bar(range(len(names)), means, yerr=spread, capsize=4,
           color=["tab:blue", "tab:gray", "tab:orange"])  # fmt: skip
    ax.axhline(CHANCE, color="black", ls="--", lw=1, label=f"chance (bag of words) {CHANCE:.3f}")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out accuracy (first symbol)")
    ax.set_title("去掉位置编码，GPT 还分得清谁在前吗？")
    ax.legend(fontsize=8)
    return fig
