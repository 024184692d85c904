"""Seed 000 §3.3 and seed 002 练习 1 第 3 步: why attention divides the scores by √d_k.

With query and key components independent and of unit variance, Var[q·k] = d_k: the raw scores
grow with the head dimension, push softmax into saturation (nearly one-hot weights) and starve
the gradient that flows back through it. Measured here on random q, k, v for several d_k, with
and without the division: the variance of q·k, the entropy and largest weight of each attention
row, and the norm of the gradient of a loss on the attention output with respect to q. Plus the
seed 002 exercise, as a row: the 猫/累/它 example without / √d and with every key ×10.
"""

from __future__ import annotations

import math

import torch

from glassformer import numpy_ref
from glassformer.lab import base as lab

N_KEYS = 32  # keys per attention row
# Thresholds, stated once. "Var[q·k] ≈ d_k": the measured ratio Var / d_k within 15% of 1 at
# every d_k (the sample variance of n_rows x 32 products is good to a few %). "/√d_k keeps
# softmax soft": scaled rows keep at least half the uniform entropy ln(32) at every d_k.
# "Without it, softmax saturates": the widest head's unscaled rows are nearly one-hot (mean
# largest weight >= 0.9). "The gradient is nearly zero": what softmax passes back to the
# unscaled scores is < 10% of the scaled one's at the widest head.
VARIANCE_TOLERANCE = 0.15
MIN_SCALED_ENTROPY = 0.5 * math.log(N_KEYS)
MIN_SATURATED_WEIGHT = 0.9
MAX_GRADIENT_RATIO = 0.1
VARIANCE = "Var[q·k] ≈ d_k"
SOFT = "/√d_k keeps softmax soft"
SATURATES = "without /√d_k softmax saturates"
GRADIENT = "without /√d_k the gradient nearly vanishes"


