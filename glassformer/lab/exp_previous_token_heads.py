"""Seed 000 §4.2: "不同头自发分工：可视化研究发现有的头专攻指代、有的盯邻近词、有的抓句法依存…".

Previous-token heads, the "有的盯邻近词" of the sentence, in two models trained on text: the
lab's small character-level Shakespeare GPT (lab/char_gpt.py, one per random seed) and
SmolLM2-135M (pretrained). Every head's attention is captured on held-out text; its
previous-token mass is the mean weight a query at position t puts on key t - 1 (queries from
position MIN_POSITION on, where uniform attention would give at most 1/17). A head is chosen on
half of the windows and read on the other half. Baseline: the same architecture with random
weights, chosen and read the same way. "分工" says the heads differ: not every head is one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from glassformer.inspect import capture
from glassformer.lab import base as lab
from glassformer.lab.char_gpt import recipe_for, trained
from glassformer.lab.fit import random_windows
from glassformer.models import build_model

# Thresholds, stated once, the same for both models. "Mostly the previous token": the chosen
# head puts >= 0.5 of its attention on t - 1 on held-out windows, and >= 3x the best head of the
# random-weights baseline. Division of labour: the heads differ, the chosen head's mass at
# least 3x the median head's. Preconditions: the char GPT learned the text (final training loss
# below 2.5 nats/char, under the 2.54 of a character bigram model on this corpus) and stopped
# learning (its loss fell by at most 3% over the last fifth of training), and SmolLM2 reads
# Shakespeare far better than chance.
MIN_PREVIOUS_MASS = 0.5
MIN_RATIO_TO_RANDOM = 3.0
MIN_RATIO_TO_MEDIAN = 3.0
PLATEAU_TOLERANCE = 0.03
MAX_CHAR_TRAIN_LOSS = 2.5
MAX_SMOLLM2_LOSS = 5.0  # nats/token on held-out Shakespeare; chance is ln 49,152 = 10.8
MIN_POSITION = 16  # queries before this are left out: there even uniform attention is large
# Full mode trains the lab's char GPT longer than its recipe's 1,500 steps: at 1,500 its loss
# still fell 4% over the last fifth of training (2026-12-05, seeds 0-2), short of the plateau.
FULL_STEPS = 5000


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


# --- the two models --------------------------------------------------------------------------


@dataclass
class CharSeed:
    trained: Reading
    random: Reading
    final_loss: float
    steps: int
    losses: list[float]


def char_seed(ctx: lab.RunContext, seed: int) -> CharSeed:
    recipe = recipe_for(ctx, seed)
    if ctx.mode == "full":
        schedule = replace(recipe.schedule, max_steps=FULL_STEPS, warmup_steps=FULL_STEPS // 10)
        recipe = replace(recipe, schedule=schedule)
    gpt = trained(recipe, use_cache=ctx.mode != "tiny")
    generator = torch.Generator().manual_seed(seed)
    windows = random_windows(gpt.val_ids, ctx.pick(64, 32, 4), gpt.recipe.context, generator)
    ids = windows["input_ids"]
    tail = gpt.train_losses[-20:]
    return CharSeed(
        Reading.of(gpt.model, ids),
        Reading.of(random_twin(gpt.model, seed), ids),
        sum(tail) / len(tail),
        len(gpt.train_losses),
        gpt.train_losses,
    )


def smollm2(ctx: lab.RunContext) -> tuple[nn.Module, Tensor, str]:
    """(model, held-out windows (B, T), name): SmolLM2 on the last tenth of the Shakespeare
    corpus, or in tiny mode a random 2-layer model of its shape on random ids."""
    n_windows, length = ctx.pick(32, 16, 4), ctx.pick(128, 128, 24)
    generator = torch.Generator().manual_seed(ctx.seed)
    if ctx.tiny:
        model, name = lab.smollm2_or_stand_in(ctx)
        ids = torch.randint(0, model.cfg.vocab_size, (n_windows * length * 2,), generator=generator)
        return model, random_windows(ids, n_windows, length, generator)["input_ids"], name
    from glassformer.data.corpus import corpus_text
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    text = corpus_text("modern")
    held_out = text[int(len(text) * 0.9) :][: n_windows * length * 8]  # ~4 characters a token
    ids = torch.tensor(tokenizer.encode(held_out, add_special_tokens=False))
    return model, random_windows(ids, n_windows, length, generator)["input_ids"], "SmolLM2-135M"


# --- the experiment --------------------------------------------------------------------------


@lab.register("previous-token-heads")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    seeds = ctx.seeds()
    chars = [char_seed(ctx, seed) for seed in seeds]
    model, ids, name = smollm2(ctx)
    smol = Reading.of(model, ids)
    smol_random = Reading.of(random_twin(model, ctx.seed), ids)
    del model  # the random twin and SmolLM2 together are 1 GB of float32: free one early
    spread = {
        "best": lab.over_seeds([c.trained.best for c in chars]),
        "random best": lab.over_seeds([c.random.best for c in chars]),
        "share": lab.over_seeds([c.trained.share for c in chars]),
        "random share": lab.over_seeds([c.random.share for c in chars]),
        "over median": lab.over_seeds([c.trained.best / c.trained.median for c in chars]),
    }
    rows = _rows(ctx, chars, spread, smol, smol_random)
    checks = _checks(ctx, chars, spread, smol, smol_random)
    notes = _notes(ctx, chars, smol, name, ids)
    data = {
        "seeds": seeds,
        "char_gpt_mass": [c.trained.mass.tolist() for c in chars],
        "char_gpt_random_mass": [c.random.mass.tolist() for c in chars],
        "smollm2_mass": smol.mass.tolist(),
        "smollm2_random_mass": smol_random.mass.tolist(),
    }
    figure = _plot(ctx, chars, spread, smol, smol_random, name)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _rows(ctx, chars: list[CharSeed], spread: dict, smol: Reading, smol_random: Reading):
    what = ctx.say("measure", "测量")
    char = ctx.say("char GPT (mean ± spread over seeds)", "字符级 GPT（随机种子间均值 ± 波动）")
    char_random = ctx.say("char GPT, random weights", "字符级 GPT，随机权重")
    pre = ctx.say("SmolLM2", "SmolLM2")
    pre_random = ctx.say("SmolLM2, random weights", "SmolLM2，随机权重")

    def heads(readings: list[Reading]) -> str:
        return ", ".join("L{}H{}".format(*r.head) for r in readings)

    return [
        {
            what: ctx.say(
                "chosen head (highest on the choosing half)", "选出的头（选择那一半上最高）"
            ),
            char: heads([c.trained for c in chars]),
            char_random: heads([c.random for c in chars]),
            pre: heads([smol]),
            pre_random: heads([smol_random]),
        },
        {
            what: ctx.say(
                "chosen head's attention on t - 1, held-out half",
                "选出的头在留出那一半上对 t - 1 的注意力",
            ),
            char: str(spread["best"]),
            char_random: str(spread["random best"]),
            pre: smol.best,
            pre_random: smol_random.best,
        },
        {
            what: ctx.say(
                f"share of heads with >= {MIN_PREVIOUS_MASS} on t - 1",
                f"对 t - 1 的注意力 >= {MIN_PREVIOUS_MASS} 的头所占比例",
            ),
            char: str(spread["share"]),
            char_random: str(spread["random share"]),
            pre: smol.share,
            pre_random: smol_random.share,
        },
        {
            what: ctx.say("the median head's attention on t - 1", "中位数头对 t - 1 的注意力"),
            char: str(lab.over_seeds([c.trained.median for c in chars])),
            char_random: str(lab.over_seeds([c.random.median for c in chars])),
            pre: smol.median,
            pre_random: smol_random.median,
        },
        {
            what: ctx.say("mean attention on t - 1 over all heads", "所有头对 t - 1 的平均注意力"),
            char: str(lab.over_seeds([c.trained.mass.mean().item() for c in chars])),
            char_random: str(lab.over_seeds([c.random.mass.mean().item() for c in chars])),
            pre: smol.mass.mean().item(),
            pre_random: smol_random.mass.mean().item(),
        },
        {
            what: ctx.say("held-out loss (nats / token)", "留出文本上的损失（nats / token）"),
            char: str(lab.over_seeds([c.trained.loss for c in chars])),
            char_random: str(lab.over_seeds([c.random.loss for c in chars])),
            pre: smol.loss,
            pre_random: smol_random.loss,
        },
    ]


def _checks(ctx, chars: list[CharSeed], spread: dict, smol: Reading, smol_random: Reading):
    here = ctx.say("char GPT trained here", "此处训练的字符级 GPT")
    pretrained = ctx.say("SmolLM2 (pretrained)", "SmolLM2（预训练）")
    worst = max(c.final_loss for c in chars)
    return [
        lab.precondition(
            lab.at_most(
                ctx.say(
                    "char GPT, worst random seed: final training loss (nats/char, last 20 steps)",
                    "字符级 GPT，最差的随机种子：最终训练损失（nats/字符，最后 20 步）",
                ),
                worst,
                MAX_CHAR_TRAIN_LOSS,
            )
        ),
        *(
            lab.converged(
                ctx.say(
                    f"char GPT, seed {seed}: relative loss drop over the last fifth of training",
                    f"字符级 GPT，随机种子 {seed}：训练最后五分之一的损失相对降幅",
                ),
                c.losses,
                max(1, len(c.losses) // 5),
                PLATEAU_TOLERANCE,
            )
            for seed, c in zip(ctx.seeds(), chars, strict=True)
        ),
        lab.precondition(
            lab.at_most(
                ctx.say(
                    "SmolLM2: loss on held-out Shakespeare (nats / token)",
                    "SmolLM2：留出的莎士比亚文本上的损失（nats / token）",
                ),
                smol.loss,
                MAX_SMOLLM2_LOSS,
            )
        ),
        lab.at_least(
            ctx.say(
                "char GPT: chosen head's attention on t - 1 (mean over seeds)",
                "字符级 GPT：选出的头对 t - 1 的注意力（随机种子间均值）",
            ),
            spread["best"].mean,
            MIN_PREVIOUS_MASS,
            group=here,
        ),
        lab.at_least(
            ctx.say(
                "char GPT: chosen head's attention on t - 1 / random weights'",
                "字符级 GPT：选出的头对 t - 1 的注意力 / 随机权重的",
            ),
            spread["best"].mean / spread["random best"].mean,
            MIN_RATIO_TO_RANDOM,
            group=here,
        ),
        lab.at_least(
            ctx.say(
                "char GPT: chosen head's attention on t - 1 / the median head's",
                "字符级 GPT：选出的头对 t - 1 的注意力 / 中位数头的",
            ),
            spread["over median"].mean,
            MIN_RATIO_TO_MEDIAN,
            group=here,
        ),
        lab.at_least(
            ctx.say(
                "SmolLM2: chosen head's attention on t - 1", "SmolLM2：选出的头对 t - 1 的注意力"
            ),
            smol.best,
            MIN_PREVIOUS_MASS,
            group=pretrained,
        ),
        lab.at_least(
            ctx.say(
                "SmolLM2: chosen head's attention on t - 1 / random weights'",
                "SmolLM2：选出的头对 t - 1 的注意力 / 随机权重的",
            ),
            smol.best / smol_random.best,
            MIN_RATIO_TO_RANDOM,
            group=pretrained,
        ),
        lab.at_least(
            ctx.say(
                "SmolLM2: chosen head's attention on t - 1 / the median head's",
                "SmolLM2：选出的头对 t - 1 的注意力 / 中位数头的",
            ),
            smol.best / smol.median,
            MIN_RATIO_TO_MEDIAN,
            group=pretrained,
        ),
    ]


def _notes(ctx, chars: list[CharSeed], smol: Reading, name: str, ids: Tensor) -> list[str]:
    gpt = chars[0]
    n_heads = smol.mass.numel()
    count = round(smol.share * n_heads)
    return [
        ctx.say(
            f"char GPT: {len(chars)} random seed(s), {gpt.steps} training steps each on "
            "Shakespeare; windows from the held-out tenth of the corpus; queries from "
            f"position {MIN_POSITION} on",
            f"字符级 GPT：{len(chars)} 个随机种子，每个在莎士比亚文本上训练 {gpt.steps} 步；"
            f"窗口取自语料留出的最后十分之一；只计位置 {MIN_POSITION} 起的查询",
        ),
        ctx.say(
            f"{name}: {ids.shape[0]} windows of {ids.shape[1]} tokens; {count} of its "
            f"{n_heads} heads put >= {MIN_PREVIOUS_MASS} of their attention on t - 1 "
            f"(the chosen one, layer {smol.head[0]} head {smol.head[1]}: {smol.best:.2f})",
            f"{name}：{ids.shape[0]} 个 {ids.shape[1]} token 的窗口；{n_heads} 个头中有 "
            f"{count} 个把 >= {MIN_PREVIOUS_MASS} 的注意力放在 t - 1 上（选出的第 "
            f"{smol.head[0]} 层第 {smol.head[1]} 个头：{smol.best:.2f}）",
        ),
    ]


def _plot(ctx, chars: list[CharSeed], spread: dict, smol: Reading, smol_random: Reading, name: str):
    fig, (bars, mine, theirs) = lab.new_figure(14.0, 4.2, ncols=3)
    labels = ["char GPT", "char GPT\nrandom", name, f"{name}\nrandom"]
    values = [spread["best"].mean, spread["random best"].mean, smol.best, smol_random.best]
    errors = [spread["best"].spread, spread["random best"].spread, 0.0, 0.0]
    bars.bar(range(4), values, yerr=errors, capsize=4, color=["C0", "C7", "C1", "C7"])
    bars.axhline(MIN_PREVIOUS_MASS, color="k", linestyle=":", label="threshold")
    bars.set_xticks(range(4), labels, fontsize=8)
    bars.set(
        ylabel="chosen head's attention on t - 1",
        ylim=(0, 1),
        title="held-out half (char GPT: mean ± spread over seeds)",
    )
    bars.legend(fontsize=7)
    panels = (
        (mine, chars[0].trained.mass, f"char GPT, seed {ctx.seed}"),
        (theirs, smol.mass, name),
    )
    for ax, mass, title in panels:
        image = ax.imshow(mass.numpy(), cmap="magma", vmin=0.0, vmax=1.0, aspect="auto")
        n_layers, n_heads = mass.shape
        ax.set(
            xlabel="head",
            ylabel="layer",
            title=title,
            xticks=range(n_heads),
            yticks=range(0, n_layers, max(1, n_layers // 10)),
        )
        ax.tick_params(labelsize=7)
    fig.colorbar(image, ax=theirs, label="mean attention on t - 1")
    return fig
