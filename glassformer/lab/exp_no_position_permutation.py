"""Seed 000 §4.3: without positional encoding, self-attention is permutation-equivariant, so
"我爱她" and "她爱我" give every token the same output, only permuted. Tested on small random
glassformer models with character tokens.

The claim is about bidirectional attention (family="bert"): every token sees every token. A
causal mask (family="gpt") breaks the symmetry by itself (the first token sees only itself), so
GPT rows are shown beside it as an explanation, not as part of the claim.
"""

from __future__ import annotations

import numpy as np
import torch

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.models import build_model
from glassformer.tokenizers import CharTokenizer

SENTENCE, SWAPPED = "我爱她", "她爱我"
LONG_SENTENCE = "那只猫没跳上桌子因为它太累了"
# Thresholds, stated once. Evidence: without positions a bidirectional model's outputs for a
# permuted input are its outputs permuted, to float32 noise (max |Δ| <= 1e-5 on activations of
# size ~1). Setup: with any position encoding the same probe sees a difference (> 1e-3; real
# differences at random init, d_model 64, are ~0.1-1), so a gap of 0 is not the probe's
# blindness.
SAME_TOL, DIFFERENT_MIN = 1e-5, 1e-3
EQUIVARIANT = "without positions, attention sees a set"
WORDS_ZH = {
    "bert": "bert（双向）",
    "gpt": "gpt（因果）",
    "bidirectional": "双向",
    "causal": "因果",
    "none": "无位置编码",
    "learned": "可学习位置编码",
    "sinusoidal": "正弦位置编码",
    "rope": "RoPE（旋转位置编码）",
}


def _model(family: str, position: str, vocab_size: int, ctx: lab.RunContext) -> torch.nn.Module:
    torch.manual_seed(ctx.seed)
    cfg = ModelConfig(
        family=family,
        vocab_size=vocab_size,
        d_model=ctx.pick(64, 64, 32),
        n_layers=ctx.pick(4, 2, 1),
        n_heads=4,
        max_seq_len=32,
        position=position,
        attention_backend="eager",
    )
    return build_model(cfg).eval()