def attention_statistics(d_k: int, scaled: bool, n_rows: int, seed: int) -> dict[str, float]:
    """Mean entropy (nats), mean largest weight, and gradient norms over n_rows random rows.

    q, k, v ~ N(0, 1) per component; loss = sum of the attention output. score_grad is
    |∂loss/∂scores| / √d_k: what softmax passes back, per unit of the values' size (the output
    sums d_k value components, so the raw norm grows like √d_k either way). q_grad is
    |∂loss/∂q|, which also carries the keys' size: reported, not checked."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(n_rows, 1, d_k, generator=generator, dtype=torch.float64)
    k = torch.randn(n_rows, N_KEYS, d_k, generator=generator, dtype=torch.float64)
    v = torch.randn(n_rows, N_KEYS, d_k, generator=generator, dtype=torch.float64)
    q.requires_grad_(True)
    raw = q @ k.transpose(1, 2)  # (rows, 1, keys)
    scores = raw / math.sqrt(d_k) if scaled else raw
    scores.retain_grad()
    weights = scores.softmax(dim=-1)
    (weights @ v).sum().backward()
    entropy = -(weights * weights.clamp_min(1e-300).log()).sum(dim=-1)
    return {
        "variance": float(raw.detach().var()),
        "entropy": float(entropy.detach().mean()),
        "max_weight": float(weights.detach().max(dim=-1).values.mean()),
        # what flows back through softmax into the scores (the tutorial's "gradient")
        "score_grad": float(scores.grad.norm(dim=-1).mean() / math.sqrt(d_k)),
        "q_grad": float(q.grad.norm(dim=-1).mean()),
    }


def worked_example_without_scaling() -> tuple[list[float], list[float]]:
    """Seed 002's exercise: the 猫/累/它 weights as printed, and with / √d removed and every
    key ×10 (numpy_ref.attention with scale 1)."""
    printed = numpy_ref.worked_example().weights
    q, k, v = numpy_ref.worked_example_vectors()
    blunt = numpy_ref.attention(q[None], 10.0 * k, v, scale=1.0).weights[0]
    return [float(w) for w in printed], [float(w) for w in blunt]


@lab.register("scaling")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    dims = ctx.pick([4, 16, 64, 256, 1024], [4, 16, 64, 256, 1024], [4, 64, 256])
    n_rows = ctx.pick(4096, 1024, 128)
    say = ctx.say
    variance = say(VARIANCE, "Var[q·k] ≈ d_k（点积的方差约等于 d_k）")
    soft = say(SOFT, "除以 √d_k 让 softmax 保持平缓")
    saturates = say(SATURATES, "不除以 √d_k，softmax 会饱和")
    gradient = say(GRADIENT, "不除以 √d_k，梯度几乎消失")
    dk = say("d_k", "d_k（每个头的维度）")
    rows, checks, stats = [], [], {}
    for d_k in dims:
        for scaled in (True, False):
            stats[d_k, scaled] = attention_statistics(d_k, scaled, n_rows, ctx.seed)
        s, u = stats[d_k, True], stats[d_k, False]
        rows.append(
            {
                dk: d_k,
                say("Var[q·k] / d_k", "方差 Var[q·k] / d_k"): s["variance"] / d_k,
                say("entropy /√d_k", "熵（除以 √d_k）"): s["entropy"],
                say("entropy raw", "熵（不缩放）"): u["entropy"],
                say("max weight /√d_k", "最大权重（除以 √d_k）"): s["max_weight"],
                say("max weight raw", "最大权重（不缩放）"): u["max_weight"],
                say("|∂L/∂s| /√d_k", "|∂L/∂s|（除以 √d_k）"): s["score_grad"],
                say("|∂L/∂s| raw", "|∂L/∂s|（不缩放）"): u["score_grad"],
                say("|∂L/∂q| /√d_k", "|∂L/∂q|（除以 √d_k）"): s["q_grad"],
                say("|∂L/∂q| raw", "|∂L/∂q|（不缩放）"): u["q_grad"],
            }
        )
        checks.append(
            lab.approx(
                say(f"d_k={d_k}: Var[q·k] / d_k", f"d_k={d_k}：方差 Var[q·k] / d_k"),
                s["variance"] / d_k,
                1.0,
                VARIANCE_TOLERANCE,
                group=variance,
            )
        )
        checks.append(
            lab.at_least(
                say(
                    f"d_k={d_k}: entropy with /√d_k (nats)", f"d_k={d_k}：除以 √d_k 时的熵（nats）"
                ),
                s["entropy"],
                MIN_SCALED_ENTROPY,
                group=soft,
            )
        )
    widest = dims[-1]
    scaled, raw = stats[widest, True], stats[widest, False]
    saturated = raw["max_weight"]
    checks.append(
        lab.at_least(
            say(
                f"d_k={widest}: mean largest weight without /√d_k",
                f"d_k={widest}：不除以 √d_k 时的平均最大权重",
            ),
            saturated,
            MIN_SATURATED_WEIGHT,
            group=saturates,
        )
    )
    score_ratio = raw["score_grad"] / scaled["score_grad"]
    checks.append(
        lab.at_most(
            say(
                f"d_k={widest}: gradient through softmax, without / with /√d_k",
                f"d_k={widest}：穿过 softmax 的梯度，不除以 / 除以 √d_k",
            ),
            score_ratio,
            MAX_GRADIENT_RATIO,
            group=gradient,
        )
    )
    # The seed's exercise (练习 1 第 3 步) is arithmetic on its own vectors: a row, not evidence.
    printed, blunt = worked_example_without_scaling()
    rows.append(
        {
            dk: say("猫/累/它 (seed 002)", "猫/累/它（教程 002）"),
            "max weight /√d_k": max(printed),
            "max weight raw": max(blunt),
        }
    )
    q_ratio = raw["q_grad"] / scaled["q_grad"]
    larger = q_ratio > 1
    ln_keys = math.log(N_KEYS)
    printed_text = ", ".join(f"{w:.3f}" for w in printed)
    blunt_text = ", ".join(f"{w:.4f}" for w in blunt)
    notes = [
        say(
            f"random q, k, v ~ N(0, 1), {n_rows} rows of {N_KEYS} keys per d_k; at d_k={widest} "
            f"unscaled rows have mean largest weight {raw['max_weight']:.3f} and entropy "
            f"{raw['entropy']:.2f} nats (scaled: {scaled['max_weight']:.3f}, "
            f"{scaled['entropy']:.2f}; uniform ln {N_KEYS} = {ln_keys:.2f})",
            f"随机的 q、k、v ~ N(0, 1)，每个 d_k 取 {n_rows} 行、每行 {N_KEYS} 个键；d_k={widest} "
            f"时，不缩放的行平均最大权重为 {raw['max_weight']:.3f}，熵为 {raw['entropy']:.2f} "
            f"nats（缩放后：{scaled['max_weight']:.3f}、{scaled['entropy']:.2f}；均匀分布为 "
            f"ln {N_KEYS} = {ln_keys:.2f}）",
        ),
        say(
            f"at d_k={widest} the gradient softmax passes back to the scores is {score_ratio:.3g}x "
            f"the scaled one's; the gradient that reaches q is {q_ratio:.3g}x the scaled one's "
            f"({'larger' if larger else 'smaller'}: ∂L/∂q = ∂L/∂scores · K, and without the "
            "division K enters at full size rather than / √d_k)",
            f"d_k={widest} 时，softmax 传回分数的梯度是缩放时的 {score_ratio:.3g} 倍；到达 q 的"
            f"梯度是缩放时的 {q_ratio:.3g} 倍（{'更大' if larger else '更小'}：∂L/∂q = "
            "∂L/∂scores · K，不做除法时 K 以原始大小进入，而不是除以 √d_k）",
        ),
        say(
            f"seed 002's exercise: the 猫/累/它 weights {printed_text} "
            f"become {blunt_text} without / √d and with K x10",
            f"教程 002 的练习：猫/累/它 的权重 {printed_text} 在不除以 √d、且 K 乘以 10 时变为 "
            f"{blunt_text}",
        ),
    ]
    figure = _plot(dims, stats)
    data = {"n_rows": n_rows, "n_keys": N_KEYS, "worked_example": printed, "blunt": blunt}
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(dims: list[int], stats: dict):
    fig, (left, right) = lab.new_figure(9.0, 3.4, ncols=2)
    for scaled, label in ((True, "QKᵀ / √d_k"), (False, "QKᵀ (no scaling)")):
        left.plot(dims, [stats[d, scaled]["entropy"] for d in dims], marker="o", label=label)
        right.plot(dims, [stats[d, scaled]["score_grad"] for d in dims], marker="o", label=label)
    left.axhline(math.log(N_KEYS), color="gray", linestyle=":", label=f"uniform, ln {N_KEYS}")
    left.set(
        xscale="log",
        xlabel="d_k",
        ylabel="entropy of a row (nats)",
        title="softmax stays soft only with / √d_k",
    )
    right.set(
        xscale="log",
        yscale="log",
        xlabel="d_k",
        ylabel="mean |∂L/∂scores| / √d_k",
        title="gradient back through softmax",
    )
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    return fig
