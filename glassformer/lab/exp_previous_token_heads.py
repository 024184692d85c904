"""Seed 000 §4.2: "不同头自发分工：可视化研究发现有的头专攻指代、有的盯邻近词、有的抓句法依存…".

Previous-token heads, the "有的盯邻近词" of the sentence, in SmolLM2-135M, a model whose heads
were shaped by nothing but its pretraining loss. Every head's attention is captured on
held-out Shakespeare; its previous-token mass is the mean weight a query at position t puts on
key t - 1 (queries from position MIN_POSITION on, where uniform attention would give at most
1/17). A head is chosen on half of the windows and read on the other half, so the reading is
not the selection's own luck. Baseline: the same architecture with random weights, chosen and
read the same way. "分工" says the heads differ: not every head is one. Each random seed draws
its own windows; the spread is over the draws.

Why no model trained here: the lab's 2-layer character GPT (lab/char_gpt.py) was still
learning after 5,000 steps, a quarter of an hour per seed (its loss fell 3.0-3.4% over the
last fifth, seeds 0-2, 2026-12-05), so it could not stand as a trained model within the lab's
budget; SmolLM2 is one (checked below on held-out text).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassformer.inspect import capture
from glassformer.lab import base as lab
from glassformer.lab.fit import random_windows
from glassformer.lab.head_map import head_map
from glassformer.models import build_model

# Thresholds, stated once. "Mostly the previous token": the chosen head puts >= 0.5 of its
# attention on t - 1 on held-out windows (mean over the draws), and >= 3x the best head of the
# random-weights baseline. Division of labour: the heads differ, the chosen head's mass at
# least 3x the median head's. Precondition: SmolLM2 reads this text far better than chance.
MIN_PREVIOUS_MASS = 0.5
MIN_RATIO_TO_RANDOM = 3.0
MIN_RATIO_TO_MEDIAN = 3.0
MAX_LOSS = 5.0  # nats/token on held-out Shakespeare; chance is ln 49,152 = 10.8
MIN_POSITION = 16  # queries before this are left out: there even uniform attention is large


@torch.no_grad()
def previous_token_mass(model: nn.Module, ids: Tensor) -> tuple[Tensor, float]:
    """(B, L, H) each window's mean attention from query t to key t - 1 over t >= MIN_POSITION,
    and the mean next-token loss of the same forward pass."""
    if ids.shape[1] <= MIN_POSITION:
        raise ValueError(f"windows of {ids.shape[1]} tokens have no query at t >= {MIN_POSITION}")
    with capture(model, residual=False) as cap:
        logits = model(ids)  # (B, T, V)
    queries = torch.arange(MIN_POSITION, ids.shape[1])
    mass = torch.stack(
        [
            cap.attention[layer][:, :, queries, queries - 1].float().mean(dim=2)  # (B, H)
            for layer in range(len(cap.attention))
        ],
        dim=1,
    )
    loss = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), ids[:, 1:])
    return mass, loss.item()


@dataclass
class Reading:
    """One model's heads on one set of windows, chosen on the first half, read on the second."""

    mass: Tensor  # (L, H) mean previous-token mass on the reading half
    head: tuple[int, int]  # the head highest on the choosing half
    best: float  # its mass on the reading half
    share: float  # share of heads with reading-half mass >= MIN_PREVIOUS_MASS
    median: float  # the median head's reading-half mass
    loss: float

    @classmethod
    def of(cls, model: nn.Module, ids: Tensor) -> Reading:
        per_window, loss = previous_token_mass(model, ids)
        half = per_window.shape[0] // 2
        if half == 0:
            raise ValueError("choosing a head on held-out windows needs at least 2 windows")
        choose, read = per_window[:half].mean(dim=0), per_window[half:].mean(dim=0)  # (L, H)
        layer, head = divmod(int(choose.argmax()), choose.shape[1])
        share = (read >= MIN_PREVIOUS_MASS).float().mean().item()
        median = read.flatten().median().item()
        return cls(read, (layer, head), read[layer, head].item(), share, median, loss)


def random_twin(model: nn.Module, seed: int) -> nn.Module:
    """The same architecture with the library's initial (random) weights."""
    torch.manual_seed(seed)
    return build_model(model.cfg).eval()


