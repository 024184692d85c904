"""Seed 000 §2.4: "切块是'训练数据预处理'，块与块之间没有梯度流动——模型永远只在窗口内看上下文。
跨块的长程关系，训练时就丢了。"

A token stream made of two kinds of segments, [KEY k filler... QUERY k]: the token after QUERY
copies the k that followed KEY, LONG or SHORT positions earlier. Two identical small GPTs train
on the same stream with the same steps and tokens per step, cut into chunks of CHUNK_SMALL
(shorter than LONG: no chunk ever holds a long segment's KEY and its QUERY) or CHUNK_LARGE
(longer than LONG). Both are read on held-out windows long enough for either relation: how
often is the token after QUERY the right k, for the long and for the short relation?
"""

from __future__ import annotations

import torch

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.fit import Schedule, fit, step_generator
from glassformer.models import build_model

N_KEYS, N_FILLER = 16, 32
KEY, QUERY = N_KEYS + N_FILLER, N_KEYS + N_FILLER + 1
VOCAB = QUERY + 1
SHORT, LONG = 8, 48  # positions from KEY to QUERY
CHUNK_SMALL, CHUNK_LARGE, EVAL_WINDOW = 32, 96, 96
CHANCE = 1 / N_KEYS
# Thresholds, stated once. Precondition: the small-chunk model learned the relation its chunks
# hold (the short copy right at least 0.9 of the time) and both training runs reached their
# plateau (the last fifth's mean loss within 3% of the fifth before). "跨块的长程关系，训练时就
# 丢了": the small-chunk model gets the long copy right no more than twice chance, while the
# large-chunk model, trained on the same stream, gets it right at least 0.9 of the time, by more
# than the seeds' spread plus 0.5.
MIN_LEARNED, MAX_OVER_CHANCE, MIN_GAP = 0.9, 2.0, 0.5
PLATEAU_TOLERANCE = 0.03


def segment(generator: torch.Generator) -> list[int]:
    """[KEY, k, filler..., QUERY, k] with KEY and QUERY SHORT or LONG positions apart."""
    distance = SHORT if torch.rand((), generator=generator) < 0.5 else LONG
    k = int(torch.randint(0, N_KEYS, (), generator=generator))
    filler = (N_KEYS + torch.randint(0, N_FILLER, (distance - 2,), generator=generator)).tolist()
    return [KEY, k, *filler, QUERY, k]


