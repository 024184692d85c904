"""Seed 000 §4.2: head pruning, "剪掉相当比例的头模型性能几乎不掉——重要头集中，其余是冗余备份".

On the lab's small character-level Shakespeare GPT (lab/char_gpt.py), trained once per seed,
every head is switched off in turn (inspect.ablate: its slice of the input to W_O zeroed) and its
importance is the rise of the loss on *ranking* windows from the first half of the held-out
text. The pruning curve - heads removed cumulatively, least important first (by that single-head
ranking, not re-ranked as heads go), and in random orders for comparison - is measured on other,
*evaluation* windows from the second half, so ranking and judging never share a character. No
fine-tuning after pruning: the "test-time" pruning of the head-pruning studies. Numbers are mean
± spread over the seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glassformer.inspect.ablate import ablate_heads, all_heads, as_spec
from glassformer.lab import base as lab
from glassformer.lab.char_gpt import CharGPT, char_gpt
from glassformer.lab.fit import Batch, random_windows

# Thresholds, stated once. "剪掉相当比例的头…几乎不掉": removing a quarter of the heads (the least
# important first) raises the evaluation loss by at most 5% ("almost no drop"), mean + spread
# over seeds. "重要头集中": the quarter of the heads ranked most important carries at least half
# of the summed single-head loss increases measured on the evaluation windows (mean - spread;
# spread evenly, a quarter would carry a quarter), and removing the least important quarter
# costs less than removing a random quarter by more than the seeds' spread.
PRUNED_SHARE = 0.25
MAX_PRUNED_INCREASE = 0.05
MIN_TOP_SHARE = 0.5
# Preconditions: the model learned the text - its evaluation loss is below the 2.54 nats/char a
# character bigram model gets on this held-out text - and its heads matter together: removing
# every head raises the loss by at least 20%.
MAX_EVAL_LOSS = 2.5
MIN_ALL_REMOVED_INCREASE = 0.20
TABLE_SHARES = (0.0, 0.125, 0.25, 0.5, 0.75, 1.0)
ORIGINS_ZH = {"loaded from the cache": "从缓存加载", "trained in this run": "本次运行训练"}


def split_windows(ids: torch.Tensor, n: int, length: int, seed: int) -> tuple[Batch, Batch]:
    """n windows from the first half of `ids` (for ranking) and n from the second half (for
    evaluation): no character is in both."""
    half = len(ids) // 2
    generator = torch.Generator().manual_seed(seed)
    return (
        random_windows(ids[:half], n, length, generator),
        random_windows(ids[half:], n, length, generator),
    )


class FixedEval:
    """The model's loss on fixed windows with some heads removed."""

    def __init__(self, model: torch.nn.Module, windows: Batch):
        self.model = model
        self.windows = windows

    @torch.no_grad()
    def __call__(self, removed: list[tuple[int, int]]) -> float:
        with ablate_heads(self.model, as_spec(removed)):
            return self.model.loss(**self.windows).ce_loss.item()


def single_head_importance(
    evaluate: FixedEval, heads: list[tuple[int, int]]
) -> dict[tuple[int, int], float]:
    """Each head's importance: the loss increase with that head alone removed."""
    base = evaluate([])
    return {head: evaluate([head]) - base for head in heads}


def removal_curve(evaluate: FixedEval, order: list[tuple[int, int]]) -> list[float]:
    """Loss with the first k heads of `order` removed, k = 0..len(order)."""
    return [evaluate(order[:k]) for k in range(len(order) + 1)]


def top_share(ranked: list[tuple[int, int]], importance: dict, k: int) -> float:
    """The share of the summed (positive) importance carried by the last k heads of `ranked`
    (the ones ranked most important); nan if no head matters at all."""
    gains = {head: max(value, 0.0) for head, value in importance.items()}
    total = sum(gains.values())
    if total == 0:
        return float("nan")
    return sum(gains[head] for head in ranked[len(ranked) - k :]) / total


@dataclass
class SeedRun:
    gpt: CharGPT
    base: float  # evaluation loss, no head removed
    ranked: list[tuple[int, int]]  # least important first, by the ranking windows
    ranking_importance: dict[tuple[int, int], float]
    eval_importance: dict[tuple[int, int], float]
    curve: list[float]  # evaluation loss, least important first
    random_curves: list[list[float]]
    n_windows: int  # evaluation windows (and as many ranking windows)

    def increase(self, loss: float) -> float:
        return loss / self.base - 1

    def random_mean(self, k: int) -> float:
        return sum(c[k] for c in self.random_curves) / len(self.random_curves)