def smollm2(ctx: lab.RunContext, n_tokens: int) -> tuple[nn.Module, Tensor, str]:
    """(model, held-out ids, name): SmolLM2 and the last tenth of the Shakespeare corpus, or in
    tiny mode a random 2-layer model of its shape and random ids."""
    if ctx.tiny:
        model, name = lab.smollm2_or_stand_in(ctx)
        generator = torch.Generator().manual_seed(ctx.seed)
        return model, torch.randint(0, model.cfg.vocab_size, (n_tokens,), generator=generator), name
    from glassformer.data.corpus import corpus_text
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    text = corpus_text("modern")
    held_out = text[int(len(text) * 0.9) :][: n_tokens * 4]  # ~4 characters a token
    ids = torch.tensor(tokenizer.encode(held_out, add_special_tokens=False))
    return model.eval(), ids, "SmolLM2-135M"


@lab.register("previous-token-heads")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    seeds = ctx.seeds()
    n_windows, length = ctx.pick(32, 16, 4), ctx.pick(128, 128, 24)
    model, ids, name = smollm2(ctx, n_windows * length * 8)
    draws = []
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        draws.append(random_windows(ids, n_windows, length, generator)["input_ids"])
    trained = [Reading.of(model, w) for w in draws]
    twin = random_twin(model, ctx.seed)
    del model  # the random twin and SmolLM2 together are 1 GB of float32: free one early
    untrained = [Reading.of(twin, w) for w in draws]
    spread = {
        "best": lab.over_seeds([r.best for r in trained]),
        "random best": lab.over_seeds([r.best for r in untrained]),
        "share": lab.over_seeds([r.share for r in trained]),
        "random share": lab.over_seeds([r.share for r in untrained]),
        "median": lab.over_seeds([r.median for r in trained]),
        "random median": lab.over_seeds([r.median for r in untrained]),
        "loss": lab.over_seeds([r.loss for r in trained]),
        "random loss": lab.over_seeds([r.loss for r in untrained]),
    }
    data = {
        "seeds": seeds,
        "windows": [n_windows, length],
        "mass": [r.mass.tolist() for r in trained],
        "random_mass": [r.mass.tolist() for r in untrained],
        "heads": [list(r.head) for r in trained],
    }
    return lab.Result.from_checks(
        _rows(ctx, trained, untrained, spread),
        _checks(ctx, trained, spread),
        figure=_plot(trained, untrained, spread, name),
        data=data,
        notes=_notes(ctx, trained, name, n_windows, length),
    )


def _rows(ctx, trained: list[Reading], untrained: list[Reading], spread: dict) -> list[dict]:
    what = ctx.say("measure", "测量")
    pre = ctx.say("SmolLM2 (mean ± spread over draws)", "SmolLM2（各次抽样的均值 ± 波动）")
    pre_random = ctx.say("SmolLM2, random weights", "SmolLM2，随机权重")

    def heads(readings: list[Reading]) -> str:
        return ", ".join("L{}H{}".format(*r.head) for r in readings)

    def over_heads(readings: list[Reading]) -> str:
        return str(lab.over_seeds([r.mass.mean().item() for r in readings]))

    return [
        {
            what: ctx.say(
                "chosen head (highest on the choosing half), by draw",
                "选出的头（选择那一半上最高），按抽样",
            ),
            pre: heads(trained),
            pre_random: heads(untrained),
        },
        {
            what: ctx.say(
                "chosen head's attention on t - 1, held-out half",
                "选出的头在留出那一半上对 t - 1 的注意力",
            ),
            pre: str(spread["best"]),
            pre_random: str(spread["random best"]),
        },
        {
            what: ctx.say(
                f"share of heads with >= {MIN_PREVIOUS_MASS} on t - 1",
                f"对 t - 1 的注意力 >= {MIN_PREVIOUS_MASS} 的头所占比例",
            ),
            pre: str(spread["share"]),
            pre_random: str(spread["random share"]),
        },
        {
            what: ctx.say("the median head's attention on t - 1", "中位数头对 t - 1 的注意力"),
            pre: str(spread["median"]),
            pre_random: str(spread["random median"]),
        },
        {
            what: ctx.say("mean attention on t - 1 over all heads", "所有头对 t - 1 的平均注意力"),
            pre: over_heads(trained),
            pre_random: over_heads(untrained),
        },
        {
            what: ctx.say("held-out loss (nats / token)", "留出文本上的损失（nats / token）"),
            pre: str(spread["loss"]),
            pre_random: str(spread["random loss"]),
        },
    ]