def stream(n_tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < n_tokens:
        out += segment(generator)
    return torch.tensor(out[:n_tokens])


def chunk_batches(ids: torch.Tensor, chunk: int, tokens_per_step: int, seed: int):
    """batch(step): tokens_per_step tokens as chunks of `chunk` cut at random places, the loss
    on the token after each QUERY (the rest is random filler, which no model can predict)."""
    n = tokens_per_step // chunk

    def batch(step: int) -> dict[str, torch.Tensor]:
        starts = torch.randint(0, len(ids) - chunk - 1, (n,), generator=step_generator(seed, step))
        rows = starts[:, None] + torch.arange(chunk + 1)
        inputs, targets = ids[rows[:, :-1]], ids[rows[:, 1:]].clone()
        targets[inputs != QUERY] = -100  # the loss is on the copies only: filler is noise
        return {"input_ids": inputs, "targets": targets}

    return batch


@torch.no_grad()
def copy_accuracy(model, ids: torch.Tensor, n_windows: int) -> dict[int, float]:
    """{SHORT: acc, LONG: acc}: the prediction after QUERY against the key, in consecutive
    windows of EVAL_WINDOW, counting only queries whose KEY lies inside the same window."""
    hits, total = {SHORT: 0, LONG: 0}, {SHORT: 0, LONG: 0}
    for w in range(n_windows):
        window = ids[w * EVAL_WINDOW : (w + 1) * EVAL_WINDOW]
        predicted = model(window[None])[0].argmax(-1)  # (T,)
        for q in (window == QUERY).nonzero().flatten().tolist():
            for distance in (SHORT, LONG):
                if q - distance >= 0 and window[q - distance] == KEY and q + 1 < len(window):
                    total[distance] += 1
                    hits[distance] += int(predicted[q] == window[q + 1])
    return {d: hits[d] / max(total[d], 1) for d in hits}


def train(ctx: lab.RunContext, chunk: int, seed: int, ids: torch.Tensor):
    steps = ctx.pick(1200, 400, 6)
    cfg = ModelConfig(
        vocab_size=VOCAB,
        d_model=ctx.pick(64, 64, 16),
        n_layers=2,
        n_heads=4,
        max_seq_len=EVAL_WINDOW,
        position="rope",
    )
    torch.manual_seed(seed)
    model = build_model(cfg)
    schedule = Schedule(
        max_steps=steps, learning_rate=3e-3, warmup_steps=max(1, steps // 20), weight_decay=0.0
    )
    losses = fit(model, chunk_batches(ids, chunk, ctx.pick(3072, 3072, 192), seed), schedule)
    return model.eval(), losses


@lab.register("cross-chunk-lost")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say, seeds = ctx.say, ctx.seeds()
    n_eval = ctx.pick(200, 100, 4)
    acc = {CHUNK_SMALL: [], CHUNK_LARGE: []}
    plateaus = []
    for seed in seeds:
        ids, held = stream(500_000, seed), stream(n_eval * EVAL_WINDOW, 10_000 + seed)
        for chunk in acc:
            model, losses = train(ctx, chunk, seed, ids)
            acc[chunk].append(copy_accuracy(model, held, n_eval))
            plateaus.append(
                lab.converged(
                    say(
                        f"chunks of {chunk}, seed {seed}: relative loss drop over the last fifth",
                        f"块长 {chunk}，随机种子 {seed}：最后五分之一的损失相对降幅",
                    ),
                    losses,
                    max(1, len(losses) // 5),
                    PLATEAU_TOLERANCE,
                )
            )
    spread = {(c, d): lab.over_seeds([a[d] for a in acc[c]]) for c in acc for d in (SHORT, LONG)}
    group = say(
        "a relation longer than the chunk is lost in training", "跨块的长程关系，训练时就丢了"
    )
    small_long, large_long = spread[(CHUNK_SMALL, LONG)], spread[(CHUNK_LARGE, LONG)]
    checks = [
        *plateaus,
        lab.precondition(
            lab.at_least(
                say(
                    f"chunks of {CHUNK_SMALL}: short copy ({SHORT} apart) accuracy",
                    f"块长 {CHUNK_SMALL}：短距离复制（相隔 {SHORT}）准确率",
                ),
                spread[(CHUNK_SMALL, SHORT)].mean,
                MIN_LEARNED,
            )
        ),
        lab.at_most(
            say(
                f"chunks of {CHUNK_SMALL}: long copy ({LONG} apart) accuracy / chance",
                f"块长 {CHUNK_SMALL}：长距离复制（相隔 {LONG}）准确率 / 随机猜测",
            ),
            small_long.mean / CHANCE,
            MAX_OVER_CHANCE,
            group=group,
        ),
        lab.at_least(
            say(
                f"chunks of {CHUNK_LARGE}: long copy accuracy",
                f"块长 {CHUNK_LARGE}：长距离复制准确率",
            ),
            large_long.mean,
            MIN_LEARNED,
            group=group,
        ),
        lab.exceeds_spread(
            say(
                f"long copy accuracy: chunks of {CHUNK_LARGE} - of {CHUNK_SMALL}",
                f"长距离复制准确率：块长 {CHUNK_LARGE} - 块长 {CHUNK_SMALL}",
            ),
            large_long,
            small_long,
            MIN_GAP,
            group=group,
        ),
    ]
    chunk_col = say("training chunk", "训练块长")
    short_col = say(f"short copy ({SHORT} apart)", f"短距离复制（相隔 {SHORT}）")
    long_col = say(f"long copy ({LONG} apart)", f"长距离复制（相隔 {LONG}）")
    rows = [
        {chunk_col: c, short_col: str(spread[(c, SHORT)]), long_col: str(spread[(c, LONG)])}
        for c in acc
    ]
    notes = [
        ctx.say(
            f"two GPTs (2 layers) per seed ({seeds}), the same stream and tokens per step, cut "
            "into "
            f"chunks of {CHUNK_SMALL} or {CHUNK_LARGE}; read on {n_eval} held-out windows of "
            f"{EVAL_WINDOW}; {N_KEYS} keys, chance {CHANCE:.3f}",
            f"每个随机种子（{seeds}）两个 GPT（2 层），同样的 token 流、每步同样多的 token，切成 "
            f"{CHUNK_SMALL} 或 {CHUNK_LARGE} 的块；在 {n_eval} 个 {EVAL_WINDOW} "
            "长的留出窗口上读取；"
            f"{N_KEYS} 个 key，随机猜测 {CHANCE:.3f}",
        )
    ]
    data = {
        "accuracy": {str(c): [{str(d): a[d] for d in a} for a in v] for c, v in acc.items()},
        "seeds": seeds,
    }
    return lab.Result.from_checks(rows, checks, figure=_plot(spread), data=data, notes=notes)


def _plot(spread: dict):
    fig, ax = lab.new_figure(6.0, 3.4)
    for i, chunk in enumerate((CHUNK_SMALL, CHUNK_LARGE)):
        ax.bar(
            [j + (i - 0.5) * 0.38 for j in range(2)],
            [spread[(chunk, d)].mean for d in (SHORT, LONG)],
            0.38,
            yerr=[spread[(chunk, d)].spread for d in (SHORT, LONG)],
            capsize=3,
            label=f"trained on chunks of {chunk}",
        )
    ax.axhline(CHANCE, color="grey", linestyle=":", label="chance")
    ax.set_xticks(range(2), [f"KEY {SHORT} before QUERY", f"KEY {LONG} before QUERY"])
    ax.set(ylabel="copy accuracy, held-out (mean ± spread)", ylim=(0, 1.05))
    ax.legend(fontsize=7)
    return fig
