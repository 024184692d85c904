"""Seed 002 「位置编码：模型本来分不清词序」: "去掉它，GPT 会变成一个不懂语序的词袋子" — without
positional encoding, GPT becomes a bag of words that cannot tell word order.

A task only word order can solve: L distinct random symbols, then a query symbol; the answer
is the symbol that came first. Every order of the same symbols has a different answer, so a
bag of words (which sees only the set) can do no better than chance, 1/L. Three small models
of the same size train on the same batches, over ctx.seeds(), and answer held-out sequences:

- GPT with RoPE: the precondition that the task is learnable at this size and this budget;
- a bidirectional encoder (family="bert") without positions: the bag of words the claim
  describes, whose attention is permutation-equivariant (the no-position-permutation claim),
  so it should stay near chance: the precondition that the task really needs order;
- GPT without positions (causal mask): the claim itself. Evidence: its accuracy against the
  bag of words' (the claim: no different) and against RoPE's (the claim: clearly lower).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.fit import Batch, Schedule, fit, step_generator
from glassformer.models import build_model

N_SYMBOLS, LENGTH = 16, 8  # L = 8 distinct symbols out of 16, then the query symbol
QUERY = N_SYMBOLS  # its own id, never among the symbols
CHANCE = 1 / LENGTH
# Thresholds, fixed before the run. Setup: the RoPE GPT learns the task (mean >= 90% held out)
# and the position-free encoder stays within twice chance (it is the order-blind control).
# Evidence: "a bag of words" = the position-free GPT's accuracy within the seeds' spread plus
# one chance level (0.125) of the encoder's; "word order comes from the position encoding" =
# RoPE beats the position-free GPT by more than the spread plus 0.1 (a tenth of the sequences).
MIN_ROPE_ACCURACY, MAX_CONTROL_RATIO = 0.9, 2.0
SAME_AS_BAG_TOLERANCE = CHANCE
MIN_POSITION_GAIN = 0.1
ROPE, BAG, NOPE = "GPT, RoPE", "encoder, no positions", "GPT, no positions"
MODELS = {ROPE: ("gpt", "rope"), BAG: ("bert", "none"), NOPE: ("gpt", "none")}
MODELS_ZH = {ROPE: "GPT，RoPE", BAG: "编码器，无位置编码", NOPE: "GPT，无位置编码"}


def first_symbol_batch(batch_size: int, generator: torch.Generator) -> Batch:
    """(B, L + 1) symbols then the query; the target at the query is the first symbol."""
    symbols = torch.rand(batch_size, N_SYMBOLS, generator=generator).argsort(dim=-1)[:, :LENGTH]
    query = torch.full((batch_size, 1), QUERY)
    input_ids = torch.cat([symbols, query], dim=1)
    targets = torch.full_like(input_ids, -100)
    targets[:, -1] = symbols[:, 0]
    return {"input_ids": input_ids, "targets": targets}


def batches(batch_size: int, seed: int) -> Callable[[int], Batch]:
    """batch(step) for fit(): the same batches for every model of one seed."""
    return lambda step: first_symbol_batch(batch_size, step_generator(seed, step))


def build(family: str, position: str, seed: int, ctx: lab.RunContext) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        family=family,
        vocab_size=N_SYMBOLS + 1,
        d_model=ctx.pick(64, 64, 32),
        n_layers=2,
        n_heads=4,
        max_seq_len=LENGTH + 1,
        position=position,
        dropout=0.0,
        **({"mlm_head": True} if family == "bert" else {}),
    )
    return build_model(cfg)


@torch.no_grad()
def accuracy(model: torch.nn.Module, batch: Batch) -> float:
    """Share of held-out sequences whose query is answered with the first symbol."""
    ids, answer = batch["input_ids"], batch["targets"][:, -1]
    if model.cfg.family == "bert":
        logits = model.mlm_logits(model(ids)[:, -1])
    else:
        logits = model(ids)[:, -1]
    return float((logits.argmax(dim=-1) == answer).float().mean())


@lab.register("gpt-bag-of-words")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    seeds = ctx.seeds()
    schedule = Schedule(max_steps=ctx.pick(1000, 200, 20), learning_rate=3e-3, warmup_steps=20)
    batch_size = ctx.pick(64, 32, 8)
    # Held out: drawn from a generator no training step uses (fit.step_generator's seeds are
    # seed * 1_000_003 + step, far below 2**62).
    held_out = first_symbol_batch(ctx.pick(2000, 2000, 200), torch.Generator().manual_seed(2**62))
    scores: dict[str, list[float]] = {name: [] for name in MODELS}
    for seed in seeds:
        for name, (family, position) in MODELS.items():
            model = build(family, position, seed, ctx)
            fit(model, batches(batch_size, seed), schedule)
            scores[name].append(accuracy(model.eval(), held_out))
    spread = {name: lab.over_seeds(s) for name, s in scores.items()}
    say = ctx.say
    for name in MODELS:
        say(name, MODELS_ZH[name])
    rows = [
        {
            say("model", "模型"): name,
            say("held-out accuracy", "留出集准确率"): str(spread[name]),
            say("x chance", "相对随机猜测的倍数"): spread[name].mean / CHANCE,
            say("min", "最小值"): min(s),
            say("max", "最大值"): max(s),
        }
        for name, s in scores.items()
    ]
    checks = [
        lab.precondition(
            lab.at_least(
                say("GPT with RoPE: mean held-out accuracy", "带 RoPE 的 GPT：留出集平均准确率"),
                spread[ROPE].mean,
                MIN_ROPE_ACCURACY,
            )
        ),
        lab.precondition(
            lab.at_most(
                say(
                    "position-free encoder: mean accuracy / chance",
                    "无位置编码的编码器：平均准确率 / 随机猜测",
                ),
                spread[BAG].mean / CHANCE,
                MAX_CONTROL_RATIO,
            )
        ),
        lab.within_spread(
            say(
                "accuracy: position-free GPT - position-free encoder (bag of words)",
                "准确率：无位置编码的 GPT 减无位置编码的编码器（词袋）",
            ),
            spread[NOPE],
            spread[BAG],
            SAME_AS_BAG_TOLERANCE,
            group=say("a GPT without positions is a bag of words", "没有位置编码的 GPT 是词袋"),
        ),
        lab.exceeds_spread(
            say(
                "accuracy: GPT with RoPE - GPT without positions",
                "准确率：带 RoPE 的 GPT 减无位置编码的 GPT",
            ),
            spread[ROPE],
            spread[NOPE],
            MIN_POSITION_GAIN,
            group=say("word order comes from the position encoding", "语序来自位置编码"),
        ),
    ]
    gap = spread[NOPE].mean - spread[BAG].mean
    steps, n_held = schedule.max_steps, held_out["input_ids"].shape[0]
    nope_x, bag_x = spread[NOPE].mean / CHANCE, spread[BAG].mean / CHANCE
    notes = [
        say(
            f"task: {LENGTH} distinct symbols of {N_SYMBOLS}, then a query; answer the first one "
            f"(chance {CHANCE:.3f}); {steps} steps of {batch_size} sequences per "
            f"model, seeds {seeds}, {n_held} held-out sequences",
            f"任务：从 {N_SYMBOLS} 个符号中取 {LENGTH} 个互不相同的，再接一个查询符号；答出第一个"
            f"符号（随机猜测 {CHANCE:.3f}）；每个模型训练 {steps} 步，每步 {batch_size} 条序列，"
            f"随机种子 {seeds}，留出集 {n_held} 条序列",
        ),
        say(
            f"the position-free GPT answers {spread[NOPE]} of held-out sequences, "
            f"{nope_x:.1f}x chance; the position-free encoder {spread[BAG]}, "
            f"{bag_x:.1f}x chance: a difference of {gap:+.3f}",
            f"无位置编码的 GPT 答对留出序列的 {spread[NOPE]}，是随机猜测的 {nope_x:.1f} 倍；"
            f"无位置编码的编码器 {spread[BAG]}，是随机猜测的 {bag_x:.1f} 倍：相差 {gap:+.3f}",
        ),
        say(
            "a causal mask is itself a source of order: position t sees t + 1 tokens, so the first "
            "token is the only one that sees only itself (Haviv et al. 2022, 'Transformer Language "
            "Models without Positional Encodings Still Learn Positional Information'); a "
            "bidirectional model without positions has no such source",
            "因果掩码本身就是顺序信息的来源：位置 t 能看到 t + 1 个 token，所以只有第一个 token "
            "只看得到自己（Haviv et al. 2022，'Transformer Language Models without Positional "
            "Encodings Still Learn Positional Information'）；没有位置编码的双向模型没有这种来源",
        ),
    ]
    return lab.Result.from_checks(
        rows, checks, figure=_plot(spread), notes=notes, data={"accuracy": scores, "seeds": seeds}
    )


def _plot(spread: dict[str, lab.Spread]):
    fig, ax = lab.new_figure(6.4, 3.4)
    names = list(spread)
    ax.bar(
        range(len(names)),
        [spread[n].mean for n in names],
        yerr=[spread[n].spread for n in names],
        capsize=4,
        color=["tab:blue", "tab:gray", "tab:orange"],
    )
    ax.axhline(CHANCE, color="black", ls="--", lw=1, label=f"chance (bag of words) {CHANCE:.3f}")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    rope, nope = spread[ROPE], spread[NOPE]
    if abs(rope.mean - nope.mean) <= (rope.spread**2 + nope.spread**2) ** 0.5:
        ax.annotate(
            "",
            xy=(2, 1.03),
            xytext=(0, 1.03),
            arrowprops={"arrowstyle": "<->", "color": "black", "lw": 0.8},
        )
        ax.text(1, 1.05, "no difference (within the spread)", ha="center", fontsize=8)
    ax.set_ylim(0, 1.15)
    n = len(spread[names[0]].values)
    ax.set_ylabel(f"held-out accuracy, mean ± sd of {n} seeds")
    ax.set_title("去掉位置编码，GPT 还分得清谁在前吗？")
    ax.legend(fontsize=8, loc="center")
    return fig
