"""Seed 000 §4.2: "有的头负责邻近复制——把上文的专有名词、代码变量名原样引用（…即经典的 induction /
copying head 现象）".

The classic setting (Olsson et al. 2022, "In-context learning and induction heads"): an
attention-only 2-layer GPT (glassformer's GPT with its FFNs taken out) trained on R random
tokens repeated twice, [x1..xR, x1..xR]. The first copy cannot be predicted; the second can,
but only by looking back: find the earlier occurrence of the current token and copy the token
after it, which is what an induction head does. A precondition: training ran until the loss
on the second copy is near 0. Every head's attention is then captured on held-out sequences;
its prefix-matching score is the mean weight a query at position i of the second copy puts on
key i - R + 1 (the token after the previous occurrence; chance is about 1/i). The best head is
chosen on half of the sequences and scored on the other half; the heads that score as
induction heads on the first half are switched off on the second, to see whether they carry
the copying. Control: the same model at its random initialisation. SmolLM2-135M, pretrained
on text, is measured the same way on repeated random word pieces: there the 2nd-copy loss
against the 1st is evidence too, as nothing trained it on this task.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.inspect import ablate_heads
from glassformer.lab import base as lab
from glassformer.lab.fit import Batch, Schedule, fit, step_generator
from glassformer.lab.head_map import head_map
from glassformer.lab.induction import (
    as_spec,
    attention_only,
    chosen_head,
    copy_losses,
    copying_lost,
    induction_scores,
    next_token_loss,
    repeated,
    repeated_random,
)

# Thresholds, stated once. An induction head: the chosen head puts >= 0.3 of its attention on
# the induction target on held-out sequences (chance ~ 1/i <= 1/R) and >= 3x the untrained
# control's chosen head; the heads that score so carry the copying: switched off together, the
# 2nd copy loses at least half of its advantage over the 1st. SmolLM2: the same score, and a 2nd
# copy that costs at most half the 1st. Preconditions: the training loss is flat (a drop of at
# most 2% between the last two windows) and the 2nd copy is predicted (loss <= 0.4 nats, a
# tenth of chance, ln 64 = 4.16).
MIN_INDUCTION_SCORE = 0.3
MIN_RATIO_TO_UNTRAINED = 3.0
MIN_COPYING_LOST = 0.5
MAX_SECOND_TO_FIRST_LOSS = 0.5
MAX_SECOND_COPY_LOSS = 0.4
PLATEAU_TOLERANCE = 0.02
RANDOM_VOCAB = 64  # the attention-only model's tokens: ids 0..63, drawn uniformly
EVAL_SEED = 7_777  # held-out sequences come from their own generator, never a training step's
# SmolLM2's random tokens: ids from this range of its 49,152 (past the special and byte tokens,
# before the rarest merges), so every token is an ordinary word piece.
SMOLLM2_TOKEN_RANGE = (1_000, 40_000)
TOP_HEADS = 5


def repeat_batches(batch_size: int, length: int, seed: int):
    """batch(step) for fit(): fresh repeated random sequences every step, a pure function of
    (seed, step), so the model cannot memorise sequences and must learn to copy."""

    def batch(step: int) -> Batch:
        rows = repeated(list(range(RANDOM_VOCAB)), batch_size, length, step_generator(seed, step))
        return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}

    return batch


def induction_set(scores: Tensor) -> list[tuple[int, int]]:
    """Every (layer, head) whose mean score on the choosing half of `scores` (B, L, H) reaches
    MIN_INDUCTION_SCORE: the heads switched off together (a model can grow several that do
    the same job, and switching off one then shows little). At least the best head."""
    choose = scores[: scores.shape[0] // 2].mean(dim=0)  # (L, H)
    picked = [
        divmod(int(i), choose.shape[1])
        for i in torch.nonzero(choose.flatten() >= MIN_INDUCTION_SCORE).flatten()
    ]
    return picked or [chosen_head(scores)[0]]


# --- one seed of the attention-only model --------------------------------------------------------


@dataclass
class SeedRun:
    losses: list[float]  # training loss per step
    scores: Tensor  # (L, H) mean prefix-matching score on the held-out sequences
    head: tuple[int, int]
    held_out: float  # the chosen head's score on the measuring half
    first: float
    second: float
    induction: list[tuple[int, int]]  # the heads scoring >= MIN_INDUCTION_SCORE when choosing
    ablated_second: float  # 2nd-copy loss with all of `induction` switched off
    one_ablated_second: float  # ... with only the chosen head switched off
    loss_by_position: list[float]
    control_held_out: float
    control_loss_by_position: list[float]

    @property
    def copying_lost(self) -> float:
        return copying_lost(self.first, self.second, self.ablated_second)

    @property
    def one_head_copying_lost(self) -> float:
        return copying_lost(self.first, self.second, self.one_ablated_second)


def model_config(ctx: lab.RunContext, length: int) -> ModelConfig:
    # RoPE: a relative position makes the previous-token head (the first half of the circuit)
    # one rotation away.
    return ModelConfig(
        vocab_size=RANDOM_VOCAB,
        d_model=ctx.pick(64, 64, 16),
        n_layers=2,
        n_heads=ctx.pick(4, 4, 2),
        max_seq_len=2 * length,
        position="rope",
    )


def train_seed(ctx: lab.RunContext, seed: int, length: int) -> SeedRun:
    cfg = model_config(ctx, length)
    torch.manual_seed(seed)
    control = attention_only(cfg).eval()  # same architecture and seed, never trained
    torch.manual_seed(seed)
    model = attention_only(cfg)
    steps = ctx.pick(1500, 600, 8)
    schedule = Schedule(
        steps, learning_rate=1e-3, warmup_steps=max(1, steps // 10), weight_decay=0.0
    )
    losses = fit(model, repeat_batches(ctx.pick(32, 32, 4), length, seed), schedule)
    ids = repeated_random(list(range(RANDOM_VOCAB)), ctx.pick(128, 64, 4), length, EVAL_SEED + seed)
    scores, loss = induction_scores(model, ids)
    head, held_out = chosen_head(scores)
    measuring = ids[len(ids) // 2 :]
    first, second = copy_losses(loss[len(ids) // 2 :], length)
    induction = induction_set(scores)
    ablated = [second_copy_loss(model, measuring, heads) for heads in (induction, [head])]
    control_scores, control_loss = induction_scores(control, ids)
    return SeedRun(
        losses,
        scores.mean(dim=0),
        head,
        held_out,
        first,
        second,
        induction,
        *ablated,
        loss.mean(dim=0).tolist(),
        chosen_head(control_scores)[1],
        control_loss.mean(dim=0).tolist(),
    )


@torch.no_grad()
def second_copy_loss(model: nn.Module, ids: Tensor, heads: list[tuple[int, int]]) -> float:
    """The 2nd copy's mean loss with `heads` switched off."""
    with ablate_heads(model, as_spec(heads)):
        return copy_losses(next_token_loss(model(ids), ids), ids.shape[1] // 2)[1]


# --- SmolLM2 ---------------------------------------------------------------------------------


def measure_smollm2(ctx: lab.RunContext) -> dict:
    model, name = lab.smollm2_or_stand_in(ctx, max_seq_len=256)
    length = ctx.pick(128, 64, 8)
    low, high = SMOLLM2_TOKEN_RANGE
    high = min(high, model.cfg.vocab_size)
    low = min(low, high // 2)
    ids = repeated_random(list(range(low, high)), ctx.pick(16, 8, 2), length, EVAL_SEED)
    scores, loss = induction_scores(model, ids)
    head, held_out = chosen_head(scores)
    first, second = copy_losses(loss, length)
    return {
        "name": name,
        "scores": scores.mean(dim=0),
        "head": head,
        "held out": held_out,
        "first": first,
        "second": second,
        "length": length,
        "n": len(ids),
        "range": (low, high),
    }


# --- the experiment --------------------------------------------------------------------------


@lab.register("induction-heads")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    length = ctx.pick(32, 32, 8)
    seeds = ctx.seeds()
    runs = [train_seed(ctx, seed, length) for seed in seeds]
    smol = measure_smollm2(ctx)
    keys = (
        "held_out",
        "control_held_out",
        "first",
        "second",
        "ablated_second",
        "one_ablated_second",
        "copying_lost",
        "one_head_copying_lost",
    )
    spread = {key: lab.over_seeds([getattr(r, key) for r in runs]) for key in keys}
    rows = _rows(ctx, runs, spread, smol)
    checks = _checks(ctx, runs, spread, smol)
    notes = _notes(ctx, runs, smol, length)
    data = {
        "seeds": seeds,
        "sequence_length": {"attention_only": length, "smollm2": smol["length"]},
        "attention_only_scores": [r.scores.tolist() for r in runs],
        "attention_only_heads": [list(r.head) for r in runs],
        "attention_only_losses": [r.losses for r in runs],
        "attention_only_loss_by_position": [r.loss_by_position for r in runs],
        "control_loss_by_position": [r.control_loss_by_position for r in runs],
        "smollm2_scores": smol["scores"].tolist(),
    }
    figure = _plot(ctx, runs, smol, length)
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _rows(ctx: lab.RunContext, runs: list[SeedRun], spread: dict, smol: dict) -> list[dict]:
    what = ctx.say("measure", "测量")
    trained = ctx.say(
        "attention-only, trained (mean ± spread over seeds)",
        "纯注意力模型，已训练（随机种子间均值 ± 波动）",
    )
    control = ctx.say("attention-only, untrained", "纯注意力模型，未训练")
    pre = ctx.say("SmolLM2", "SmolLM2")
    heads = ", ".join("L{}H{}".format(*r.head) for r in runs)
    rows = [
        {
            what: ctx.say(
                "chosen head (highest on the choosing half)", "选出的头（选择那一半上最高）"
            ),
            trained: heads,
            control: "",
            pre: "L{}H{}".format(*smol["head"]),
        },
        {
            what: ctx.say(
                "chosen head's prefix-matching score, held-out half",
                "选出的头在留出那一半上的前缀匹配分数",
            ),
            trained: str(spread["held_out"]),
            control: str(spread["control_held_out"]),
            pre: smol["held out"],
        },
        {
            what: ctx.say("loss on the 1st copy (nats / token)", "第 1 遍的损失（nats / token）"),
            trained: str(spread["first"]),
            control: "",
            pre: smol["first"],
        },
        {
            what: ctx.say("loss on the 2nd copy (nats / token)", "第 2 遍的损失（nats / token）"),
            trained: str(spread["second"]),
            control: "",
            pre: smol["second"],
        },
        {
            what: ctx.say(
                "loss on the 2nd copy, chosen head switched off", "关掉选出的头后第 2 遍的损失"
            ),
            trained: str(spread["one_ablated_second"]),
            control: "",
            pre: "",
        },
        {
            what: ctx.say(
                f"heads scoring >= {MIN_INDUCTION_SCORE} on the choosing half",
                f"在选择那一半上得分 >= {MIN_INDUCTION_SCORE} 的头",
            ),
            trained: "; ".join(" ".join("L{}H{}".format(*h) for h in r.induction) for r in runs),
            control: "",
            pre: "",
        },
        {
            what: ctx.say(
                "loss on the 2nd copy, all those heads switched off", "关掉这些头后第 2 遍的损失"
            ),
            trained: str(spread["ablated_second"]),
            control: "",
            pre: "",
        },
    ]
    n_heads = smol["scores"].shape[1]
    top = torch.topk(smol["scores"].flatten(), min(TOP_HEADS, smol["scores"].numel())).indices
    for index in top.tolist():
        layer, head = divmod(index, n_heads)
        rows.append(
            {
                what: ctx.say(
                    f"SmolLM2 prefix-matching score, layer {layer} head {head}",
                    f"SmolLM2 第 {layer} 层第 {head} 个头的前缀匹配分数",
                ),
                trained: "",
                control: "",
                pre: smol["scores"][layer, head].item(),
            }
        )
    return rows


def _checks(ctx: lab.RunContext, runs: list[SeedRun], spread: dict, smol: dict) -> list:
    here = ctx.say("attention-only model trained here", "此处训练的纯注意力模型")
    pretrained = ctx.say("SmolLM2 (pretrained)", "SmolLM2（预训练）")
    window = max(1, len(runs[0].losses) // 5)
    checks = [
        lab.precondition(
            lab.converged(
                ctx.say(
                    f"random seed {seed}: training-loss drop over the last {window} steps",
                    f"随机种子 {seed}：最后 {window} 步训练损失的降幅",
                ),
                r.losses,
                window,
                PLATEAU_TOLERANCE,
            )
        )
        for seed, r in zip(ctx.seeds(), runs, strict=True)
    ]
    checks += [
        lab.precondition(
            lab.at_most(
                ctx.say(
                    "worst random seed: loss on the 2nd copy (nats / token)",
                    "最差的随机种子：第 2 遍的损失（nats / token）",
                ),
                max(r.second for r in runs),
                MAX_SECOND_COPY_LOSS,
            )
        ),
        lab.at_least(
            ctx.say(
                "chosen head's prefix-matching score, held-out (mean over seeds)",
                "选出的头在留出序列上的前缀匹配分数（随机种子间均值）",
            ),
            spread["held_out"].mean,
            MIN_INDUCTION_SCORE,
            group=here,
        ),
        lab.at_least(
            ctx.say(
                "chosen head's score / the untrained control's", "选出的头的分数 / 未训练对照的分数"
            ),
            spread["held_out"].mean / spread["control_held_out"].mean,
            MIN_RATIO_TO_UNTRAINED,
            group=here,
        ),
        lab.at_least(
            ctx.say(
                "share of the 2nd copy's advantage lost, those heads off",
                "关掉这些头后第 2 遍相对第 1 遍的优势失去的比例",
            ),
            spread["copying_lost"].mean,
            MIN_COPYING_LOST,
            group=here,
        ),
        lab.at_least(
            ctx.say(
                "SmolLM2: chosen head's prefix-matching score, held-out",
                "SmolLM2：选出的头在留出序列上的前缀匹配分数",
            ),
            smol["held out"],
            MIN_INDUCTION_SCORE,
            group=pretrained,
        ),
        lab.at_most(
            ctx.say(
                "SmolLM2: loss on the 2nd copy / loss on the 1st",
                "SmolLM2：第 2 遍的损失 / 第 1 遍的损失",
            ),
            smol["second"] / smol["first"],
            MAX_SECOND_TO_FIRST_LOSS,
            group=pretrained,
        ),
    ]
    return checks


def _notes(ctx: lab.RunContext, runs: list[SeedRun], smol: dict, length: int) -> list[str]:
    steps = len(runs[0].losses)
    n = len(runs)
    lost = ", ".join(f"{r.copying_lost:.2f}" for r in runs)
    one = ", ".join(f"{r.one_head_copying_lost:.2f}" for r in runs)
    notes = [
        ctx.say(
            f"attention-only model: 2 layers, no FFN, RoPE, trained {steps} steps on fresh "
            f"sequences of R={length} random tokens (of {RANDOM_VOCAB}) repeated twice, "
            f"{n} random seed(s); chance for the score is about 1/i, "
            f"{1 / (2 * length):.3f}..{1 / length:.3f} over the second copy, and the 1st "
            f"copy's loss at chance is ln {RANDOM_VOCAB} = {math.log(RANDOM_VOCAB):.2f}",
            f"纯注意力模型：2 层，无 FFN，RoPE，在 R={length} 个随机 token（共 {RANDOM_VOCAB} "
            f"种）重复两遍的新序列上训练 {steps} 步，{n} 个随机种子；分数的随机水平约为 1/i，"
            f"在第二遍上为 {1 / (2 * length):.3f}..{1 / length:.3f}，第 1 遍损失的随机水平是 "
            f"ln {RANDOM_VOCAB} = {math.log(RANDOM_VOCAB):.2f}",
        ),
        ctx.say(
            "each model's heads are chosen on the first half of its held-out sequences and "
            "scored, and switched off, on the second half; the share of the 2nd copy's "
            f"advantage lost per random seed, all heads scoring >= {MIN_INDUCTION_SCORE} "
            f"switched off: {lost}; the best one alone: {one} (several heads doing the same "
            "job stand in for each other)",
            "每个模型的头都在留出序列的前一半上选出，在后一半上计分并关掉；各随机种子第 2 遍"
            f"失去的优势比例：关掉所有得分 >= {MIN_INDUCTION_SCORE} 的头时为 {lost}；只关最好"
            f"的一个时为 {one}（做同一件事的几个头可以互相顶替）",
        ),
        ctx.say(
            f"{smol['name']}: {smol['n']} sequences of R={smol['length']} random token ids "
            f"in [{smol['range'][0]}, {smol['range'][1]}) repeated twice; the chosen head "
            f"(layer {smol['head'][0]}, head {smol['head'][1]}) scores "
            f"{smol['held out']:.3f} on held-out sequences and the 2nd copy costs "
            f"{smol['second'] / smol['first']:.2f}x the 1st",
            f"{smol['name']}：{smol['n']} 条由 [{smol['range'][0]}, {smol['range'][1]}) "
            f"中随机 token id 组成、长 R={smol['length']} 并重复两遍的序列；选出的头（第 "
            f"{smol['head'][0]} 层第 {smol['head'][1]} 个）在留出序列上得分 "
            f"{smol['held out']:.3f}，第 2 遍的损失是第 1 遍的 "
            f"{smol['second'] / smol['first']:.2f} 倍",
        ),
    ]
    return notes


def _plot(ctx: lab.RunContext, runs: list[SeedRun], smol: dict, length: int):
    fig, (curve, by_position, mine, theirs) = lab.new_figure(16.0, 4.2, ncols=4)
    for seed, r in zip(ctx.seeds(), runs, strict=True):
        curve.plot(lab.trailing_mean(r.losses, 20), label=f"seed {seed}")
    curve.set(
        xlabel="training step",
        ylabel="training loss (nats / token)",
        title="attention-only model: training",
    )
    curve.legend(fontsize=7)
    positions = range(1, 2 * length)  # the position of the predicted token
    for label, key in (("trained", "loss_by_position"), ("untrained", "control_loss_by_position")):
        values = torch.tensor([getattr(r, key) for r in runs])  # (seeds, 2R - 1)
        std = values.std(dim=0) if len(runs) > 1 else torch.zeros(values.shape[1])
        by_position.errorbar(positions, values.mean(dim=0), yerr=std, label=label, capsize=2)
    by_position.axvline(length, color="k", linestyle=":", label="2nd copy starts")
    by_position.set(
        xlabel="position of the predicted token",
        ylabel="loss (nats / token)",
        title="held-out sequences, mean ± spread over seeds",
    )
    by_position.legend(fontsize=7)
    panels = (
        (mine, runs[0].scores, f"attention-only, seed {ctx.seed}"),
        (theirs, smol["scores"], smol["name"]),
    )
    for ax, scores, name in panels:
        image = head_map(ax, scores, f"{name}\nmax {scores.max().item():.2f}")
    fig.colorbar(image, ax=theirs, label="prefix-matching score (attention on i - R + 1)")
    return fig
