"""Seed 000 §3.3: "每行是一个概率分布（看谁），每列不归一——'谁被看'没有约束，一个热门 token 可以被
所有位置同时重仓". Every row of the attention matrix sums to 1; a column may hold far more.

SmolLM2-135M reads windows of held-out Shakespeare. For every head, every key's column mass is
the mean weight the queries put on it (queries from position MIN_QUERY on, where a uniform row
puts at most 1/17 on any key). A head has a "hot" key when one key takes at least HEAVY of the
weight of at least COVERAGE of the queries at once. Control: the same architecture with random
weights, read the same way.
"""

from __future__ import annotations

import torch

from glassformer.inspect import capture
from glassformer.lab import base as lab
from glassformer.lab.fit import random_windows
from glassformer.models import build_model

MIN_QUERY = 16
HEAVY, COVERAGE = 0.5, 0.9
# Thresholds, stated once. "可以被所有位置同时重仓": at least a tenth of SmolLM2's heads have a hot
# key (one key with >= 0.5 of the weight of >= 90% of the queries at once), a tenth more than
# with random weights; "每列不归一": the hottest column of those heads holds at least 10x what a
# row may (its weights over the queries sum to >= 10, a row's to exactly 1).
MIN_SHARE = 0.1
MIN_COLUMN_OVER_ROW = 10.0


@torch.no_grad()
def hot_keys(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (layer, head): the share of windows whose hottest key takes >= HEAVY of >= COVERAGE of
    the queries, the position of that key (the most frequent over windows), and the mean column
    sum of the hottest key (queries from MIN_QUERY on). ids: (B, T)."""
    with capture(model, residual=False) as cap:
        model(ids)
    weights = torch.stack([a.float() for a in cap.attention], dim=1)  # (B, L, H, T, T)
    rows = weights[..., MIN_QUERY:, :]  # (B, L, H, Q, T)
    column = rows.sum(dim=-2)  # (B, L, H, T): each key's weight summed over the queries
    hottest = column.argmax(dim=-1)  # (B, L, H)
    on_hottest = rows.gather(-1, hottest[..., None, None].expand(*rows.shape[:-1], 1))[..., 0]
    covered = (on_hottest >= HEAVY).float().mean(dim=-1) >= COVERAGE  # (B, L, H)
    return covered.float().mean(0), hottest.mode(dim=0).values, column.amax(dim=-1).mean(0)


def windows(ctx: lab.RunContext, model, tokenizer) -> torch.Tensor:
    n, length = ctx.pick(32, 16, 4), ctx.pick(128, 128, 32)
    generator = torch.Generator().manual_seed(ctx.seed)
    if tokenizer is None:  # tiny: random ids for the random stand-in
        ids = torch.randint(0, model.cfg.vocab_size, (n * length * 2,), generator=generator)
    else:
        from glassformer.data.corpus import corpus_text

        text = corpus_text("modern")
        held_out = text[int(len(text) * 0.9) :][: n * length * 8]
        ids = torch.tensor(tokenizer.encode(held_out, add_special_tokens=False))
    return random_windows(ids, n, length, generator)["input_ids"]


@lab.register("attention-sinks")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    model, name = lab.smollm2_or_stand_in(ctx)
    tokenizer = None
    if not ctx.tiny:
        from glassformer.interop.pretrained import from_pretrained

        tokenizer = from_pretrained("smollm2")[1]
    ids = windows(ctx, model, tokenizer)
    torch.manual_seed(ctx.seed)
    twin = build_model(model.cfg).eval()
    readings = {name: hot_keys(model, ids), "random weights": hot_keys(twin, ids)}
    del model, twin
    share = {n: float((covered >= 0.5).float().mean()) for n, (covered, _, _) in readings.items()}
    covered, position, column = readings[name]
    hot = covered >= 0.5  # (L, H): heads with a hot key in most windows
    column_of_hot = float(column[hot].mean()) if hot.any() else 0.0
    group = say(
        "one token is weighted heavily by every position at once",
        "一个热门 token 被所有位置同时重仓",
    )
    checks = [
        lab.at_least(
            say(f"{name}: share of heads with a hot key", f"{name}：有热门 key 的头所占比例"),
            share[name],
            MIN_SHARE,
            group=group,
        ),
        lab.at_least(
            say(
                "share of heads with a hot key: trained - random weights",
                "有热门 key 的头所占比例：训练过的 - 随机权重",
            ),
            share[name] - share["random weights"],
            MIN_SHARE,
            group=group,
        ),
        lab.at_least(
            say(
                f"{name}: hot key's column sum over the queries, those heads (a row sums to 1)",
                f"{name}：这些头里热门 key 那一列对所有查询的和（一行之和为 1）",
            ),
            column_of_hot,
            MIN_COLUMN_OVER_ROW,
            group=say("columns are not normalised", "列不归一"),
        ),
    ]
    positions = position[hot].tolist()
    at_first = sum(p == 0 for p in positions)
    model_col, share_col = say("model", "模型"), say("heads with a hot key", "有热门 key 的头")
    column_col = say("mean hottest column sum", "最热一列之和的均值")
    rows = [
        {
            model_col: say(n, "随机权重" if n == "random weights" else n),
            share_col: f"{int((c >= 0.5).sum())} / {c.numel()}",
            column_col: float(col.amax(dim=-1).mean()),
        }
        for n, (c, _, col) in readings.items()
    ]
    n_queries = ids.shape[1] - MIN_QUERY
    notes = [
        ctx.say(
            f"{ids.shape[0]} windows of {ids.shape[1]} tokens of held-out Shakespeare; "
            f"queries from position {MIN_QUERY} on ({n_queries} per window, so a column can "
            f"hold up to {n_queries}); a hot key takes >= {HEAVY} of >= {COVERAGE:.0%} of "
            "them in one window, and a head has one when most windows do",
            f"{ids.shape[0]} 个取自留出莎士比亚文本的 {ids.shape[1]} token 窗口；只计位置 "
            f"{MIN_QUERY} 起的查询（每个窗口 {n_queries} 个，所以一列之和最多为 {n_queries}）；"
            f"热门 key：在一个窗口里拿到至少 {COVERAGE:.0%} 查询的 >= {HEAVY} 权重，"
            "多数窗口都有时，这个头就算有热门 key",
        ),
        ctx.say(
            f"{name}: of the {len(positions)} heads with a hot key, {at_first} have it at "
            "the window's first token (an attention sink: a place to park weight when no "
            "key is relevant, Xiao et al. 2023)",
            f"{name}：{len(positions)} 个有热门 key 的头中，{at_first} 个的热门 key 是窗口的"
            "第一个 token（注意力汇点：没有相关的 key 时用来安放权重的位置，Xiao et al. "
            "2023）",
        ),
    ]
    data = {
        n: {"hot_share_by_head": c.tolist(), "hot_position": p.tolist(), "column": col.tolist()}
        for n, (c, p, col) in readings.items()
    }
    return lab.Result.from_checks(
        rows, checks, figure=_plot(readings, name), data=data, notes=notes
    )


def _plot(readings: dict, name: str):
    fig, axes = lab.new_figure(10.0, 3.8, ncols=2)
    for ax, (label, (covered, _, _)) in zip(axes, readings.items(), strict=True):
        image = ax.imshow(covered.numpy(), cmap="magma", vmin=0, vmax=1, aspect="auto")
        ax.set(xlabel="head", ylabel="layer", title=label)
    fig.colorbar(image, ax=axes[-1], label="share of windows with a hot key")
    return fig
