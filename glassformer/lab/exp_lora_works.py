"""Seed 002: "为什么微调有效：预训练已经把语言规律压进了那些矩阵，微调只是在现成基础上小幅调向。LoRA
敢只训 1% 参数，赌的就是'底子不用动'": fine-tuning a pretrained model with low-rank adapters on
about 1% of its parameters works, because the base need not move.

The base is the lab's character GPT pretrained on the plays in modern spelling (lab/char_gpt.py,
one per random seed, cached). The new task is the same plays as the First Folio printed them
("Thou art more louely"): every play but Macbeth to fine-tune on, Folio Macbeth held out. With the
same steps and batches, per seed:

    the base, not fine-tuned          what pretraining alone gives
    LoRA on q,v (r = 4)               about 1% of the parameters train
    LoRA on every linear layer (r=4)  a few percent
    full fine-tune                    every parameter
    from scratch                      every parameter, from random weights: no 底子

Quality is the held-out Folio Macbeth loss (nats per character). The full fine-tune's relative
weight change is a row: how far "小幅调向" moved the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassformer.lab import base as lab
from glassformer.lab.char_gpt import char_gpt
from glassformer.lab.fit import Schedule, eval_loss, fit, window_batches
from glassformer.models import build_model
from glassformer.nn.lora import apply_lora, trainable_fraction

HELD_OUT_PLAY = "macbeth"
LORA_RANK, LORA_ALPHA = 4, 8
LORA_LR, FULL_LR = 3e-3, 1e-3  # the base's own rate for adapters, a third of it for every weight
PLATEAU_TOLERANCE = 0.03
# Thresholds, stated once. Preconditions: every fine-tune reached its plateau (the last fifth's
# mean loss within 3% of the fifth before, worst seed). "It works": LoRA on q,v beats the
# untouched base on held-out Folio text by more than the seeds' spread plus 0.05 nats, and gets
# at least 80% of the full fine-tune's gain over the base. "底子不用动": LoRA on the pretrained
# base beats training every weight from scratch with the same steps by more than the spread.
MIN_GAIN = 0.05
MIN_SHARE_OF_FULL = 0.8

SYSTEMS = {  # key -> (label, LoRA targets or "full", start from the pretrained base)
    "lora-qv": ("LoRA q,v", "q,v", True),
    "lora-all": ("LoRA all linear", "all-linear", True),
    "full": ("full fine-tune", "full", True),
    "scratch": ("from scratch", "full", False),
}
SYSTEMS_ZH = {
    "lora-qv": "LoRA q,v",
    "lora-all": "LoRA 全部线性层",
    "full": "全量微调",
    "scratch": "从零训练",
}


@dataclass(frozen=True)
class Budget:
    steps: int
    batch_size: int
    n_val: int  # held-out windows


def budget(ctx: lab.RunContext) -> Budget:
    return ctx.pick(full=Budget(600, 16, 256), quick=Budget(150, 8, 96), tiny=Budget(6, 2, 4))


def folio_ids(tokenizer, held_out: str = HELD_OUT_PLAY) -> tuple[Tensor, Tensor]:
    """(fine-tuning ids, held-out ids): the Folio plays but one, and that one, as the modern
    tokenizer's characters (the 4 characters the modern text never uses are dropped)."""
    from glassformer.data.corpus import shakespeare_plays

    plays = shakespeare_plays("folio")
    if held_out not in plays:
        raise ValueError(f"no Folio play named {held_out!r}: pick one of {', '.join(plays)}")
    known = set(tokenizer.chars)

    def ids(text: str) -> Tensor:
        return torch.tensor(tokenizer.encode("".join(c for c in text if c in known)))

    train = "\n\n\n".join(t for name, t in plays.items() if name != held_out)
    return ids(train), ids(plays[held_out])


@dataclass
class Tuned:
    losses: list[float]
    held_out: float  # loss on the held-out play, nats per character
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
    train: Tensor,
    held: Tensor,
    rank: int = LORA_RANK,
) -> Tuned:
    """One system: a copy of the base (or a fresh one of its shape), LoRA on `targets` or every
    weight ("full"), trained on `train` with the seed's batches; its held-out loss."""
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
    losses = fit(model, window_batches(train, size.batch_size, context, seed), schedule)
    fraction = trainable_fraction(model)
    moved = relative_change(before, model) if targets == "full" and pretrained else 0.0
    loss = eval_loss(model, held, context, size.n_val, seed=seed)
    return Tuned(losses, loss, fraction, moved)


