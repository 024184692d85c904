"""Seed 000 §5.3: "为什么是 Layer 而不是 Batch：NLP 的序列长短不一，按 batch 维做统计会被
padding 污染、且依赖 batch 大小（推理时 batch=1 就没法算）；LayerNorm 对单样本、单位置独立归一化，
训练推理行为完全一致。"

glassformer's LayerNorm against torch's BatchNorm1d (statistics over the batch and the
positions, per channel), both on the token embeddings of real sentences (SmolLM2-135M's
embedding table, Shakespeare lines of different lengths). One sentence is normalised four
ways: alone; in a batch padded to a longer sentence (the padding's zeros enter BatchNorm's
statistics); beside other sentences; and, after BatchNorm has seen training batches, in
inference mode (running statistics) against training mode. Finally a batch of one sentence of
one token: BatchNorm in training mode has a single value per channel.
"""

from __future__ import annotations

import torch
from torch import nn

from glassformer.lab import base as lab
from glassformer.nn.norm import LayerNorm

# Thresholds, stated once. A normalisation "depends on" a condition when the same sentence's
# normalised values move by at least 0.1 (a tenth of the unit scale both produce) and is
# independent of it when they move by at most 1e-5 (float32 rounding).
MOVES, STILL = 0.1, 1e-5
N_WARMUP = 20  # training batches BatchNorm sees before the inference comparison


def sentences(ctx: lab.RunContext) -> list[str]:
    from glassformer.data.corpus import corpus_text

    lines = [line.strip() for line in corpus_text("modern")[:200_000].split("\n")]
    lines = [line for line in lines if len(line.split()) >= 4]
    return lines[: ctx.pick(64, 64, 16)]