def _checks(ctx, trained: list[Reading], spread: dict) -> list[lab.Check]:
    group = ctx.say("SmolLM2 (pretrained)", "SmolLM2（预训练）")
    over_median = lab.over_seeds([r.best / r.median for r in trained])
    return [
        lab.precondition(
            lab.at_most(
                ctx.say(
                    "SmolLM2: loss on held-out Shakespeare (nats / token), worst draw",
                    "SmolLM2：留出的莎士比亚文本上的损失（nats / token），取最差的抽样",
                ),
                max(r.loss for r in trained),
                MAX_LOSS,
            )
        ),
        lab.at_least(
            ctx.say(
                "SmolLM2: chosen head's attention on t - 1 (mean over draws)",
                "SmolLM2：选出的头对 t - 1 的注意力（各次抽样的均值）",
            ),
            spread["best"].mean,
            MIN_PREVIOUS_MASS,
            group=group,
        ),
        lab.at_least(
            ctx.say(
                "SmolLM2: chosen head's attention on t - 1 / random weights'",
                "SmolLM2：选出的头对 t - 1 的注意力 / 随机权重的",
            ),
            spread["best"].mean / spread["random best"].mean,
            MIN_RATIO_TO_RANDOM,
            group=group,
        ),
        lab.at_least(
            ctx.say(
                "SmolLM2: chosen head's attention on t - 1 / the median head's (mean over draws)",
                "SmolLM2：选出的头对 t - 1 的注意力 / 中位数头的（各次抽样的均值）",
            ),
            over_median.mean,
            MIN_RATIO_TO_MEDIAN,
            group=group,
        ),
    ]


def _notes(ctx, trained: list[Reading], name: str, n_windows: int, length: int) -> list[str]:
    first = trained[0]
    n_heads = first.mass.numel()
    counts = [round(r.share * n_heads) for r in trained]
    layer, head = first.head
    return [
        ctx.say(
            f"{name}: {len(trained)} draws of {n_windows} windows of {length} tokens from the"
            f" held-out tenth of the corpus (a draw per random seed); queries from position"
            f" {MIN_POSITION} on; heads with >= {MIN_PREVIOUS_MASS} of their attention on t - 1:"
            f" {', '.join(map(str, counts))} of {n_heads} (by draw); the first draw's chosen"
            f" head, layer {layer} head {head}: {first.best:.2f}",
            f"{name}：从语料留出的最后十分之一中抽 {len(trained)} 次（每个随机种子一次），每次"
            f" {n_windows} 个 {length} token 的窗口；只计位置 {MIN_POSITION} 起的查询；把 >="
            f" {MIN_PREVIOUS_MASS} 的注意力放在 t - 1 上的头：{n_heads} 个中有"
            f" {'、'.join(map(str, counts))} 个（按抽样）；第一次抽样选出的第 {layer} 层第"
            f" {head} 个头：{first.best:.2f}",
        ),
        ctx.say(
            "no model trained here stands in this run: the lab's 2-layer character GPT was"
            " still learning after 5,000 steps (a quarter of an hour per seed on 2 cores), so"
            " its heads could not count as those of a trained model",
            "这次没有用此处训练的模型：实验室的 2 层字符级 GPT 训练 5,000 步（在 2 核上每个随机"
            "种子约一刻钟）后仍在学习，它的头不能算作训练好的模型的头",
        ),
    ]


def _plot(trained: list[Reading], untrained: list[Reading], spread: dict, name: str):
    fig, (bars, heat) = lab.new_figure(10.0, 4.2, ncols=2)
    labels = [name, f"{name}\nrandom weights"]
    values = [spread["best"].mean, spread["random best"].mean]
    errors = [spread["best"].spread, spread["random best"].spread]
    bars.bar(range(2), values, yerr=errors, capsize=4, color=["C1", "C7"])
    bars.axhline(MIN_PREVIOUS_MASS, color="k", linestyle=":", label="threshold")
    bars.set_xticks(range(2), labels, fontsize=8)
    bars.set(
        ylabel="chosen head's attention on t - 1",
        ylim=(0, 1),
        title="held-out half (mean ± spread over draws)",
    )
    bars.legend(fontsize=7)
    title = f"{name}: every head's attention on t - 1 (first draw)"
    image = head_map(heat, trained[0].mass, title)
    fig.colorbar(image, ax=heat, label="mean attention on t - 1")
    return fig