def plateau(ctx: lab.RunContext, label: str, label_zh: str, runs: list[Tuned]) -> lab.Check:
    """lab.converged for the seed whose loss still fell most over the last fifth."""
    window = max(1, len(runs[0].losses) // 5)
    what = ctx.say(
        f"{label}: relative loss drop over the last fifth of training, worst seed",
        f"{label_zh}：训练最后五分之一的损失相对降幅（最差的随机种子）",
    )
    return max(
        (lab.converged(what, r.losses, window, PLATEAU_TOLERANCE) for r in runs),
        key=lambda c: c.measured,
    )


@lab.register("lora-works")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say, seeds = ctx.say, ctx.seeds()
    runs: dict[str, list[Tuned]] = {key: [] for key in SYSTEMS}
    base_loss = []
    for seed in seeds:
        gpt = char_gpt(ctx, seed=seed)
        train, held = folio_ids(gpt.tokenizer)
        base_loss.append(
            eval_loss(gpt.model, held, gpt.recipe.context, budget(ctx).n_val, seed=seed)
        )
        for key, (_, targets, pretrained) in SYSTEMS.items():
            runs[key].append(fine_tune(ctx, gpt.model, targets, pretrained, seed, train, held))
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
    }
    figure = _plot(runs, base, held_out)
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
    return [
        ctx.say(
            f"base: the lab's char GPT ({shape}) pretrained on the modern-spelling plays, "
            f"one per seed ({seeds}); fine-tuned {size.steps} steps of {size.batch_size} "
            f"windows on the First Folio text of every play but Macbeth; LoRA rank "
            f"{LORA_RANK}, alpha {LORA_ALPHA}, lr {LORA_LR:g}; full fine-tune lr {FULL_LR:g}; "
            f"from scratch lr {LORA_LR:g}",
            f"基座：本实验室在现代拼写剧本上预训练的字符级 GPT（{shape}），每个随机种子一个"
            f"（{seeds}）；在除《麦克白》外所有剧本的第一对开本文本上微调 {size.steps} 步，"
            f"每步 {size.batch_size} 个窗口；LoRA 秩 {LORA_RANK}，alpha {LORA_ALPHA}，学习率 "
            f"{LORA_LR:g}；全量微调学习率 {FULL_LR:g}；从零训练学习率 {LORA_LR:g}",
        ),
        ctx.say(
            f"gain over the base on held-out Folio Macbeth: LoRA q,v {gains['lora-qv']:.3f}, "
            f"LoRA all linear {gains['lora-all']:.3f}, full fine-tune {gains['full']:.3f}, "
            f"from scratch {gains['scratch']:.3f} nats/char; the full fine-tune moved the "
            f"block weights by {moved.mean:.1%} of their norm",
            f"在留出的 Folio《麦克白》上相对基座的增益：LoRA q,v {gains['lora-qv']:.3f}，LoRA "
            f"全部线性层 {gains['lora-all']:.3f}，全量微调 {gains['full']:.3f}，从零训练 "
            f"{gains['scratch']:.3f} nats/字符；全量微调让各层权重移动了其范数的 "
            f"{moved.mean:.1%}",
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


def _plot(runs: dict, base: lab.Spread, held_out: dict):
    fig, (left, right) = lab.new_figure(10.0, 3.6, ncols=2)
    for i, (key, rs) in enumerate(runs.items()):
        window = max(1, len(rs[0].losses) // 25)
        mean = [
            sum(v) / len(v)
            for v in zip(*(lab.trailing_mean(r.losses, window) for r in rs), strict=True)
        ]
        left.plot(mean, color=f"C{i}", label=SYSTEMS[key][0])
    left.axhline(base.mean, color="grey", linestyle=":", label="base, held-out")
    left.set(
        xlabel="fine-tuning step",
        ylabel="training loss (nats/char, mean over seeds)",
        title="fine-tuning on the Folio text",
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
