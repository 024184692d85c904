"""Seed 000 §2.5.3: "训练要做负载均衡（防 token 挤向少数专家）": an MoE trained without a
load-balancing loss lets its tokens crowd onto a few experts.

The same small MoE GPT (exp_moe.py's: E SwiGLU experts, top-k routed) is trained twice per seed
on Shakespeare characters, from the same initial weights on the same batches: once with the
Switch-Transformer balance loss (weight 0.01, glassformer's default) and once without it (weight
0). Each expert's share of the token-to-expert assignments is then counted on held-out windows,
layer by layer. The measure is the busiest expert's share times E: 1 when every expert is
equally loaded, E/k (4 at E=8, k=2) when every token goes to the same k experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glassformer.lab import base as lab
from glassformer.lab.exp_moe import (
    LEARNING_RATE,
    MOE,
    N_EXPERTS,
    TOP_K,
    expert_load,
    model_configs,
    seeded_model,
    worst_plateau,
)
from glassformer.lab.fit import (
    Schedule,
    eval_loss,
    fit,
    shakespeare_chars,
    unigram_entropy,
    window_batches,
)

WITH, WITHOUT = "with the balance loss", "without the balance loss"
RUNS_ZH = {WITH: "有负载均衡损失", WITHOUT: "没有负载均衡损失"}
AUX_WEIGHT = {WITH: 0.01, WITHOUT: 0.0}
# Thresholds, stated once. Preconditions: both runs trained to their plateau (the last tenth's
# mean loss within 2% of the tenth before) and learned the text (held-out loss at least 0.3 nats
# below the unigram entropy). Evidence, "防 token 挤向少数专家": without the balance loss the
# busiest expert's load (share x E, the mean over layers) exceeds the balanced run's by more
# than the seeds' spread plus 0.25 (a quarter of an expert's fair share more), and with it the
# busiest expert takes at most 1.5x its fair share (the same mean over layers and seeds).
MIN_BELOW_UNIGRAM = 0.3
MIN_CROWDING = 0.25
MAX_BALANCED_LOAD = 1.5


@dataclass(frozen=True)
class Sizes:
    steps: int
    d_model: int
    n_layers: int
    ffn_width: int
    batch_size: int
    length: int
    n_val: int


def sizes(ctx: lab.RunContext) -> Sizes:
    return ctx.pick(
        full=Sizes(1000, 64, 3, 192, 16, 64, 256),
        quick=Sizes(300, 64, 3, 192, 16, 64, 128),
        tiny=Sizes(4, 32, 1, 64, 2, 16, 4),
    )


def busiest(shares: list[list[float]]) -> list[float]:
    """Per layer: the busiest expert's share x E (1 = uniform, E/k = every token on k experts)."""
    return [max(layer) * N_EXPERTS for layer in shares]


def idle(shares: list[list[float]]) -> int:
    """Experts (all layers) that received under a quarter of their fair share 1/E."""
    return sum(s < 0.25 / N_EXPERTS for layer in shares for s in layer)


