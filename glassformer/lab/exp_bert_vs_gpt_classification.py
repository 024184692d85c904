"""Seed 000 §6.3: bidirectional attention lets every position use both sides of its context, so
for "whole sentence in, label out" tasks an encoder (BERT) beats a decoder (GPT).

Measured on a real task from the installed plays: is a window of text from a modern edition or
from the First Folio (1623) spelling ("loue", "haue", "selfe")? Whitespace is collapsed to
single spaces, so the layout gives nothing away. Training windows come from the first 85% of
every play (of its first 40,000 characters in quick mode), held-out windows from the last 15%
(passages neither model has seen in either spelling). The two models are one and the same
network: glassformer's GPT and BERT families with the same config share every parameter name,
so BERT starts from the GPT's initial weights; the only difference is the causal mask. Both
read the sequence through one extra [CLS] token appended at the end, whose final state a linear
head classifies: for the GPT that is its last token (the one that has seen the whole window),
for BERT any position sees everything. Same steps, same batches; held-out accuracy, mean ±
spread over seeds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.fit import Batch, Schedule, fit, step_generator
from glassformer.models import build_model
from glassformer.models.common import LossOutput
from glassformer.tokenizers import CharTokenizer

LABELS = ("modern", "folio")
CLS = "\x00"  # the classification token's character: never in the plays
HELD_OUT = 0.15  # the last 15% of every play
# Threshold, stated once: BERT's held-out accuracy exceeds the GPT's by more than the seeds'
# combined spread plus 0.02 (two windows in a hundred: a difference a reader would notice).
MIN_ADVANTAGE = 0.02
MIN_LEARNED = 0.6  # precondition: both models beat chance (0.5) clearly, so both learned


@dataclass(frozen=True)
class SpellingData:
    tokenizer: CharTokenizer
    train: dict[str, Tensor]  # label -> character ids of all plays' first 85%, joined
    test: dict[str, Tensor]  # label -> the last 15%

    @property
    def cls_id(self) -> int:
        return self.tokenizer.encode(CLS)[0]


def collapse_whitespace(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def head_and_tail(texts: list[str], held_out: float) -> tuple[str, str]:
    """Every text cut at 1 - held_out: (the heads joined, the tails joined)."""
    cuts = [int(len(t) * (1 - held_out)) for t in texts]
    heads = " ".join(t[:c] for t, c in zip(texts, cuts, strict=True))
    tails = " ".join(t[c:] for t, c in zip(texts, cuts, strict=True))
    return heads, tails


@lru_cache(maxsize=2)
def spelling_data(chars_per_play: int | None = None) -> SpellingData:
    """Both spellings of every play, whitespace collapsed, each play cut to its first
    chars_per_play characters (None: whole), then split into train head and held-out tail."""
    from glassformer.data.corpus import shakespeare_plays

    texts = {label: [collapse_whitespace(t)[:chars_per_play]
                     for t in shakespeare_plays(label).values()]
             for label in LABELS}  # fmt: skip
    tokenizer = CharTokenizer.from_text("".join("".join(v) for v in texts.values()) + CLS)
    train, test = {}, {}
    for label, plays in texts.items():
        head, tail = head_and_tail(plays, HELD_OUT)
        train[label] = torch.tensor(tokenizer.encode(head))
        test[label] = torch.tensor(tokenizer.encode(tail))
    return SpellingData(tokenizer, train, test)


def window_batch(data: dict[str, Tensor], cls_id: int, batch_size: int, length: int,
                 generator: torch.Generator) -> Batch:  # fmt: skip
    """batch_size windows of `length` characters + [CLS], each from a random label's text."""
    labels = torch.randint(0, len(LABELS), (batch_size,), generator=generator)
    rows = []
    for label in labels.tolist():
        ids = data[LABELS[label]]
        start = int(torch.randint(0, len(ids) - length, (1,), generator=generator))
        rows.append(torch.cat([ids[start : start + length], torch.tensor([cls_id])]))
    return {"input_ids": torch.stack(rows), "labels": labels}


class LastTokenClassifier(nn.Module):
    """A GPT or BERT body and a linear head on the final state of the last token ([CLS])."""

    def __init__(self, body: nn.Module, n_classes: int) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(body.cfg.d_model, n_classes)

    def forward(self, input_ids: Tensor) -> Tensor:
        """(B, T) ids ending in [CLS] -> (B, n_classes) logits."""
        if self.body.cfg.family == "gpt":
            hidden = self.body.hidden_states(input_ids)  # (B, T, C), causal
        else:
            hidden = self.body(input_ids)  # (B, T, C), bidirectional
        return self.head(hidden[:, -1])

    def loss(self, input_ids: Tensor, labels: Tensor) -> LossOutput:
        ce = F.cross_entropy(self(input_ids), labels)
        return LossOutput(loss=ce, ce_loss=ce, aux_loss=ce.new_zeros(()))


def twin_classifiers(cfg: ModelConfig, seed: int) -> dict[str, LastTokenClassifier]:
    """A GPT and a BERT with identical initial weights (body and head): only the mask differs."""
    torch.manual_seed(seed)
    gpt = build_model(cfg.replace(family="gpt"))
    bert = build_model(cfg.replace(family="bert"))
    body = {k: v for k, v in gpt.state_dict().items() if k != "lm_head.weight"}  # tied: tok_emb
    bert.load_state_dict(body)
    models = {"GPT (causal)": LastTokenClassifier(gpt, len(LABELS)),
              "BERT (bidirectional)": LastTokenClassifier(bert, len(LABELS))}  # fmt: skip
    models["BERT (bidirectional)"].head.load_state_dict(models["GPT (causal)"].head.state_dict())
    return models


