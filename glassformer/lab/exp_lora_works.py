"""Seed 002: "为什么微调有效：预训练已经把语言规律压进了那些矩阵，微调只是在现成基础上小幅调向。LoRA
敢只训 1% 参数，赌的就是'底子不用动'": fine-tuning a pretrained model with low-rank adapters on
about 1% of its parameters works, because the base need not move.

The base is the lab's character GPT pretrained on all the plays in modern spelling (lab/char_gpt.py,
one per random seed, cached). The new task is the same plays as the First Folio printed them
("Thou art more louely"), with the data a fine-tune has, little beside the pretraining: Folio
Hamlet (about 4% of the pretraining text) to fine-tune on, Folio Julius Caesar to stop on, Folio
Macbeth held out to judge. (With three Folio plays, a tenth of the pretraining text, a model
trained from scratch already matched LoRA on the base: that is pretraining, not fine-tuning.)
With the same steps and batches, per seed:

    the base, not fine-tuned          what pretraining alone gives (the "copy" baseline)
    LoRA on q,v (r = 4)               about 1% of the parameters train
    full fine-tune                    every parameter
    from scratch                      every parameter, from random weights: no 底子

(LoRA on every linear layer, and on the FFN alone, are lora-targets' question.)

Every system trains until its validation loss (Folio Julius Caesar) stops falling, and keeps its
best weights (early stopping, as any fine-tune does); quality is their held-out Folio Macbeth
loss (nats per character). The full fine-tune's relative weight change is a row: how far
"小幅调向" moved the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassformer.lab import base as lab
from glassformer.lab.char_gpt import char_gpt
from glassformer.lab.fit import Schedule, eval_loss, window_batches
from glassformer.models import build_model
from glassformer.nn.lora import apply_lora, trainable_fraction
from glassformer.train.trainer import learning_rate, make_optimizer

FINE_TUNE_PLAYS = ("hamlet",)
VALIDATION_PLAY = "julius_caesar"  # where each run's best weights are chosen
HELD_OUT_PLAY = "macbeth"  # where they are judged
LORA_RANK, LORA_ALPHA = 4, 8
LORA_LR, FULL_LR = 3e-3, 1e-3  # the base's own rate for adapters, a third of it for every weight
PLATEAU_TOLERANCE = 0.03
# Thresholds, stated once. Preconditions: every run reached its plateau (the mean validation
# loss of its last fifth of evaluations within 3% of the fifth before, worst seed; a run whose
# validation loss rises again has passed its best, which early stopping keeps). "It works": LoRA
# on q,v beats the untouched base on held-out Folio text by more than the seeds' spread plus
# 0.05 nats, and gets at least 80% of the full fine-tune's gain over the base. "底子不用动": LoRA
# on the pretrained base beats training every weight from scratch on the same data by more than
# the spread.
MIN_GAIN = 0.05
MIN_SHARE_OF_FULL = 0.8

SYSTEMS = {  # key -> (label, LoRA targets or "full", start from the pretrained base)
    "lora-qv": ("LoRA q,v", "q,v", True),
    "full": ("full fine-tune", "full", True),
    "scratch": ("from scratch", "full", False),
}
SYSTEMS_ZH = {
    "lora-qv": "LoRA q,v",
    "full": "全量微调",
    "scratch": "从零训练",
}


@dataclass(frozen=True)
class Budget:
    steps: int
    batch_size: int
    every: int  # steps between validation losses
    n_val: int  # validation windows per evaluation
    n_test: int  # held-out windows for the final loss


def budget(ctx: lab.RunContext) -> Budget:
    return ctx.pick(
        full=Budget(600, 16, 25, 64, 256),
        quick=Budget(150, 8, 10, 32, 96),
        tiny=Budget(8, 2, 2, 2, 4),
    )


@dataclass(frozen=True)
class Folio:
    """The First Folio text as the modern tokenizer's characters (the 4 characters the modern
    text never uses are dropped): the plays to fine-tune on, the one to stop on, the one to
    judge on."""

    train: Tensor
    val: Tensor
    test: Tensor


def folio_ids(tokenizer) -> Folio:
    from glassformer.data.corpus import shakespeare_plays

    plays = shakespeare_plays("folio")
    for name in (*FINE_TUNE_PLAYS, VALIDATION_PLAY, HELD_OUT_PLAY):
        if name not in plays:
            raise ValueError(f"no Folio play named {name!r}: pick one of {', '.join(plays)}")
    known = set(tokenizer.chars)

    def ids(text: str) -> Tensor:
        return torch.tensor(tokenizer.encode("".join(c for c in text if c in known)))

    train = "\n\n\n".join(plays[name] for name in FINE_TUNE_PLAYS)
    return Folio(ids(train), ids(plays[VALIDATION_PLAY]), ids(plays[HELD_OUT_PLAY]))


@dataclass
class Tuned:
    losses: list[float]  # training loss per step
    val_losses: list[float]  # validation loss every budget.every steps
    best_step: int  # the step whose weights were kept (lowest validation loss)
    held_out: float  # the kept weights' loss on the held-out play, nats per character
    fraction: float  # trainable share of the parameters
    moved: float  # ||W - W_base|| / ||W_base|| over the block weights (0 for LoRA's frozen ones)


def block_weights(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("blocks.")}


def relative_change(before: dict[str, Tensor], model: nn.Module) -> float:
    after = dict(model.named_parameters())
    num = sum((after[n].detach() - w).pow(2).sum() for n, w in before.items() if n in after)
    den = sum(w.pow(2).sum() for w in before.values())
    return float((num / den).sqrt())


def fine_tune(
    ctx: lab.RunContext,
    base: nn.Module,
    targets: str,
    pretrained: bool,
    seed: int,
    folio: Folio,
    rank: int = LORA_RANK,
) -> Tuned:
    """One system: a copy of the base (or a fresh one of its shape), LoRA on `targets` or every
    weight ("full"), trained on folio.train with the seed's batches. fit()'s loop, with the
    validation loss every budget.every steps and the weights of the best one kept."""
    size = budget(ctx)
    torch.manual_seed(seed)
    model = build_model(base.cfg)
    if pretrained:
        model.load_state_dict(base.state_dict())
    before = block_weights(model)
    if targets != "full":
        apply_lora(model, targets, rank=rank, alpha=2 * rank)
    lr = FULL_LR if targets == "full" and pretrained else LORA_LR
    schedule = Schedule(
        max_steps=size.steps,
        learning_rate=lr,
        warmup_steps=max(1, size.steps // 20),
        weight_decay=0.0,
    )
    context = base.cfg.max_seq_len
    batch = window_batches(folio.train, size.batch_size, context, seed)
    optimizer = make_optimizer(model, schedule)
    losses, val_losses, best_step, best = [], [], 0, None
    for step in range(1, size.steps + 1):
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step - 1, schedule)
        out = model.loss(**batch(step - 1))
        losses.append(out.ce_loss.item())
        out.loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), schedule.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % size.every == 0:
            val_losses.append(eval_loss(model, folio.val, context, size.n_val, seed=seed))
            if val_losses[-1] == min(val_losses):
                best_step = step
                best = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best)
    model.eval()
    fraction = trainable_fraction(model)
    moved = relative_change(before, model) if targets == "full" and pretrained else 0.0
    loss = eval_loss(model, folio.test, context, size.n_test, seed=seed)
    return Tuned(losses, val_losses, best_step, loss, fraction, moved)


def plateau(ctx: lab.RunContext, label: str, label_zh: str, runs: list[Tuned]) -> lab.Check:
    """lab.converged on the validation losses, for the seed whose loss still fell most over the
    last fifth of its evaluations."""
    window = max(1, len(runs[0].val_losses) // 5)
    what = ctx.say(
        f"{label}: relative validation-loss drop over the last fifth of training, worst seed",
        f"{label_zh}：训练最后五分之一的验证损失相对降幅（最差的随机种子）",
    )
    return max(
        (lab.converged(what, r.val_losses, window, PLATEAU_TOLERANCE) for r in runs),
        key=lambda c: c.measured,
    )


@lab.register("lora-works")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say, seeds = ctx.say, ctx.seeds()
    runs: dict[str, list[Tuned]] = {key: [] for key in SYSTEMS}
    base_loss = []
    for seed in seeds:
        gpt = char_gpt(ctx, seed=seed)
        folio = folio_ids(gpt.tokenizer)
        base_loss.append(
            eval_loss(gpt.model, folio.test, gpt.recipe.context, budget(ctx).n_test, seed=seed)
        )
        for key, (_, targets, pretrained) in SYSTEMS.items():
            runs[key].append(fine_tune(ctx, gpt.model, targets, pretrained, seed, folio))
    base = lab.over_seeds(base_loss)
    held_out = {key: lab.over_seeds([r.held_out for r in rs]) for key, rs in runs.items()}
    for key, label in ((k, v[0]) for k, v in SYSTEMS.items()):
        say(label, SYSTEMS_ZH[key])
    checks = [plateau(ctx, SYSTEMS[k][0], SYSTEMS_ZH[k], runs[k]) for k in SYSTEMS]
    share = runs["lora-qv"][0].fraction
    works = say(
        f"LoRA on q,v ({share:.1%} of the parameters) works", f"LoRA q,v（{share:.1%} 的参数）有效"
    )
    full_gain = base.mean - held_out["full"].mean
    lora_gain = base.mean - held_out["lora-qv"].mean
    checks += [
        lab.exceeds_spread(
            say("held-out loss: base - LoRA q,v (nats)", "留出损失：基座 - LoRA q,v（nats）"),
            base,
            held_out["lora-qv"],
            MIN_GAIN,
            group=works,
        ),
        lab.at_least(
            say(
                "LoRA q,v's share of the full fine-tune's gain over the base",
                "LoRA q,v 拿到的全量微调相对基座增益的比例",
            ),
            lora_gain / full_gain if full_gain > 0 else 0.0,
            MIN_SHARE_OF_FULL,
            group=works,
        ),
        lab.exceeds_spread(
            say(
                "held-out loss: from scratch - LoRA q,v on the base (nats)",
                "留出损失：从零训练 - 基座上的 LoRA q,v（nats）",
            ),
            held_out["scratch"],
            held_out["lora-qv"],
            group=say("the base need not move (底子不用动)", "底子不用动"),
        ),
    ]
    rows = _rows(ctx, base, held_out, runs)
    notes = _notes(ctx, seeds, runs, base, held_out)
    data = {
        "seeds": seeds,
        "base": base_loss,
        "held_out": {k: [r.held_out for r in rs] for k, rs in runs.items()},
        "fraction": {k: rs[0].fraction for k, rs in runs.items()},
        "moved": [r.moved for r in runs["full"]],
        "best_step": {k: [r.best_step for r in rs] for k, rs in runs.items()},
        "val_losses": {k: [r.val_losses for r in rs] for k, rs in runs.items()},
    }
    figure = _plot(runs, base, held_out, budget(ctx).every)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _rows(ctx, base: lab.Spread, held_out: dict, runs: dict) -> list[dict]:
    say = ctx.say
    system, share = say("system", "方案"), say("trainable share", "可训练参数占比")
    loss = say("held-out Folio Macbeth loss (nats/char)", "留出的 Folio《麦克白》损失（nats/字符）")
    moved = say("relative weight change", "权重相对变化")
    rows = [
        {
            system: say("base, not fine-tuned", "基座，未微调"),
            share: "0",
            loss: str(base),
            moved: 0.0,
        }
    ]
    for key, (label, _, _) in SYSTEMS.items():
        rows.append(
            {
                system: label,
                share: f"{runs[key][0].fraction:.2%}",
                loss: str(held_out[key]),
                moved: lab.over_seeds([r.moved for r in runs[key]]).mean if key == "full" else "-",
            }
        )
    return rows


def _notes(ctx, seeds, runs, base, held_out) -> list[str]:
    size, gpt = budget(ctx), char_gpt(ctx, seed=seeds[0])
    moved = lab.over_seeds([r.moved for r in runs["full"]])
    shape = gpt.recipe.shape
    gains = {k: base.mean - held_out[k].mean for k in SYSTEMS}
    best = {k: ", ".join(str(r.best_step) for r in rs) for k, rs in runs.items()}
    best_zh = {k: "、".join(str(r.best_step) for r in rs) for k, rs in runs.items()}
    return [
        ctx.say(
            f"base: the lab's char GPT ({shape}) pretrained on the modern-spelling plays, "
            f"one per seed ({seeds}); fine-tuned up to {size.steps} steps of {size.batch_size} "
            f"windows on Folio Hamlet, the validation loss on Folio Julius Caesar every "
            f"{size.every} steps, the best weights kept; LoRA rank {LORA_RANK}, alpha "
            f"{LORA_ALPHA}, lr {LORA_LR:g}; full fine-tune lr {FULL_LR:g}; from scratch lr "
            f"{LORA_LR:g}",
            f"基座：本实验室在现代拼写剧本上预训练的字符级 GPT（{shape}），每个随机种子一个"
            f"（{seeds}）；在第一对开本《哈姆雷特》上最多微调 {size.steps} 步，每步 "
            f"{size.batch_size} 个窗口，每 {size.every} 步在 Folio《裘力斯·凯撒》上算一次验证"
            f"损失，保留最好的权重；LoRA 秩 {LORA_RANK}，alpha {LORA_ALPHA}，学习率 "
            f"{LORA_LR:g}；全量微调学习率 {FULL_LR:g}；从零训练学习率 {LORA_LR:g}",
        ),
        ctx.say(
            f"the step whose weights were kept (by seed): LoRA q,v {best['lora-qv']}; full "
            f"fine-tune {best['full']}; from scratch {best['scratch']}",
            f"被保留权重所在的步数（按随机种子）：LoRA q,v {best_zh['lora-qv']}；全量微调 "
            f"{best_zh['full']}；从零训练 {best_zh['scratch']}",
        ),
        ctx.say(
            f"gain over the base on held-out Folio Macbeth: LoRA q,v {gains['lora-qv']:.3f}, "
            f"full fine-tune {gains['full']:.3f}, from scratch {gains['scratch']:.3f} "
            f"nats/char; the full fine-tune moved the block weights by {moved.mean:.1%} of "
            "their norm",
            f"在留出的 Folio《麦克白》上相对基座的增益：LoRA q,v {gains['lora-qv']:.3f}，"
            f"全量微调 {gains['full']:.3f}，从零训练 {gains['scratch']:.3f} nats/字符；"
            f"全量微调让各层权重移动了其范数的 {moved.mean:.1%}",
        ),
        ctx.say(
            "docs/finetune.md has the same comparison on SmolLM2-135M with real weights "
            "(benchmarks/finetune_quality.py, modernising Folio speeches, chrF): too slow "
            "for the lab's seeds on 2 cores, about 10 minutes per fine-tune",
            "docs/finetune.md 里有在 SmolLM2-135M 真实权重上的同类对比"
            "（benchmarks/finetune_quality.py，把 Folio 台词改写成现代拼写，chrF）：在 2 核上"
            "每次微调约 10 分钟，跑不了实验室要求的多个随机种子",
        ),
    ]


def _plot(runs: dict, base: lab.Spread, held_out: dict, every: int):
    fig, (left, right) = lab.new_figure(10.0, 3.6, ncols=2)
    for i, (key, rs) in enumerate(runs.items()):
        curves = [r.val_losses for r in rs]
        mean = [sum(v) / len(v) for v in zip(*curves, strict=True)]
        steps = [every * (j + 1) for j in range(len(mean))]
        left.plot(steps, mean, color=f"C{i}", label=SYSTEMS[key][0])
    left.set(
        xlabel="fine-tuning step",
        ylabel="validation loss (nats/char, mean over seeds)",
        title="fine-tuning on Folio Hamlet, judged on Julius Caesar",
    )
    left.legend(fontsize=7)
    for i, (key, rs) in enumerate(runs.items()):
        share = 100 * rs[0].fraction
        right.errorbar(
            [share],
            [held_out[key].mean],
            yerr=[held_out[key].spread],
            marker="o",
            capsize=3,
            color=f"C{i}",
            label=f"{SYSTEMS[key][0]} ({share:.3g}%)",
        )
    right.axhline(base.mean, color="grey", linestyle=":", label=f"base ({base.mean:.2f})")
    right.set_xscale("log")
    right.set(
        xlabel="parameters trained (%, log scale)",
        ylabel="held-out Folio Macbeth loss (nats/char)",
        title="quality against the trainable share",
    )
    right.legend(fontsize=7)
    return fig
