"""Seed 000 §2.4's first chunking strategy: "硬截断 | 只取前 max_len 个 token，其余丢弃 | 文本分类等
'看开头就够'的任务". Truncation is enough when the label is in the opening, and loses it otherwise.

Synthetic documents of DOC_LEN tokens: random filler and one cue token, one of N_CLASSES, which
is the label. In the "opening" task the cue sits in the first CUE_SPAN tokens, in the "ending"
task in the last CUE_SPAN. Two identical small encoders (glassformer's BERT family, mean-pooled
into a linear head) train on each task with the same steps and batches: one reads the whole
document, one its first MAX_LEN tokens only (hard truncation). Held-out accuracy.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.fit import Schedule, fit, step_generator
from glassformer.models import build_model
from glassformer.models.common import LossOutput

N_CLASSES, N_FILLER = 4, 32
DOC_LEN, MAX_LEN, CUE_SPAN = 128, 32, 16
CHANCE = 1 / N_CLASSES
TASKS = ("opening", "ending")
READERS = ("whole document", f"first {MAX_LEN} tokens")
# Thresholds, stated once. Preconditions: the whole-document reader learns both tasks (held-out
# accuracy at least 0.9; else neither reader tells anything) and every run reached its plateau
# (the last fifth's mean loss within 3% of the fifth before, or below 0.05 nats). "看开头就够":
# on the opening task the truncated reader is within 0.05 of the whole-document one, and its
# training takes at most half the CPU time (a quarter of the tokens). That it cannot read a
# label in the ending is so by construction (the ending is never given to it): a row, not
# evidence.
MIN_LEARNED, SAME, MAX_TIME_SHARE = 0.9, 0.05, 0.5
PLATEAU_TOLERANCE = 0.03


class Classifier(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.body = build_model(cfg)
        self.head = nn.Linear(cfg.d_model, N_CLASSES)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(self.body(input_ids).mean(dim=1))  # (B, N_CLASSES)

    def loss(self, input_ids: Tensor, labels: Tensor) -> LossOutput:
        ce = F.cross_entropy(self(input_ids), labels)
        return LossOutput(loss=ce, ce_loss=ce, aux_loss=ce.new_zeros(()))


def documents(task: str, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(n, DOC_LEN) filler ids with the label's cue token in the opening or the ending span."""
    ids = N_CLASSES + torch.randint(0, N_FILLER, (n, DOC_LEN), generator=generator)
    labels = torch.randint(0, N_CLASSES, (n,), generator=generator)
    offset = 0 if task == "opening" else DOC_LEN - CUE_SPAN
    at = offset + torch.randint(0, CUE_SPAN, (n,), generator=generator)
    ids[torch.arange(n), at] = labels
    return ids, labels


