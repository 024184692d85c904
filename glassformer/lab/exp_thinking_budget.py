"""Seed 000 §2.5.2: a thinking model writes a chain of thought before its answer, spends "数倍到
数十倍" more output tokens and time on it, thinks longer on harder problems, and a "思考预算"
trades quality for cost: "简单问题少想、复杂问题多想".

Measured on a model trained here (train/arith.py, the run of configs/arith-think.toml): a small
GPT that learned multi-digit addition both ways, with its column-by-column steps inside
<think> ... </think> and answering at once after an empty segment. Each seed trains one model;
each is then asked the same held-out problems of 1 to 4 digits, greedily, with thinking budgets
from 0 (the engine closes the segment at once: the direct answer) through a few token counts
(the engine closes it when they are spent) to no limit. Per difficulty and budget: accuracy,
output tokens and wall time per answer, and the time until the answer starts.

What this model is not: its thinking was shown to it (supervised worked steps), not found by
reinforcement learning, so "thinks longer on harder problems" here means it learned to, from
demonstrations whose length grows with the digits; the notes say so beside the numbers.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import tempfile
from pathlib import Path

from glassformer.lab import base as lab

# configs/arith-think.toml's model and data (tests/test_arith.py keeps the two the same); the
# steps and seeds are the lab's, by mode.
MODEL = {
    "d_model": 128,
    "n_layers": 4,
    "n_heads": 4,
    "max_seq_len": 64,
    "position": "rope",
    "norm": "rms",
    "ffn": "swiglu",
    "dropout": 0.0,
}
DATA = {"task": "arith", "arith_max_digits": 4, "think_fraction": 0.67}
TRAIN = {"batch_size": 64, "learning_rate": 3e-3, "min_lr": 3e-4, "warmup_steps": 50}
# The config trains 1800 steps (9.5 min on 2 cores); three seeds of that would take half an
# hour. By 1200 steps every seed thinks its way to >=90% at every difficulty (the precondition
# below); the direct answers are still improving then (the note gives the loss's last fall).
# Quick mode trains half as long, with one seed.
FULL_STEPS = 1200
CONFIG_STEPS = 1800
LEARNED = 0.9  # precondition: with no budget limit, at least this accuracy at every difficulty
TINY_MODEL = {**MODEL, "d_model": 32, "n_layers": 1, "n_heads": 2}
BUDGETS = (0, 4, 8, 16, 24, None)  # None: no limit
PROBLEM_SEED = 7  # the held-out problems: the same for every seed and budget

# Thresholds, stated once. Thinking helps: on every multi-step problem (2 digits and up) the
# unlimited budget's accuracy beats the direct answer's by more than the seeds' spread plus
# MIN_GAIN. "数倍": output tokens and wall time per answer at least MIN_COST_RATIO times the
# direct answer's at every difficulty (the low end of the claim's range). Longer on harder
# problems: each extra digit adds at least MIN_EXTRA_THOUGHT thinking tokens beyond the spread.
# "少想/多想, 在质量和成本之间取舍": the smallest budget that reaches SUFFICIENT of the unlimited
# accuracy is larger (by a token or more) for the hardest problems than for the easiest, and
# accuracy over all difficulties does not fall (beyond the spread) as the budget grows.
MIN_GAIN = 0.10
MIN_COST_RATIO = 2.0
MIN_EXTRA_THOUGHT = 1.0
SUFFICIENT = 0.9


def _train(ctx: lab.RunContext, seed: int, steps: int, out: Path):
    from glassformer.train.config import RunConfig
    from glassformer.train.trainer import Trainer

    model = ctx.pick(MODEL, MODEL, TINY_MODEL)
    train = {
        **TRAIN,
        "out_dir": str(out),
        "max_steps": steps,
        "seed": seed,
        "warmup_steps": min(TRAIN["warmup_steps"], steps),
        "eval_interval": steps,
        "eval_batches": 4,
        "checkpoint_interval": steps,
        "threads": ctx.threads,
    }
    run = RunConfig.from_dict({"model": model, "data": DATA, "train": train})
    trainer = Trainer(run, progress=False, overwrite=True)
    result = trainer.fit()
    return trainer.model.eval(), trainer.tokenizer, result


FALL_WINDOW = 100


def _last_fall(losses: list[float]) -> float:
    """How much the mean training loss of the last FALL_WINDOW steps fell below the mean of the
    FALL_WINDOW before them, as a fraction of the earlier one (lab.converged's measure; nan for
    a run too short to have two windows)."""
    if len(losses) < 2 * FALL_WINDOW:
        return float("nan")
    return lab.converged("", losses, FALL_WINDOW, 0.0).measured


def _problems(n: int) -> dict[int, list]:
    from glassformer.data.arith import make_problem

    rng = random.Random(PROBLEM_SEED)
    return {
        d: [make_problem(rng, d) for _ in range(n)] for d in range(1, DATA["arith_max_digits"] + 1)
    }


def _measure(model, tokenizer, problems: dict[int, list]) -> dict:
    """For each (digits, budget): accuracy, mean thinking and output tokens, and the median
    seconds per answer and until the answer starts (medians: one slow step, a page fault or a
    timer tick, should not move a cell)."""
    from glassformer.train.arith import ask

    out = {}
    for digits, batch in problems.items():
        for budget in BUDGETS:
            answers = ask(model, tokenizer, batch, budget)
            out[(digits, budget)] = {
                "accuracy": statistics.fmean(a.correct for a in answers),
                "thinking": statistics.fmean(a.thinking_tokens for a in answers),
                "output": statistics.fmean(a.output_tokens for a in answers),
                "seconds": statistics.median(a.seconds for a in answers),
                "first_answer": statistics.median(a.thinking_seconds for a in answers),
            }
    return out


def _sufficient_budget(run: dict, digits: int) -> float:
    """The smallest budget whose accuracy reaches SUFFICIENT of the unlimited one (unlimited
    counts as one step past the largest budget; 0 when the direct answer already does)."""
    finite = [b for b in BUDGETS if b is not None]
    goal = SUFFICIENT * run[(digits, None)]["accuracy"]
    for budget in finite:
        if run[(digits, budget)]["accuracy"] >= goal:
            return float(budget)
    return float(finite[-1] + (finite[-1] - finite[-2]))


def _label(budget: int | None) -> str:
    return "no limit" if budget is None else str(budget)


@lab.register("thinking-budget")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    steps = ctx.pick(FULL_STEPS, FULL_STEPS // 2, 6)
    seeds = ctx.seeds(quick=1)
    problems = _problems(ctx.pick(100, 40, 2))
    runs, losses, falls = [], [], []
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="lab-think-") as tmp:
            model, tokenizer, result = _train(ctx, seed, steps, Path(tmp))
        losses.append((result.val_loss, result.baseline_loss))
        falls.append(_last_fall(result.train_losses))
        runs.append(_measure(model, tokenizer, problems))
    cells = Cells(runs)
    digits = sorted(problems)
    say = ctx.say
    checks = [
        lab.precondition(
            lab.at_most(
                say(
                    "val loss / unigram entropy, worst seed", "验证损失 / 一元熵，取最差的随机种子"
                ),
                max(v / b for v, b in losses),
                0.5,
            )
        ),
        lab.precondition(
            lab.at_least(
                say(
                    "accuracy with no budget limit, the least over digits and seeds",
                    "不限预算时的准确率，各位数和各随机种子中的最小值",
                ),
                min(r[(d, None)]["accuracy"] for r in runs for d in digits),
                LEARNED,
            )
        ),
        *_checks(ctx, cells, digits),
    ]
    partial = [
        (d, b)
        for d in digits
        for b in BUDGETS[1:-1]
        if cells.mean("accuracy", d, b) < cells.mean("accuracy", d, 0)
    ]
    model_cfg = ctx.pick(MODEL, MODEL, TINY_MODEL)
    batch_size, n_seeds, n_problems = TRAIN["batch_size"], len(seeds), len(problems[1])
    notes = [
        say(
            f"model: {model_cfg}, {steps} steps of {batch_size}"
            f" packed rows, {n_seeds} seed(s); {n_problems} held-out problems per"
            " difficulty, greedy, one at a time",
            f"模型：{model_cfg}，训练 {steps} 步，每步 {batch_size} 条打包的行，{n_seeds} 个"
            f"随机种子；每个难度 {n_problems} 道留出题，贪心解码，一次一道",
        ),
        say(
            "its thinking is imitated from worked steps (supervised), not found by reinforcement"
            " learning: the steps it was shown grow with the digits, so thinking longer on harder"
            " problems is learned behaviour, not discovered",
            "它的思考是模仿示范的解题步骤学来的（监督学习），不是通过强化学习自己找到的：给它看的"
            "步骤随位数增长，所以难题想得更久是学来的行为，而不是自己发现的",
        ),
        say(
            f"training loss, its fall over the last {FALL_WINDOW} steps: {max(falls):.0%}"
            " (worst seed). Its thinking answers had reached the precondition; a model that is"
            " still learning may yet improve its direct answers (budget 0 in the table), so the"
            f" direct answer compared is that of a model trained {steps} steps"
            f" (configs/arith-think.toml trains {CONFIG_STEPS})",
            f"训练损失在最后 {FALL_WINDOW} 步里的降幅：{max(falls):.0%}（最差的随机种子）。带思考的"
            "回答已满足前提条件；仍在学习的模型，直接回答（表中预算 0）可能还会变好，所以这里比较的"
            f"是训练 {steps} 步的模型的直接回答（configs/arith-think.toml 训练 {CONFIG_STEPS} 步）",
        ),
        say(
            "budgets that did worse than answering directly (thinking cut off mid-step): "
            + (", ".join(f"{d} digit(s) at budget {b}" for d, b in partial) or "none"),
            "比直接回答更差的预算（思考在某一步中途被截断）："
            + ("，".join(f"{d} 位数、预算 {b}" for d, b in partial) or "没有"),
        ),
    ]
    data = {
        "runs": [{f"{d}:{_label(b)}": v for (d, b), v in r.items()} for r in runs],
        "losses": losses,
        "steps": steps,
        "seeds": seeds,
        "budgets": list(BUDGETS),
    }
    return lab.Result.from_checks(
        _rows(ctx, cells, digits), checks, figure=_plot(cells, digits), data=data, notes=notes
    )


class Cells:
    """The measurements of every seed, by (what, digits, budget)."""

    def __init__(self, runs: list[dict]) -> None:
        self.runs = runs

    def over_seeds(self, what: str, digits: int, budget: int | None) -> lab.Spread:
        return lab.over_seeds([r[(digits, budget)][what] for r in self.runs])

    def mean(self, what: str, digits: int, budget: int | None) -> float:
        return self.over_seeds(what, digits, budget).mean


def _rows(ctx: lab.RunContext, cells: Cells, digits: list[int]) -> list[dict]:
    say = ctx.say
    say("no limit", "不限")
    keys = {
        k: say(k, zh)
        for k, zh in (
            ("digits", "位数"),
            ("budget", "预算"),
            ("accuracy", "准确率"),
            ("thinking tokens", "思考 token 数"),
            ("output tokens", "输出 token 数"),
            ("ms per answer (median)", "每个回答的 ms（中位数）"),
            ("ms to answer start (median)", "到开始作答的 ms（中位数）"),
        )
    }
    return [
        {
            keys["digits"]: d,
            keys["budget"]: _label(b),
            keys["accuracy"]: str(cells.over_seeds("accuracy", d, b)),
            keys["thinking tokens"]: f"{cells.mean('thinking', d, b):.1f}",
            keys["output tokens"]: f"{cells.mean('output', d, b):.1f}",
            keys["ms per answer (median)"]: f"{1000 * cells.mean('seconds', d, b):.1f}",
            keys["ms to answer start (median)"]: f"{1000 * cells.mean('first_answer', d, b):.1f}",
        }
        for d in digits
        for b in BUDGETS
    ]


def _checks(ctx: lab.RunContext, cells: Cells, digits: list[int]) -> list[lab.Check]:
    say = ctx.say
    checks = []
    group = say("thinking buys accuracy on multi-step problems", "在多步问题上，思考换来准确率")
    for d in (d for d in digits if d >= 2):
        unlimited, direct = (cells.over_seeds("accuracy", d, b) for b in (None, 0))
        what = say(
            f"{d} digits: accuracy with no limit - direct",
            f"{d} 位数：不限预算的准确率减直接回答的",
        )
        checks.append(lab.exceeds_spread(what, unlimited, direct, MIN_GAIN, group=group))
    group = say("数倍 the output tokens and time", "输出 token 数和时间增至数倍")
    for what, label, label_zh in (
        ("output", "output tokens per answer", "每个回答的输出 token 数"),
        ("seconds", "time per answer", "每个回答的时间"),
        ("first_answer", "time until the answer starts", "到开始作答的时间"),
    ):
        ratio = min(cells.mean(what, d, None) / cells.mean(what, d, 0) for d in digits)
        checks.append(
            lab.at_least(
                say(
                    f"{label}, no limit / direct, the least over digits",
                    f"{label_zh}，不限预算 / 直接回答，各位数中的最小值",
                ),
                ratio,
                MIN_COST_RATIO,
                group=group,
            )
        )
    group = say("harder problems, longer thinking (no budget)", "问题越难，思考越长（不限预算）")
    for d in digits[1:]:
        longer, shorter = (cells.over_seeds("thinking", n, None) for n in (d, d - 1))
        what = say(
            f"thinking tokens: {d} digits - {d - 1}", f"思考 token 数：{d} 位数减 {d - 1} 位数"
        )
        checks.append(lab.exceeds_spread(what, longer, shorter, MIN_EXTRA_THOUGHT, group=group))
    group = say(
        "a budget trades quality for cost: easy problems need less",
        "预算在质量和成本之间取舍：简单问题需要的更少",
    )
    needed = {d: lab.over_seeds([_sufficient_budget(r, d) for r in cells.runs]) for d in digits}
    checks.append(
        lab.exceeds_spread(
            say(
                f"budget reaching {SUFFICIENT:.0%} of the unlimited accuracy: {digits[-1]} digits "
                "- 1",
                f"达到不限预算准确率 {SUFFICIENT:.0%} 所需的预算：{digits[-1]} 位数减 1 位数",
            ),
            needed[digits[-1]],
            needed[digits[0]],
            margin=1,
            group=group,
        )
    )
    overall = {
        b: lab.over_seeds(
            [statistics.fmean(r[(d, b)]["accuracy"] for d in digits) for r in cells.runs]
        )
        for b in BUDGETS
    }
    falls = [
        overall[a].mean - overall[b].mean - math.hypot(overall[a].spread, overall[b].spread)
        for a, b in itertools.pairwise(BUDGETS)
    ]
    checks.append(
        lab.at_most(
            say(
                "accuracy over all digits: the largest fall (beyond the spread) "
                "as the budget grows",
                "全部位数上的准确率：预算增加时最大的下降（超出波动的部分）",
            ),
            max(falls),
            0.0,
            group=group,
        )
    )
    return checks


def _plot(cells: Cells, digits: list[int]):
    fig, (left, right) = lab.new_figure(9.0, 3.6, ncols=2)
    x = list(range(len(BUDGETS)))
    for d in digits:  # error bars: the spread over the random seeds
        accuracy = [cells.over_seeds("accuracy", d, b) for b in BUDGETS]
        left.errorbar(
            x,
            [a.mean for a in accuracy],
            yerr=[a.spread for a in accuracy],
            marker="o",
            capsize=3,
            label=f"{d} digit{'s' if d > 1 else ''}",
        )
    left.set_xticks(x, [_label(b) for b in BUDGETS])
    left.set(
        xlabel="thinking budget (tokens)",
        ylabel="accuracy (mean ± spread over seeds)",
        title="accuracy vs thinking budget (思考预算)",
        ylim=(-0.05, 1.05),
    )
    left.legend(fontsize=8)
    for what, budget, style, label in (
        ("output", 0, "s--", "output tokens, budget 0"),
        ("output", None, "o-", "output tokens, no limit"),
        ("thinking", None, "^:", "of which thinking (no limit)"),
    ):
        tokens = [cells.over_seeds(what, d, budget) for d in digits]
        right.errorbar(
            digits,
            [t.mean for t in tokens],
            yerr=[t.spread for t in tokens],
            fmt=style,
            capsize=3,
            label=label,
        )
    right.set_xticks(digits)
    right.set(
        xlabel="digits per number (difficulty)",
        ylabel="tokens per answer (mean ± spread)",
        title="cost: output tokens per answer",
    )
    right.legend(fontsize=8)
    return fig