def embedder(ctx: lab.RunContext):
    """(text -> (T, C) embeddings, name): SmolLM2's embedding table, or a random one (tiny)."""
    model, name = lab.smollm2_or_stand_in(ctx)
    if ctx.tiny:
        vocab = model.cfg.vocab_size
        return (lambda text: model.tok_emb(torch.tensor([ord(c) % vocab for c in text]))), name
    from glassformer.tokenize import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    ids = lambda text: torch.tensor(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    return (lambda text: model.tok_emb(ids(text))), name


def padded(batch: list[torch.Tensor]) -> torch.Tensor:
    """(B, T, C) with zeros after each sentence's end."""
    return nn.utils.rnn.pad_sequence(batch, batch_first=True)


def batchnorm(x: torch.Tensor, bn: nn.BatchNorm1d) -> torch.Tensor:
    """BatchNorm1d over (B, T, C): statistics per channel over every position of the batch."""
    return bn(x.transpose(1, 2)).transpose(1, 2)


@torch.no_grad()
def measure(ctx: lab.RunContext) -> dict[str, dict[str, float]]:
    embed, name = embedder(ctx)
    texts = sentences(ctx)
    embedded = [embed(t) for t in texts]
    dim = embedded[0].shape[-1]
    torch.manual_seed(ctx.seed)
    ln, bn = LayerNorm(dim).eval(), nn.BatchNorm1d(dim).train()
    one = embedded[0]
    n = one.shape[0]
    longest = max(embedded, key=len)
    others = embedded[1:8]
    out: dict[str, dict[str, float]] = {"LayerNorm": {}, "BatchNorm": {}}

    def both(batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        x = padded(batch)
        return {"LayerNorm": ln(x)[0, :n], "BatchNorm": batchnorm(x, bn)[0, :n]}

    alone = both([one])
    for condition, batch in (("padding", [one, longest]), ("batch-mates", [one, *others])):
        moved = both(batch)
        for norm in out:
            out[norm][condition] = float((moved[norm] - alone[norm]).abs().max())
    # training vs inference: BatchNorm learns running statistics from training batches
    for step in range(N_WARMUP):
        batchnorm(padded(embedded[step % len(embedded) : step % len(embedded) + 8]), bn)
    x = padded([one])
    trained = {"LayerNorm": ln(x), "BatchNorm": batchnorm(x, bn)}
    bn.eval()
    inferred = {"LayerNorm": ln(x), "BatchNorm": batchnorm(x, bn)}
    for norm in out:
        out[norm]["train vs inference"] = float((trained[norm] - inferred[norm]).abs().max())
    bn.train()
    single = one[:1][None]  # (1, 1, C): batch 1, one token
    out["LayerNorm"]["batch of one token"] = float(ln(single).abs().max())
    try:
        out["BatchNorm"]["batch of one token"] = float(batchnorm(single, bn).abs().max())
    except ValueError:  # torch: "Expected more than 1 value per channel when training"
        out["BatchNorm"]["batch of one token"] = float("nan")
    out["meta"] = {
        "name": name,
        "sentences": len(texts),
        "dim": dim,
        "tokens": n,
        "longest": len(longest),
    }
    return out


@lab.register("layernorm-vs-batchnorm")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    out = measure(ctx)
    meta = out.pop("meta")
    conditions = {
        "padding": ("polluted by padding", "被 padding 污染"),
        "batch-mates": ("depends on the rest of the batch", "依赖 batch 里的其他样本"),
        "train vs inference": ("training and inference differ", "训练与推理行为不同"),
    }
    checks = []
    for condition, (en, zh) in conditions.items():
        group = say(en, zh)
        checks += [
            lab.at_least(
                say(
                    f"BatchNorm: max change of the sentence's values, {condition}",
                    f"BatchNorm：句子数值的最大变化，{_zh(condition)}",
                ),
                out["BatchNorm"][condition],
                MOVES,
                group=group,
            ),
            lab.at_most(
                say(
                    f"LayerNorm: max change of the sentence's values, {condition}",
                    f"LayerNorm：句子数值的最大变化，{_zh(condition)}",
                ),
                out["LayerNorm"][condition],
                STILL,
                group=group,
            ),
        ]
    one = out["BatchNorm"]["batch of one token"]
    group = say("batch = 1 cannot be computed (BatchNorm, training mode)", "batch=1 就没法算")
    checks += [
        lab.at_least(
            say(
                "BatchNorm, a batch of one token: 1 if it cannot normalise (an error, or "
                "all zeros)",
                "BatchNorm，一个只有一个 token 的 batch：无法归一化（报错或全为零）则为 1",
            ),
            float(one != one or one == 0.0),
            1.0,
            group=group,
        ),
        lab.at_least(
            say(
                "LayerNorm, the same token: largest |value|", "LayerNorm，同一个 token：最大绝对值"
            ),
            out["LayerNorm"]["batch of one token"],
            MOVES,
            group=group,
        ),
    ]
    cond_col = say("condition", "条件")
    rows = [
        {
            cond_col: say(c, _zh(c)),
            say("LayerNorm", "LayerNorm"): out["LayerNorm"][c],
            say("BatchNorm", "BatchNorm"): out["BatchNorm"][c],
        }
        for c in (*conditions, "batch of one token")
    ]
    notes = [
        ctx.say(
            f"inputs: {meta['name']}'s token embeddings (d={meta['dim']}) of {meta['sentences']} "
            f"Shakespeare lines; the sentence read has {meta['tokens']} tokens, the longest "
            f"{meta['longest']}; BatchNorm1d normalises each channel over the batch's positions, "
            f"padding included; its inference mode uses running statistics from {N_WARMUP} "
            "training "
            "batches; the batch-of-one row is the largest |value| out (nan: torch refused)",
            f"输入：{meta['name']} 的词嵌入（d={meta['dim']}），取 {meta['sentences']} 行莎士比亚"
            f"台词；被读的句子有 {meta['tokens']} 个 token，最长的一句 {meta['longest']} 个；"
            "BatchNorm1d 对每个通道在整个 batch 的所有位置（含 padding）上做统计；它的推理模式用 "
            f"{N_WARMUP} 个训练 batch 累积的滑动统计量；“一个 token 的 batch”一行是输出的最大绝对值"
            "（nan：torch 拒绝计算）",
        )
    ]
    return lab.Result.from_checks(
        rows, checks, figure=_plot(out, conditions), data=out, notes=notes
    )


def _zh(condition: str) -> str:
    return {
        "padding": "加 padding",
        "batch-mates": "换 batch 里的其他样本",
        "train vs inference": "训练模式对推理模式",
        "batch of one token": "只有一个 token 的 batch",
    }[condition]


def _plot(out: dict, conditions: dict):
    fig, ax = lab.new_figure(6.4, 3.4)
    names = list(conditions)
    floor = 1e-8  # log scale: an exact 0 drawn at the floor
    lab.grouped_bars(
        ax,
        names,
        {norm: [max(out[norm][c], floor) for c in names] for norm in ("LayerNorm", "BatchNorm")},
    )
    ax.axhline(MOVES, color="k", linestyle=":", label=f"{MOVES}: depends")
    ax.set(
        yscale="log",
        ylabel="max change of one sentence's values",
        title="the same sentence, normalised under other conditions",
    )
    ax.legend(fontsize=7)
    return fig