def prune(ctx: lab.RunContext, seed: int) -> SeedRun:
    gpt = char_gpt(ctx, seed=seed)
    n_windows = ctx.pick(64, 16, 4)
    ranking, evaluation = split_windows(gpt.val_ids, n_windows, gpt.recipe.context, seed)
    rank_eval, held_eval = FixedEval(gpt.model, ranking), FixedEval(gpt.model, evaluation)
    heads = all_heads(gpt.model)
    ranking_importance = single_head_importance(rank_eval, heads)
    ranked = sorted(heads, key=lambda head: ranking_importance[head])
    generator = torch.Generator().manual_seed(seed + 1)
    random_curves = []
    for _ in range(ctx.pick(5, 3, 2)):
        order = [heads[i] for i in torch.randperm(len(heads), generator=generator).tolist()]
        random_curves.append(removal_curve(held_eval, order))
    curve = removal_curve(held_eval, ranked)
    eval_importance = single_head_importance(held_eval, heads)
    return SeedRun(
        gpt, curve[0], ranked, ranking_importance, eval_importance, curve, random_curves, n_windows
    )


@lab.register("head-pruning")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    runs = [prune(ctx, seed) for seed in ctx.seeds()]
    n = len(runs[0].ranked)
    k = round(PRUNED_SHARE * n)

    say = ctx.say
    rows = []
    for share in TABLE_SHARES:
        m = round(share * n)
        ranked = lab.over_seeds([r.increase(r.curve[m]) for r in runs])
        shuffled = lab.over_seeds([r.increase(r.random_mean(m)) for r in runs])
        rows.append(
            {
                say("heads removed", "去掉的头"): say(
                    f"{m} of {n} ({share:.0%})", f"{n} 个中的 {m} 个（{share:.0%}）"
                ),
                say(
                    "eval loss, least important first", "评估损失，最不重要的先去掉"
                ): lab.over_seeds([r.curve[m] for r in runs]).mean,
                say(
                    "increase, least important first", "上升，最不重要的先去掉"
                ): f"{ranked.mean:+.1%} ± {ranked.spread:.1%}",
                say(
                    "increase, random order", "上升，随机顺序"
                ): f"{shuffled.mean:+.1%} ± {shuffled.spread:.1%}",
            }
        )

    pruned = lab.over_seeds([r.increase(r.curve[k]) for r in runs])
    random_k = lab.over_seeds([r.increase(r.random_mean(k)) for r in runs])
    shares = lab.over_seeds([top_share(r.ranked, r.eval_importance, k) for r in runs])
    everything = lab.over_seeds([r.increase(r.curve[-1]) for r in runs])
    checks = [
        lab.precondition(
            lab.at_most(
                say(
                    f"seed {r.gpt.recipe.seed}: eval loss of the trained model (nats/char)",
                    f"随机种子 {r.gpt.recipe.seed}：训练好的模型的评估损失（nats/字符）",
                ),
                r.base,
                MAX_EVAL_LOSS,
            )
        )
        for r in runs
    ]
    few = say("剪掉相当比例的头几乎不掉", "剪掉相当比例的头几乎不掉")
    concentrated = say("重要头集中", "重要头集中")
    checks += [
        lab.precondition(
            lab.at_least(
                say(
                    "eval loss increase with every head removed (mean)",
                    "去掉所有头时评估损失的上升（均值）",
                ),
                everything.mean,
                MIN_ALL_REMOVED_INCREASE,
            )
        ),
        lab.at_most(
            say(
                f"eval loss increase with the {k} least important of {n} heads removed "
                "(mean + spread)",
                f"去掉 {n} 个头中最不重要的 {k} 个时评估损失的上升（均值 + 波动）",
            ),
            pruned.mean + pruned.spread,
            MAX_PRUNED_INCREASE,
            group=few,
        ),
        lab.at_least(
            say(
                f"share of the eval windows' single-head loss increases in the {k} heads "
                "ranked most important (mean - spread)",
                f"评估窗口上逐个去头的损失上升中，排名最重要的 {k} 个头所占的份额（均值 - 波动）",
            ),
            shares.mean - shares.spread,
            MIN_TOP_SHARE,
            group=concentrated,
        ),
        lab.exceeds_spread(
            say(
                f"increase removing a random {k} minus the {k} least important",
                f"随机去掉 {k} 个头的上升减去掉最不重要的 {k} 个头的上升",
            ),
            random_k,
            pruned,
            group=concentrated,
        ),
    ]

    recipe = runs[0].gpt.recipe
    origins = sorted({r.gpt.origin for r in runs})
    agree = [_rank_agreement(r) for r in runs]
    steps, seed_list = recipe.schedule.max_steps, [r.gpt.recipe.seed for r in runs]
    base_loss, n_windows, even = lab.over_seeds([r.base for r in runs]), runs[0].n_windows, k / n
    shape_zh = f"{recipe.n_layers} 层 x {recipe.n_heads} 个头，d_model {recipe.d_model}"
    origins_en, origins_zh = ", ".join(origins), "，".join(ORIGINS_ZH[o] for o in origins)
    agree_text = ", ".join(f"{a:+.2f}" for a in agree)
    notes = [
        say(
            f"model: {recipe.shape}, {steps} training steps on Shakespeare "
            f"characters, seeds {seed_list} ({origins_en}); eval "
            f"loss {base_loss} nats/char on "
            f"{n_windows} eval windows of {recipe.context} characters (and as many ranking "
            "windows from the other half of the held-out text)",
            f"模型：{shape_zh}，在莎士比亚字符上训练 {steps} 步，随机种子 {seed_list}"
            f"（{origins_zh}）；在 {n_windows} 个 {recipe.context} 字符的评估窗口上评估损失为 "
            f"{base_loss} nats/字符（另从留出文本的另一半取同样多的排名窗口）",
        ),
        say(
            f"relative rise of the eval loss with {k} of {n} heads removed, least important "
            f"first: {pruned}; a random {k}: {random_k}; every head: {everything}",
            f"去掉 {n} 个头中的 {k} 个（最不重要的先去）时评估损失的相对上升：{pruned}；"
            f"随机去掉 {k} 个：{random_k}；去掉所有头：{everything}",
        ),
        say(
            f"the {k} heads ranked most important on the ranking windows carry {shares} of the "
            f"single-head loss increases on the eval windows ({even:.0%} if spread evenly)",
            f"在排名窗口上排名最重要的 {k} 个头，占评估窗口上逐个去头损失上升的 {shares}"
            f"（若平均分布则为 {even:.0%}）",
        ),
        say(
            "rank correlation of single-head importance between ranking and eval windows: "
            + agree_text,
            "单个头的重要性在排名窗口与评估窗口之间的秩相关：" + agree_text,
        ),
        say(
            "heads are removed without any fine-tuning afterwards; the order is fixed by each "
            "head's own importance measured alone, so interactions between heads are not "
            "searched",
            "去掉头之后不做任何微调；去头的顺序由每个头单独测得的重要性固定，"
            "所以没有搜索头与头之间的相互作用",
        ),
    ]
    figure = _plot(runs, k)
    data = {
        f"seed {r.gpt.recipe.seed}": {
            "base_loss": r.base,
            "ranking_importance": {f"{a}.{b}": v for (a, b), v in r.ranking_importance.items()},
            "eval_importance": {f"{a}.{b}": v for (a, b), v in r.eval_importance.items()},
            "order": [f"{a}.{b}" for a, b in r.ranked],
            "curve": r.curve,
            "random_curves": r.random_curves,
        }
        for r in runs
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _rank_agreement(run: SeedRun) -> float:
    """Spearman correlation of the heads' importance on the ranking and on the eval windows."""
    heads = run.ranked

    def ranks(values: dict) -> torch.Tensor:
        order = sorted(heads, key=lambda head: values[head])
        return torch.tensor([float(order.index(head)) for head in heads])

    a, b = ranks(run.ranking_importance), ranks(run.eval_importance)
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def _plot(runs: list[SeedRun], k: int):
    fig, (left, right) = lab.new_figure(10.0, 3.8, ncols=2)
    ks = list(range(len(runs[0].curve)))
    for label, curves, color in (
        ("least important first", [r.curve for r in runs], "C0"),
        ("random order", [[r.random_mean(m) for m in ks] for r in runs], "gray"),
    ):
        per_k = [lab.over_seeds([c[m] for c in curves]) for m in ks]
        mean = [s.mean for s in per_k]
        left.plot(
            ks, mean, marker="o", ms=3, color=color, label=f"{label} (mean ± spread of seeds)"
        )
        left.fill_between(
            ks,
            [s.mean - s.spread for s in per_k],
            [s.mean + s.spread for s in per_k],
            color=color,
            alpha=0.2,
        )
    base = sum(r.base for r in runs) / len(runs)
    left.axhline(base, color="black", ls=":", lw=1, label="no head removed")
    left.axvline(k, color="C3", ls="--", lw=1, label=f"{k} heads ({PRUNED_SHARE:.0%})")
    left.set(
        xlabel="heads removed",
        ylabel="eval loss (nats / char)",
        title="pruning, judged on held-out windows",
    )
    left.legend(fontsize=7)
    for r in runs:
        heads = r.ranked
        right.scatter(
            [r.ranking_importance[h] for h in heads],
            [r.eval_importance[h] for h in heads],
            s=14,
            label=f"seed {r.gpt.recipe.seed}",
        )
    values = [
        v for r in runs for d in (r.ranking_importance, r.eval_importance) for v in d.values()
    ]
    right.plot(
        [min(values), max(values)],
        [min(values), max(values)],
        color="black",
        lw=0.8,
        ls=":",
        label="equal",
    )
    right.set(
        xlabel="Δ loss with the head removed, ranking windows (nats)",
        ylabel="Δ loss, eval windows (nats)",
        title="single-head importance",
    )
    right.legend(fontsize=7)
    return fig