@torch.no_grad()
def _per_token(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    out = model(x) if model.cfg.family == "bert" else model.hidden_states(x)
    return out[0]  # (T, C)


def permutation_gap(model: torch.nn.Module, ids: list[int], order: list[int]) -> float:
    """max |f(x)[order] - f(x[order])|: 0 for a permutation-equivariant model."""
    out = _per_token(model, ids)
    out_permuted = _per_token(model, [ids[i] for i in order])
    return float((out[order] - out_permuted).abs().max())


@lab.register("no-position-permutation")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    tok = CharTokenizer.from_text(SENTENCE + LONG_SENTENCE)
    ids = tok.encode(SENTENCE)
    swap = [2, 1, 0]  # 她爱我 is 我爱她 reversed
    rng = np.random.default_rng(ctx.seed)
    long_ids = tok.encode(LONG_SENTENCE)
    orders = [rng.permutation(len(long_ids)).tolist() for _ in range(ctx.pick(8, 4, 1))]

    say = ctx.say
    for word, word_zh in WORDS_ZH.items():
        say(word, word_zh)
    n_orders = len(orders)
    rows, checks = [], []
    for family in ("bert", "gpt"):
        for position in ("none", "learned", "sinusoidal", "rope"):
            model = _model(family, position, tok.vocab_size, ctx)
            gap = permutation_gap(model, ids, swap)
            long_gap = max(permutation_gap(model, long_ids, o) for o in orders)
            rows.append(
                {
                    say("family", "模型家族"): family,
                    say("mask", "掩码"): "bidirectional" if family == "bert" else "causal",
                    say("position", "位置编码"): position,
                    say("我爱她 vs 她爱我 max|Δ|", "我爱她 与 她爱我 max|Δ|"): gap,
                    say(
                        f"random shuffles ({n_orders}) max|Δ|", f"随机打乱（{n_orders} 次）max|Δ|"
                    ): long_gap,
                    say("equivariant", "置换等变"): gap <= SAME_TOL and long_gap <= SAME_TOL,
                }
            )
            if family != "bert":
                continue  # the causal rows explain; the claim is about attention without a mask
            label = f"bert, position={position}"
            group = say(EQUIVARIANT, "没有位置编码时，注意力看到的是集合")
            if position == "none":
                checks.append(
                    lab.at_most(
                        say(f"{label}: 我爱她/她爱我 gap", f"{label}：我爱她/她爱我 的差异"),
                        gap,
                        SAME_TOL,
                        group=group,
                    )
                )
                checks.append(
                    lab.at_most(
                        say(f"{label}: shuffled-sentence gap", f"{label}：打乱句子的差异"),
                        long_gap,
                        SAME_TOL,
                        group=group,
                    )
                )
            else:
                probe = lab.at_least(
                    say(
                        f"{label}: 我爱她/她爱我 gap (the probe sees order)",
                        f"{label}：我爱她/她爱我 的差异（探针看得出顺序）",
                    ),
                    gap,
                    DIFFERENT_MIN,
                )
                checks.append(lab.precondition(probe))
    figure = _plot(rows)
    gpt_none = next(r for r in rows if r["family"] == "gpt" and r["position"] == "none")
    gpt_gap = gpt_none["我爱她 vs 她爱我 max|Δ|"]
    n_long = len(long_ids)
    if gpt_gap > DIFFERENT_MIN:
        gpt_note = say(
            "GPT rows (causal mask) are not part of the verdict: with position='none' the causal "
            f"model's 我爱她/她爱我 gap is {gpt_gap:.3g} "
            "(it tells the orders apart: the mask makes position 0 see one token and position 2 "
            "see three; the gpt-bag-of-words experiment tests this)",
            "GPT 各行（因果掩码）不计入结论：position='none' 时，因果模型的 我爱她/她爱我 差异为 "
            f"{gpt_gap:.3g}（它分得出两种顺序：掩码让位置 0 只看到一个 token，位置 2 看到三个；"
            "gpt-bag-of-words 实验检验的正是这一点）",
        )
    else:
        gpt_note = say(
            "GPT rows (causal mask) are not part of the verdict: with position='none' the causal "
            f"model's 我爱她/她爱我 gap is {gpt_gap:.3g} "
            "(it does not tell the orders apart either)",
            "GPT 各行（因果掩码）不计入结论：position='none' 时，因果模型的 我爱她/她爱我 差异为 "
            f"{gpt_gap:.3g}（它同样分不出两种顺序）",
        )
    notes = [
        gpt_note,
        say(
            f"random-init models (seed {ctx.seed}), {n_orders} random shuffles of "
            f"{LONG_SENTENCE} (length {n_long}) besides the 我爱她 -> 她爱我 swap",
            f"随机初始化的模型（随机种子 {ctx.seed}），除 我爱她 -> 她爱我 的互换外，"
            f"还把 {LONG_SENTENCE}（长度 {n_long}）随机打乱 {n_orders} 次",
        ),
    ]
    return lab.Result.from_checks(rows, checks, figure=figure, notes=notes)


def _plot(rows: list[dict]):
    fig, ax = lab.new_figure(6.4, 3.4)
    labels = [f"{r['family']}\n{r['position']}" for r in rows]
    gaps = [max(r["我爱她 vs 她爱我 max|Δ|"], 1e-9) for r in rows]  # log axis: floor at 1e-9
    colors = ["tab:green" if r["equivariant"] else "tab:red" for r in rows]
    ax.bar(range(len(rows)), gaps, color=colors)
    ax.set_yscale("log")
    ax.axhline(SAME_TOL, color="gray", ls="--", lw=1, label=f"same ≤ {SAME_TOL:g}")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("max |f(我爱她) permuted − f(她爱我)|")
    ax.set_title("置换等变：没有位置编码时，双向注意力分不出 我爱她 / 她爱我")
    ax.legend(fontsize=8)
    return fig