@torch.no_grad()
def accuracy(model: LastTokenClassifier, batch: Batch) -> float:
    model.eval()
    return (model(batch["input_ids"]).argmax(-1) == batch["labels"]).float().mean().item()


def batches(data: SpellingData, batch_size: int, length: int, seed: int) -> Callable[[int], Batch]:
    """batch(step) for fit(): a pure function of (seed, step), the same for both models."""

    def batch(step: int) -> Batch:
        return window_batch(data.train, data.cls_id, batch_size, length,
                            step_generator(seed, step))  # fmt: skip

    return batch


@lab.register("bert-vs-gpt-classification")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    # Quick and tiny modes use the start of every play: encoding all 8M characters takes
    # longer than training, and 300 steps see a small part of them anyway.
    data = spelling_data(ctx.pick(None, 40_000, 4_000))
    length = ctx.pick(64, 32, 16)
    d_model, n_layers = ctx.pick(96, 64, 16), ctx.pick(3, 2, 1)
    steps, batch_size = ctx.pick(800, 300, 5), ctx.pick(32, 32, 8)
    n_eval = ctx.pick(2000, 1000, 32)
    cfg = ModelConfig(vocab_size=data.tokenizer.vocab_size, d_model=d_model, n_layers=n_layers,
                      n_heads=4, max_seq_len=length + 1, position="learned", norm="layer",
                      norm_position="pre", ffn="gelu")  # fmt: skip
    schedule = Schedule(max_steps=steps, learning_rate=3e-3, warmup_steps=min(20, steps // 4),
                        weight_decay=0.0)  # fmt: skip
    # The same held-out windows for every model and seed, from a generator no step uses.
    held_out = window_batch(data.test, data.cls_id, n_eval, length,
                            torch.Generator().manual_seed(2**62))  # fmt: skip
    seeds = ctx.seeds()
    scores: dict[str, list[float]] = {}
    train_loss: dict[str, list[float]] = {}
    n_params: dict[str, int] = {}
    for seed in seeds:
        for name, model in twin_classifiers(cfg, seed).items():
            losses = fit(model, batches(data, batch_size, length, seed), schedule)
            scores.setdefault(name, []).append(accuracy(model, held_out))
            train_loss.setdefault(name, []).append(sum(losses[-20:]) / len(losses[-20:]))
            n_params[name] = sum(p.numel() for p in model.parameters())
    spread = {name: lab.over_seeds(v) for name, v in scores.items()}
    gpt, bert = spread["GPT (causal)"], spread["BERT (bidirectional)"]
    rows = [{"model": name, "parameters": n_params[name], "held-out accuracy": str(spread[name]),
             "train loss (last 20 steps)": str(lab.over_seeds(train_loss[name]))}
            for name in spread]  # fmt: skip
    checks = [
        lab.precondition(lab.approx("parameters: BERT - GPT", n_params["BERT (bidirectional)"]
                                    - n_params["GPT (causal)"], 0, 0)),
        lab.precondition(lab.at_least("GPT held-out accuracy", gpt.mean, MIN_LEARNED)),
        lab.precondition(lab.at_least("BERT held-out accuracy", bert.mean, MIN_LEARNED)),
        lab.exceeds_spread("held-out accuracy: BERT - GPT", bert, gpt, MIN_ADVANTAGE,
                           group="BERT beats GPT at classification, same size"),
    ]  # fmt: skip
    difference = bert.mean - gpt.mean
    verdict_words = ("more than" if difference > (gpt.spread**2 + bert.spread**2) ** 0.5
                     else "not more than")  # fmt: skip
    notes = [
        f"task: modern edition vs First Folio spelling of {length}-character windows; "
        f"{steps} steps of {batch_size} windows, {len(seeds)} seed(s); {n_eval} held-out "
        "windows from the plays' last 15%; chance 0.5",
        f"BERT - GPT held-out accuracy: {difference:+.3f}, {verdict_words} the seeds' combined "
        "spread",
        "the GPT classifies from its last token; both start from the same weights and see the "
        "same batches, so the causal mask is the only difference",
    ]
    if ctx.tiny:
        notes.append("tiny mode: a few steps; the accuracies say nothing about the claim")
    data_out = {"accuracy": scores, "train_loss": train_loss, "params": n_params,
                "seeds": seeds, "length": length, "steps": steps}  # fmt: skip
    return lab.Result.from_checks(rows, checks, figure=_plot(spread), data=data_out, notes=notes)


def _plot(spread: dict[str, lab.Spread]):
    fig, ax = lab.new_figure(5.4, 3.4)
    names = list(spread)
    means = [spread[n].mean for n in names]
    ax.bar(range(len(names)), means, yerr=[spread[n].spread for n in names], capsize=6,
           color=["C0", "C1"])  # fmt: skip
    for i, n in enumerate(names):
        for v in spread[n].values:
            ax.plot(i, v, "k.", markersize=5)
    a, b = spread[names[0]], spread[names[1]]
    if abs(a.mean - b.mean) <= (a.spread**2 + b.spread**2) ** 0.5:
        ax.text(0.5, 0.97, "no difference beyond the spread", ha="center", va="top",
                transform=ax.transAxes, fontsize=8)  # fmt: skip
    ax.axhline(0.5, color="grey", linestyle=":", label="chance")
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel="held-out accuracy (modern vs Folio)", ylim=(0.4, 1.0),
           title="same size, same steps, same data")  # fmt: skip
    ax.legend(fontsize=8, loc="lower right")
    return fig