@lab.register("moe-balance")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    size, say, seeds = sizes(ctx), ctx.say, ctx.seeds()
    corpus = shakespeare_chars(ctx.pick(None, None, 200_000))
    unigram = unigram_entropy(corpus.train)
    schedule = Schedule(
        max_steps=size.steps, learning_rate=LEARNING_RATE, warmup_steps=max(1, size.steps // 10)
    )
    losses = {run: [] for run in AUX_WEIGHT}
    val = {run: [] for run in AUX_WEIGHT}
    shares = {run: [] for run in AUX_WEIGHT}  # run -> seed -> layer -> expert share
    for seed in seeds:
        batches = window_batches(corpus.train, size.batch_size, size.length, seed)
        for run_name, weight in AUX_WEIGHT.items():
            cfg = model_configs(
                corpus.tokenizer.vocab_size,
                size.d_model,
                size.n_layers,
                size.ffn_width,
                size.length,
                aux=weight,
            )[MOE]
            model = seeded_model(cfg, seed)
            losses[run_name].append(fit(model, batches, schedule))
            val[run_name].append(eval_loss(model, corpus.val, size.length, size.n_val, seed=seed))
            shares[run_name].append(expert_load(model)[0])  # eval_loss's forward: held-out load
    for run_name in AUX_WEIGHT:
        say(run_name, RUNS_ZH[run_name])
    load = {r: lab.over_seeds([sum(busiest(s)) / len(s) for s in shares[r]]) for r in shares}
    worst = {r: max(max(busiest(s)) for s in shares[r]) for r in shares}
    held = {r: lab.over_seeds(v) for r, v in val.items()}
    rows = _rows(ctx, load, worst, held, shares)
    checks = _checks(ctx, losses, val, unigram, load)
    notes = _notes(ctx, size, seeds, held, shares)
    figure = _plot(shares, load)
    data = {
        "seeds": seeds,
        "shares": shares,
        "held_out_loss": val,
        "unigram_entropy": unigram,
        "steps": size.steps,
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _checks(ctx, losses, val, unigram, load) -> list[lab.Check]:
    say = ctx.say
    checks = []
    for run_name in AUX_WEIGHT:
        checks.append(
            worst_plateau(
                say(
                    f"MoE {run_name}: relative loss drop over the last tenth of training, worst "
                    "seed",
                    f"MoE（{RUNS_ZH[run_name]}）：训练最后十分之一的损失相对降幅（最差的随机种子）",
                ),
                losses[run_name],
            )
        )
        checks.append(
            lab.precondition(
                lab.at_least(
                    say(
                        f"unigram entropy - held-out loss, MoE {run_name} (nats, worst seed)",
                        f"一元熵 - 留出损失，MoE（{RUNS_ZH[run_name]}）（nats，最差的随机种子）",
                    ),
                    unigram - max(val[run_name]),
                    MIN_BELOW_UNIGRAM,
                )
            )
        )
    group = say(
        "without balancing, tokens crowd onto a few experts", "不做负载均衡，token 就挤向少数专家"
    )
    checks += [
        lab.exceeds_spread(
            say(
                "busiest expert's load x E (mean over layers): without - with the balance loss",
                "最忙专家的负载 x E（各层均值）：没有 - 有负载均衡损失",
            ),
            load[WITHOUT],
            load[WITH],
            MIN_CROWDING,
            group=group,
        ),
        lab.at_most(
            say(
                "with the balance loss: busiest expert's load x E (mean over layers and seeds)",
                "有负载均衡损失：最忙专家的负载 x E（各层与随机种子的均值）",
            ),
            load[WITH].mean,
            MAX_BALANCED_LOAD,
            group=group,
        ),
    ]
    return checks


def _rows(ctx, load, worst, held, shares) -> list[dict]:
    say = ctx.say
    run_col, load_col = (
        say("MoE", "MoE"),
        say("busiest expert x E, mean over layers", "最忙专家 x E（各层均值）"),
    )
    worst_col = say("busiest expert x E, worst layer", "最忙专家 x E（最差的一层）")
    idle_col = say(
        "idle experts (< 1/4 of a fair share), mean over seeds",
        "闲置专家数（不到均分份额的 1/4，随机种子间均值）",
    )
    held_col = say("held-out loss (nats)", "留出损失（nats）")
    return [
        {
            run_col: r,
            load_col: str(load[r]),
            worst_col: worst[r],
            idle_col: sum(idle(s) for s in shares[r]) / len(shares[r]),
            held_col: str(held[r]),
        }
        for r in AUX_WEIGHT
    ]


def _notes(ctx, size: Sizes, seeds, held, shares) -> list[str]:
    n_layers = len(shares[WITH][0])
    layers = ", ".join(" ".join(f"{s:.2f}" for s in layer) for layer in shares[WITHOUT][0])
    return [
        ctx.say(
            f"MoE: {N_EXPERTS} SwiGLU experts of width {size.ffn_width // TOP_K}, top-{TOP_K}, "
            f"{size.n_layers} layers, d={size.d_model}; both runs of a seed start from the "
            f"same weights and see the same {size.steps} batches of {size.batch_size}x"
            f"{size.length} characters (seeds {seeds}); loads counted on {size.n_val} "
            "held-out windows",
            f"MoE：{N_EXPERTS} 个宽 {size.ffn_width // TOP_K} 的 SwiGLU 专家，top-{TOP_K}，"
            f"{size.n_layers} 层，d={size.d_model}；同一随机种子的两次训练初始权重相同，"
            f"看到同样的 {size.steps} 个 {size.batch_size}x{size.length} 字符批次（随机种子 "
            f"{seeds}）；负载在 {size.n_val} 个留出窗口上统计",
        ),
        ctx.say(
            f"without the balance loss, seed {seeds[0]}, expert shares by layer "
            f"({n_layers} layers; uniform {1 / N_EXPERTS:.3f}): {layers}",
            f"没有负载均衡损失，随机种子 {seeds[0]}，各层专家份额（{n_layers} 层；均匀为 "
            f"{1 / N_EXPERTS:.3f}）：{layers}",
        ),
        ctx.say(
            f"held-out loss with the balance loss {held[WITH]}, without {held[WITHOUT]}",
            f"留出损失：有负载均衡损失 {held[WITH]}，没有 {held[WITHOUT]}",
        ),
    ]


def _plot(shares: dict, load: dict):
    fig, (left, right) = lab.new_figure(10.0, 3.6, ncols=2)
    width = 0.4
    for i, run_name in enumerate(AUX_WEIGHT):
        per_layer = torch.tensor(shares[run_name]).mean(0)  # (layers, E), mean over seeds
        ranked = per_layer.sort(dim=-1, descending=True).values.mean(0) * N_EXPERTS
        left.bar(
            [e + (i - 0.5) * width for e in range(N_EXPERTS)],
            ranked.tolist(),
            width,
            label=run_name,
        )
    left.axhline(1.0, color="k", linestyle=":", label="fair share")
    left.set(
        xlabel="expert, busiest first (mean over layers and seeds)",
        ylabel="share of assignments x E",
        title="load by expert rank",
    )
    left.legend(fontsize=7)
    names = list(AUX_WEIGHT)
    right.bar(
        range(len(names)),
        [load[n].mean for n in names],
        yerr=[load[n].spread for n in names],
        capsize=4,
        color=["C0", "C1"],
    )
    right.axhline(1.0, color="k", linestyle=":")
    right.set_xticks(range(len(names)), names)
    right.set(ylabel="busiest expert x E (mean ± spread)", title="crowding, held-out windows")
    return fig