def train_reader(ctx: lab.RunContext, task: str, length: int, seed: int):
    steps, batch_size = ctx.pick(600, 300, 4), ctx.pick(32, 32, 4)
    cfg = ModelConfig(
        family="bert",
        vocab_size=N_CLASSES + N_FILLER,
        d_model=ctx.pick(64, 64, 16),
        n_layers=2,
        n_heads=4,
        max_seq_len=DOC_LEN,
        position="rope",
    )
    torch.manual_seed(seed)
    model = Classifier(cfg)

    def batch(step: int) -> dict[str, Tensor]:
        ids, labels = documents(task, batch_size, step_generator(seed, step))
        return {"input_ids": ids[:, :length], "labels": labels}

    schedule = Schedule(
        max_steps=steps, learning_rate=3e-3, warmup_steps=max(1, steps // 20), weight_decay=0.0
    )
    start = time.process_time()
    losses = fit(model, batch, schedule)
    seconds = time.process_time() - start
    ids, labels = documents(task, ctx.pick(2000, 1000, 16), torch.Generator().manual_seed(9_999))
    with torch.no_grad():
        accuracy = float((model.eval()(ids[:, :length]).argmax(-1) == labels).float().mean())
    return accuracy, losses, seconds


def plateau(what: str, losses: list[float]) -> lab.Check:
    """Precondition: lab.converged's relative drop, counted as 0 once the loss is below 0.05
    nats (a loss that small has nothing left to learn, and its relative change is noise)."""
    window = max(1, len(losses) // 5)
    drop = lab.converged(what, losses, window, PLATEAU_TOLERANCE).measured
    tail = sum(losses[-window:]) / window
    return lab.precondition(lab.at_most(what, drop if tail > 0.05 else 0.0, PLATEAU_TOLERANCE))


@lab.register("hard-truncation")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say, seeds = ctx.say, ctx.seeds()
    acc = {(t, r): [] for t in TASKS for r in READERS}
    cost = {r: [] for r in READERS}  # CPU seconds of training
    checks = []
    for seed in seeds:
        for task in TASKS:
            for reader, length in zip(READERS, (DOC_LEN, MAX_LEN), strict=True):
                accuracy, losses, seconds = train_reader(ctx, task, length, seed)
                acc[(task, reader)].append(accuracy)
                cost[reader].append(seconds)
                checks.append(
                    plateau(
                        say(
                            f"{task} task, {reader}, seed {seed}: relative loss "
                            "drop over the last fifth (0 below 0.05 nats)",
                            f"{_zh(task)}任务，{_zh(reader)}，随机种子 {seed}：最后"
                            "五分之一的损失相对降幅（低于 0.05 nats 记为 0）",
                        ),
                        losses,
                    )
                )
    spread = {k: lab.over_seeds(v) for k, v in acc.items()}
    whole, cut = READERS
    for task in TASKS:
        checks.append(
            lab.precondition(
                lab.at_least(
                    say(
                        f"{task} task: whole-document reader's accuracy",
                        f"{_zh(task)}任务：读全文的模型的准确率",
                    ),
                    spread[(task, whole)].mean,
                    MIN_LEARNED,
                )
            )
        )
    checks += [
        lab.at_least(
            say(
                "opening task: truncated - whole-document accuracy",
                "开头任务：截断 - 读全文的准确率",
            ),
            spread[("opening", cut)].mean - spread[("opening", whole)].mean,
            -SAME,
            group=say("enough when the opening holds the label", "看开头就够"),
        ),
        lab.at_most(
            say("training CPU time: truncated / whole document", "训练 CPU 时间：截断 / 读全文"),
            sum(cost[cut]) / sum(cost[whole]),
            MAX_TIME_SHARE,
            group=say("and cheaper", "而且更省"),
        ),
    ]
    task_col = say("task (where the label is)", "任务（标签所在位置）")
    time_col = say("training CPU s (mean)", "训练 CPU 秒数（均值）")
    rows = [
        {task_col: say(t, _zh(t)), **{say(r, _zh(r)): str(spread[(t, r)]) for r in READERS}}
        for t in TASKS
    ]
    rows.append(
        {task_col: time_col, **{say(r, _zh(r)): sum(cost[r]) / len(cost[r]) for r in READERS}}
    )
    notes = [
        ctx.say(
            f"documents of {DOC_LEN} tokens, one cue token among random filler ({N_CLASSES} "
            "classes, "
            f"chance {CHANCE:.2f}), the cue in the first or the last {CUE_SPAN}; 2-layer encoders, "
            f"mean-pooled; seeds {seeds}",
            f"文档长 {DOC_LEN} 个 token，随机填充中有一个提示 token（{N_CLASSES} 类，随机猜测 "
            f"{CHANCE:.2f}），提示在前 {CUE_SPAN} 个或后 {CUE_SPAN} 个 token 里；2 层编码器，"
            f"平均池化；随机种子 {seeds}",
        )
    ]
    data = {f"{t}|{r}": v for (t, r), v in acc.items()}
    return lab.Result.from_checks(rows, checks, figure=_plot(spread), data=data, notes=notes)


def _zh(word: str) -> str:
    return {
        "opening": "开头",
        "ending": "结尾",
        "whole document": "读全文",
        f"first {MAX_LEN} tokens": f"只读前 {MAX_LEN} 个 token",
    }[word]


def _plot(spread: dict):
    fig, ax = lab.new_figure(6.0, 3.4)
    for i, reader in enumerate(READERS):
        ax.bar(
            [j + (i - 0.5) * 0.38 for j in range(len(TASKS))],
            [spread[(t, reader)].mean for t in TASKS],
            0.38,
            yerr=[spread[(t, reader)].spread for t in TASKS],
            capsize=3,
            label=reader,
        )
    ax.axhline(CHANCE, color="grey", linestyle=":", label="chance")
    ax.set_xticks(range(len(TASKS)), [f"label in the {t}" for t in TASKS])
    ax.set(ylabel="held-out accuracy (mean ± spread)", ylim=(0, 1.05))
    ax.legend(fontsize=7)
    return fig
