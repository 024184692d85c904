"""Seed 000 §2.1: "参数量固定（7B），训练数据远超参数量（万亿 token）——模型想'记住'数据根本装不下，
只能被迫压缩出规律". A sweep of the training text's size at a fixed model and a fixed budget.

One small character GPT (about 60k parameters) is trained for the same number of steps on the
same number of characters per step, on training texts from 2,000 characters (far fewer than its
parameters: it can store them) to all of the plays (about 70 times its parameters: it cannot).
For each size: the training loss against the held-out loss (the plays' last tenth, never
trained on), and extraction: from prefixes at random places in the training text, greedy
decoding writes the next characters, and we count how often it writes the next EXTRACT_CHARS
verbatim, against prefixes from the held-out text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from glassformer.config import ModelConfig
from glassformer.infer.engine import Engine
from glassformer.infer.rows import common_prefix_length
from glassformer.lab import base as lab
from glassformer.lab.fit import (
    CharCorpus,
    Schedule,
    eval_loss,
    fit,
    shakespeare_chars,
    window_batches,
)
from glassformer.models import build_model

PREFIX_CHARS = 32  # what the model is given
EXTRACT_CHARS = 40  # a line of verse is about 40 characters: this much verbatim is a sentence
CONTEXT = 64
PLATEAU_TOLERANCE = 0.03
# Thresholds, stated once. Preconditions: the smallest text is memorised (training loss at most
# 0.3 nats/char: the model can store a text that is smaller than itself, so a failure to store
# the large one is not a failure to learn), and the run on the largest text reached its plateau
# (the last fifth's mean loss within 3% of the fifth before). Evidence: on the largest text
# (data >> parameters) training prefixes are extracted no more often than held-out ones (within
# 0.05), while on the smallest at least half of them are; and the model "compresses rules":
# the generalisation gap (held-out - training loss) shrinks from the smallest text to the
# largest by more than the seeds' spread plus 1 nat, and the held-out loss falls by more than
# the spread.
MAX_MEMORISED_TRAIN_LOSS = 0.3
SAME_AS_HELD_OUT = 0.05
MIN_SMALL_EXTRACTED = 0.5
MIN_GAP_SHRINK = 1.0


def config(vocab_size: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=48,
        n_layers=2,
        n_heads=4,
        max_seq_len=CONTEXT + 8,
        position="rope",
        norm="rms",
        ffn="swiglu",
    )


@dataclass(frozen=True)
class Budget:
    steps: int
    batch_size: int
    n_probes: int  # extraction prefixes per text
    n_val: int  # held-out windows for the loss


def budget(ctx: lab.RunContext) -> Budget:
    return ctx.pick(
        full=Budget(1500, 16, 48, 256), quick=Budget(700, 16, 24, 128), tiny=Budget(6, 4, 2, 4)
    )


@dataclass
class Reading:
    """One model trained on one text size."""

    n_chars: int
    params: int
    losses: list[float]
    train_loss: float  # mean of the last fifth of training
    held_out_loss: float
    seen: list[int]  # verbatim characters after each training-text prefix
    held_out: list[int]  # after each held-out prefix

    def extracted(self, which: str) -> float:
        values = self.seen if which == "seen" else self.held_out
        return sum(n >= EXTRACT_CHARS for n in values) / len(values)


def greedy_continuation(engine: Engine, ids: list[int], n: int) -> list[int]:
    return engine.generate(ids, n, temperature=0.0).token_ids


def verbatim(engine: Engine, text: torch.Tensor, n_probes: int, rng: random.Random) -> list[int]:
    """Characters reproduced verbatim after n_probes prefixes at random places of `text`."""
    out = []
    for _ in range(n_probes):
        at = rng.randrange(PREFIX_CHARS, len(text) - EXTRACT_CHARS)
        prefix = text[at - PREFIX_CHARS : at].tolist()
        target = text[at : at + EXTRACT_CHARS].tolist()
        out.append(common_prefix_length(greedy_continuation(engine, prefix, EXTRACT_CHARS), target))
    return out


def train_reading(ctx: lab.RunContext, corpus: CharCorpus, n_chars: int, seed: int) -> Reading:
    """The model trained from `seed` on the first n_chars characters of the plays, measured."""
    size = budget(ctx)
    train = corpus.train[:n_chars]
    torch.manual_seed(seed)
    model = build_model(config(corpus.tokenizer.vocab_size))
    schedule = Schedule(
        max_steps=size.steps,
        learning_rate=3e-3,
        warmup_steps=max(1, size.steps // 20),
        weight_decay=0.0,
    )
    losses = fit(model, window_batches(train, size.batch_size, CONTEXT, seed), schedule)
    held = eval_loss(model, corpus.val, CONTEXT, size.n_val, seed=seed)
    engine, rng = Engine(model), random.Random(seed)
    seen = verbatim(engine, train, size.n_probes, rng)
    held_out = verbatim(engine, corpus.val, size.n_probes, rng)
    window = max(1, len(losses) // 5)
    return Reading(
        n_chars,
        sum(p.numel() for p in model.parameters()),
        losses,
        sum(losses[-window:]) / window,
        held,
        seen,
        held_out,
    )


def sizes(ctx: lab.RunContext, corpus: CharCorpus) -> list[int]:
    everything = len(corpus.train)
    return ctx.pick(
        full=[2_000, 20_000, 200_000, everything],
        quick=[2_000, 40_000, everything],
        tiny=[500, everything],
    )


def corpus_for(ctx: lab.RunContext) -> CharCorpus:
    return shakespeare_chars(ctx.pick(None, None, 50_000))


@lab.register("data-vs-params")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    corpus, say, seeds = corpus_for(ctx), ctx.say, ctx.seeds()
    n_chars = sizes(ctx, corpus)
    readings = {n: [train_reading(ctx, corpus, n, seed) for seed in seeds] for n in n_chars}
    params = readings[n_chars[0]][0].params
    stat = {
        n: {
            "train": lab.over_seeds([r.train_loss for r in rs]),
            "held": lab.over_seeds([r.held_out_loss for r in rs]),
            "gap": lab.over_seeds([r.held_out_loss - r.train_loss for r in rs]),
            "seen": lab.over_seeds([r.extracted("seen") for r in rs]),
            "held-out": lab.over_seeds([r.extracted("held") for r in rs]),
        }
        for n, rs in readings.items()
    }
    small, large = n_chars[0], n_chars[-1]
    window = max(1, len(readings[large][0].losses) // 5)
    checks = [
        lab.precondition(
            lab.at_most(
                say(
                    f"training loss on the smallest text ({small:,} chars; nats/char, mean)",
                    f"最小训练文本（{small:,} 字符）上的训练损失（nats/字符，均值）",
                ),
                stat[small]["train"].mean,
                MAX_MEMORISED_TRAIN_LOSS,
            )
        ),
        max(
            (
                lab.converged(
                    say(
                        f"largest text ({large:,} chars): relative loss drop over the "
                        "last fifth of training, worst seed",
                        f"最大训练文本（{large:,} 字符）：训练最后五分之一的损失相对降幅"
                        "（最差的随机种子）",
                    ),
                    r.losses,
                    window,
                    PLATEAU_TOLERANCE,
                )
                for r in readings[large]
            ),
            key=lambda c: c.measured,
        ),
    ]
    storing = say(
        "data >> parameters: the training text cannot be stored", "数据远超参数：训练原文装不下"
    )
    rules = say("forced to compress rules", "被迫压缩出规律")
    checks += [
        lab.at_most(
            say(
                f"largest text: share of training prefixes continued {EXTRACT_CHARS} "
                "chars verbatim - held-out prefixes'",
                f"最大训练文本：训练前缀逐字续写 {EXTRACT_CHARS} 个字符的比例 - 留出前缀的",
            ),
            stat[large]["seen"].mean - stat[large]["held-out"].mean,
            SAME_AS_HELD_OUT,
            group=storing,
        ),
        lab.at_least(
            say(
                f"smallest text: share of training prefixes continued {EXTRACT_CHARS} "
                "chars verbatim",
                f"最小训练文本：训练前缀逐字续写 {EXTRACT_CHARS} 个字符的比例",
            ),
            stat[small]["seen"].mean,
            MIN_SMALL_EXTRACTED,
            group=storing,
        ),
        lab.exceeds_spread(
            say(
                "generalisation gap (held-out - training loss): smallest - largest text (nats)",
                "泛化差距（留出损失 - 训练损失）：最小 - 最大训练文本（nats）",
            ),
            stat[small]["gap"],
            stat[large]["gap"],
            MIN_GAP_SHRINK,
            group=rules,
        ),
        lab.exceeds_spread(
            say(
                "held-out loss: smallest - largest text (nats)",
                "留出损失：最小 - 最大训练文本（nats）",
            ),
            stat[small]["held"],
            stat[large]["held"],
            group=rules,
        ),
    ]
    rows = _rows(ctx, stat, params, budget(ctx))
    notes = _notes(ctx, params, budget(ctx), seeds, n_chars)
    data = {
        "seeds": seeds,
        "params": params,
        "sizes": n_chars,
        "readings": {
            str(n): [
                {
                    "train_loss": r.train_loss,
                    "held_out_loss": r.held_out_loss,
                    "seen": r.seen,
                    "held_out": r.held_out,
                }
                for r in rs
            ]
            for n, rs in readings.items()
        },
    }
    figure = _plot(stat, params)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _rows(ctx, stat: dict, params: int, size: Budget) -> list[dict]:
    say, seen_per_step = ctx.say, size.steps * size.batch_size * CONTEXT
    columns = (
        say("training text (chars)", "训练文本（字符）"),
        say("chars / parameters", "字符数 / 参数量"),
        say("times each char was seen", "每个字符被看到的次数"),
        say("training loss", "训练损失"),
        say("held-out loss", "留出损失"),
        say("gap", "差距"),
        say(
            f"training prefixes with {EXTRACT_CHARS} chars verbatim",
            f"逐字续写 {EXTRACT_CHARS} 字符的训练前缀",
        ),
        say(
            f"held-out prefixes with {EXTRACT_CHARS} chars verbatim",
            f"逐字续写 {EXTRACT_CHARS} 字符的留出前缀",
        ),
    )
    return [
        dict(
            zip(
                columns,
                (
                    n,
                    n / params,
                    seen_per_step / n,
                    str(s["train"]),
                    str(s["held"]),
                    str(s["gap"]),
                    str(s["seen"]),
                    str(s["held-out"]),
                ),
                strict=True,
            )
        )
        for n, s in stat.items()
    ]


def _notes(ctx, params: int, size: Budget, seeds: list[int], n_chars: list[int]) -> list[str]:
    tokens = size.steps * size.batch_size * CONTEXT
    return [
        ctx.say(
            f"one character GPT of {params:,} parameters (2 layers, d=48), trained "
            f"{size.steps} steps of {size.batch_size}x{CONTEXT} characters ({tokens:,} "
            f"characters seen) on the first {', '.join(f'{n:,}' for n in n_chars)} "
            f"characters of the plays; seeds {seeds}; {size.n_probes} extraction prefixes of "
            f"{PREFIX_CHARS} characters per text",
            f"同一个 {params:,} 参数的字符级 GPT（2 层，d=48），训练 {size.steps} 步、每步 "
            f"{size.batch_size}x{CONTEXT} 个字符（共看到 {tokens:,} 个字符），训练文本取剧本的"
            f"前 {'、'.join(f'{n:,}' for n in n_chars)} 个字符；随机种子 {seeds}；每段文本取 "
            f"{size.n_probes} 个 {PREFIX_CHARS} 字符的前缀做提取",
        ),
        ctx.say(
            "the seed's regime is 7B parameters and trillions of tokens, about 1,000 tokens "
            f"per parameter; the largest text here is {n_chars[-1] / params:.0f} characters "
            "per parameter",
            "原文说的是 7B 参数、万亿 token，约每个参数 1,000 个 token；这里最大的训练文本是"
            "每个"
            f"参数 {n_chars[-1] / params:.0f} 个字符",
        ),
    ]


def _plot(stat: dict, params: int):
    fig, (losses, extraction) = lab.new_figure(10.0, 3.6, ncols=2)
    ratio = [n / params for n in stat]
    for key, label in (("train", "training loss"), ("held", "held-out loss")):
        losses.errorbar(
            ratio,
            [s[key].mean for s in stat.values()],
            yerr=[s[key].spread for s in stat.values()],
            marker="o",
            capsize=3,
            label=label,
        )
    losses.set(
        xscale="log",
        xlabel="training characters / parameters",
        ylabel="loss (nats / char, mean ± spread)",
        title="memorising, then compressing",
    )
    losses.axvline(1.0, color="grey", linestyle=":")
    losses.legend(fontsize=7)
    for key, label in (("seen", "training prefixes"), ("held-out", "held-out prefixes")):
        extraction.errorbar(
            ratio,
            [s[key].mean for s in stat.values()],
            yerr=[s[key].spread for s in stat.values()],
            marker="o",
            capsize=3,
            label=label,
        )
    extraction.set(
        xscale="log",
        xlabel="training characters / parameters",
        ylim=(-0.05, 1.05),
        ylabel=f"share continued {EXTRACT_CHARS} chars verbatim",
        title="can the training text be taken back out?",
    )
    extraction.axvline(1.0, color="grey", linestyle=":")
    extraction.legend(fontsize=7)
    return fig
