"""Seed 000 §4.3: PE(i+k) is a linear function of PE(i), and RoPE scores decay with distance.

Sinusoidal: fit M_k by least squares from PE(pos) to PE(pos+k) (glassformer's table) on random
positions, test it on other positions, and compare it with the closed form, the 2x2 rotation by
k·ω on each (sin, cos) pair; a random table of the same size is the control a fit cannot
predict. RoPE: q·k after glassformer's rotation as a function of the distance, for all-ones q
and k (RoFormer's decay figure) and for independent random q and k (mean |score| over pairs).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.nn.position import RotaryEmbedding, apply_rope, sinusoidal_table

D = 64  # d_model of the sinusoidal table and head_dim of RoPE
BASE = 10000.0
# Positions: the slowest sin/cos pair turns once in 2π·BASE^((D-2)/D) ≈ 47,000 positions; fitting
# on a shorter span leaves its map undetermined (the short-window row shows it), so fit and test
# positions are drawn from a span past one slowest turn.
SPAN = 65536
SHORT_WINDOW = 256  # the too-short fit, shown as a row
# Thresholds: the table is float32 (relative rounding 6e-8), so a map that holds leaves a held-out
# residual near 1e-7; 1e-5 leaves a margin of 100, while the random control stays near 1. The
# fitted M_k is the rotation when it is within 1e-4 of it (relative Frobenius norm).
RESIDUAL_MAX = 1e-5
ROTATION_MAX = 1e-4
CONTROL_MIN = 0.5  # the control's residual: the fit is able to fail
# RoPE: distance bins (log-spaced); "decays" = no bin's mean above the previous one, and the
# farthest bin's mean at most half the distance-0 value.
BINS = ((0, 1), (1, 4), (4, 16), (16, 64), (64, 256), (256, 1024), (1024, 4096))
DECAY_MAX = 0.5
RELATIVE_TOL = 1e-3  # score(Δ + s, s) vs score(Δ, 0), as a fraction of score(0)
CURVES_ZH = {
    "all-ones q, k": "全 1 的 q、k",
    "independent random q, k (mean |score|)": "相互独立的随机 q、k（平均 |打分|）",
    "random q = k (mean score)": "随机 q = k（平均打分）",
}
GROUPS_ZH = {
    "PE(i+k) linear in PE(i)": "PE(i+k) 是 PE(i) 的线性函数",
    "RoPE decay, all-ones q, k": "RoPE 衰减，全 1 的 q、k",
    "RoPE decay, independent random q, k": "RoPE 衰减，相互独立的随机 q、k",
}


def rotation(k: int, d: int = D, base: float = BASE) -> Tensor:
    """The closed-form M_k with PE(pos + k) = PE(pos) @ M_k (row vectors): on the pair
    (sin pω, cos pω), sin((p+k)ω) = sin·cos kω + cos·sin kω, cos((p+k)ω) = cos·cos kω - sin·sin kω.
    """
    m = torch.zeros(d, d, dtype=torch.float64)
    for i in range(0, d, 2):
        c, s = math.cos(k * base ** (-i / d)), math.sin(k * base ** (-i / d))
        m[i, i], m[i, i + 1], m[i + 1, i], m[i + 1, i + 1] = c, -s, s, c
    return m


def fit_shift_map(table: Tensor, k: int, fit: Tensor, test: Tensor) -> tuple[Tensor, float, float]:
    """(M_k, held-out relative residual, condition number of the fit's inputs): least squares
    from table[fit] to table[fit + k], judged on table[test] -> table[test + k]."""
    x, y = table[fit].double(), table[fit + k].double()  # (n, D)
    m = torch.linalg.lstsq(x, y).solution  # (D, D)
    target = table[test + k].double()
    residual = float((table[test].double() @ m - target).norm() / target.norm())
    return m, residual, float(torch.linalg.cond(x))


def rope_scores(q: Tensor, k: Tensor, distances: Tensor, start: int = 0) -> Tensor:
    """q·k after RoPE with the query at position start + Δ and the key at `start`:
    q, k (P, D), distances (L,) -> (P, L) scores (unscaled)."""
    cfg = ModelConfig(
        d_model=D,
        n_heads=1,
        position="rope",
        rope_theta=BASE,
        max_seq_len=int(distances.max()) + start + 1,
    )
    rope = RotaryEmbedding(cfg)
    cos_q, sin_q = rope((distances + start)[None])  # (1, 1, L, D)
    cos_k, sin_k = rope(torch.tensor([[start]]))  # (1, 1, 1, D)
    q_rot = apply_rope(q[:, None, None, :].expand(-1, 1, len(distances), -1), cos_q, sin_q)
    k_rot = apply_rope(k[:, None, None, :], cos_k, sin_k)  # (P, 1, 1, D)
    return (q_rot * k_rot).sum(-1)[:, 0]  # (P, L)


def bin_means(values: Tensor, distances: Tensor, bins=BINS) -> list[float]:
    """Mean of values (P, L) over the pairs and the distances (L,) in each bin [a, b)."""
    return [float(values[:, (distances >= a) & (distances < b)].mean()) for a, b in bins]


def decay_numbers(means: list[float]) -> tuple[int, float]:
    """(bins whose mean rises above the previous bin's, farthest bin / nearest bin)."""
    rises = sum(b > a for a, b in itertools.pairwise(means))
    return rises, means[-1] / means[0]


@lab.register("position-geometry")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    for group, group_zh in GROUPS_ZH.items():
        say(group, group_zh)
    part = say("part", "部分")
    rows, checks, notes = [], [], []
    shifts = ctx.pick((1, 10, 100, 1000), (1, 10, 100, 1000), (1, 100))
    n_fit = ctx.pick(2048, 1024, 256)
    table = sinusoidal_table(SPAN + max(shifts), D)  # (positions, D) float32, the model's table
    generator = torch.Generator().manual_seed(ctx.seed)
    order = torch.randperm(SPAN, generator=generator)
    fit, test = order[:n_fit], order[n_fit : 2 * n_fit]  # disjoint positions
    control = torch.randn(table.shape, generator=generator, dtype=torch.float64)
    short_fit = torch.arange(SHORT_WINDOW)
    short_test = torch.arange(SHORT_WINDOW, 2 * SHORT_WINDOW)
    for k in shifts:
        m, residual, cond = fit_shift_map(table, k, fit, test)
        off = float((m - rotation(k)).norm() / rotation(k).norm())
        _, control_residual, _ = fit_shift_map(control, k, fit, test)
        _, short_residual, short_cond = fit_shift_map(table, k, short_fit, short_test)
        last = SHORT_WINDOW - 1
        rows.append(
            {
                part: say(f"sinusoidal, k={k}", f"正弦位置编码，k={k}"),
                say("held-out residual", "留出残差"): residual,
                say("|M_k - rotation|/|rotation|", "|M_k - 旋转|/|旋转|"): off,
                say("condition", "条件数"): cond,
                say("random table residual", "随机表残差"): control_residual,
                say(f"fit on 0..{last}: residual", f"在 0..{last} 上拟合：残差"): short_residual,
            }
        )
        checks.append(
            lab.precondition(
                lab.at_least(
                    say(
                        f"k={k}: random-table control's held-out residual",
                        f"k={k}：随机表对照的留出残差",
                    ),
                    control_residual,
                    CONTROL_MIN,
                )
            )
        )
        checks.append(
            lab.at_most(
                say(
                    f"k={k}: held-out residual of the fitted M_k", f"k={k}：拟合出的 M_k 的留出残差"
                ),
                residual,
                RESIDUAL_MAX,
                group="PE(i+k) linear in PE(i)",
            )
        )
        checks.append(
            lab.at_most(
                say(
                    f"k={k}: |M_k - block rotation| / |rotation|",
                    f"k={k}：|M_k - 分块旋转| / |旋转|",
                ),
                off,
                ROTATION_MAX,
                group="PE(i+k) linear in PE(i)",
            )
        )
    short = [r[f"fit on 0..{SHORT_WINDOW - 1}: residual"] for r in rows]
    if max(short) > RESIDUAL_MAX:
        last, end = SHORT_WINDOW - 1, 2 * SHORT_WINDOW - 1
        low, high = min(short), max(short)
        notes.append(
            say(
                f"fitted on positions 0..{last} only, the slow pairs barely turn "
                f"(condition {short_cond:.2g}) and M_k misses positions {SHORT_WINDOW}.."
                f"{end} by {low:.2g}-{high:.2g}: a short window does "
                "not pin the map down; positions spread over one slowest turn do",
                f"只在位置 0..{last} 上拟合时，慢速的那几对几乎不转（条件数 {short_cond:.2g}），"
                f"M_k 在位置 {SHORT_WINDOW}..{end} 上偏差 "
                f"{low:.2g}-{high:.2g}：短窗口定不住这个映射；"
                "位置分布跨过最慢一对的一整圈才定得住",
            )
        )

    far = ctx.pick(4096, 4096, 1024)
    bins = [b for b in BINS if b[1] <= far]
    all_distances = torch.arange(far)
    ones = torch.ones(1, D)
    ones_scores = rope_scores(ones, ones, all_distances)  # (1, far)
    shifted = rope_scores(ones, ones, all_distances, start=1000)
    drift = float((shifted - ones_scores).abs().max() / ones_scores[0, 0])
    checks.append(
        lab.precondition(
            lab.at_most(
                say(
                    "RoPE score depends on the distance only: |s(Δ+1000, 1000) - s(Δ, 0)| / s(0)",
                    "RoPE 打分只取决于距离：|s(Δ+1000, 1000) - s(Δ, 0)| / s(0)",
                ),
                drift,
                RELATIVE_TOL,
            )
        )
    )
    n_pairs = ctx.pick(1024, 512, 64)
    q = torch.randn(n_pairs, D, generator=generator)
    k_vecs = torch.randn(n_pairs, D, generator=generator)
    sampled = torch.unique(torch.logspace(0, math.log2(far), 80, base=2).long() - 1)
    random_abs = rope_scores(q, k_vecs, sampled).abs()
    same_vector = rope_scores(q, q, sampled)  # q = k: the same content at both ends
    curves = {
        "all-ones q, k": bin_means(ones_scores, all_distances, bins),
        "independent random q, k (mean |score|)": bin_means(random_abs, sampled, bins),
        "random q = k (mean score)": bin_means(same_vector, sampled, bins),
    }
    for name, means in curves.items():
        rises, ratio = decay_numbers(means)
        rows.append(
            {
                part: say(f"RoPE, {name}", f"RoPE，{CURVES_ZH[name]}"),
                say("bin means", "各区间均值"): [round(v, 2) for v in means],
                say("rising bins", "上升的区间数"): rises,
                say("farthest / nearest", "最远 / 最近"): ratio,
            }
        )
    for name, group in (
        ("all-ones q, k", "RoPE decay, all-ones q, k"),
        ("independent random q, k (mean |score|)", "RoPE decay, independent random q, k"),
    ):
        rises, ratio = decay_numbers(curves[name])
        checks.append(
            lab.at_most(
                say(f"{name}: bins whose mean rises", f"{CURVES_ZH[name]}：均值上升的区间数"),
                rises,
                0,
                group=group,
            )
        )
        checks.append(
            lab.at_most(
                say(f"{name}: farthest bin / distance 0", f"{CURVES_ZH[name]}：最远区间 / 距离 0"),
                ratio,
                DECAY_MAX,
                group=group,
            )
        )
    for name, means in curves.items():
        rises, ratio = decay_numbers(means)
        decays = rises == 0 and ratio <= DECAY_MAX
        verb = "decays" if decays else "does not decay"
        verb_zh = "衰减" if decays else "不衰减"
        nearest, farthest = means[0], means[-1]
        notes.append(
            say(
                f"RoPE, {name}: {verb} (distance-0 mean {nearest:.3g}, farthest bin "
                f"{farthest:.3g}, {rises} rising bins)",
                f"RoPE，{CURVES_ZH[name]}：{verb_zh}（距离 0 的均值 {nearest:.3g}，"
                f"最远区间 {farthest:.3g}，{rises} 个区间上升）",
            )
        )
    figure = _plot(rows, shifts, curves, bins, ones_scores[0])
    data = {"bins": bins, "curves": curves, "shifts": list(shifts), "n_fit": n_fit}
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(rows, shifts, curves, bins, ones_curve: Tensor):
    fig, (left, right) = lab.new_figure(9.0, 3.6, ncols=2)
    sin_rows = rows[: len(shifts)]
    labels = [f"k={k}" for k in shifts]
    series = {
        "fit on random positions": [r["held-out residual"] for r in sin_rows],
        f"fit on 0..{SHORT_WINDOW - 1}": [
            r[f"fit on 0..{SHORT_WINDOW - 1}: residual"] for r in sin_rows
        ],
        "random table (control)": [r["random table residual"] for r in sin_rows],
    }
    lab.grouped_bars(left, labels, series)
    left.set_yscale("log")
    left.axhline(RESIDUAL_MAX, color="k", linestyle=":", linewidth=1, label="threshold")
    left.set_ylim(1e-9, 1e5)  # room above the bars for the legend
    left.set_xlabel("shift k (positions)")
    left.set_ylabel("held-out relative residual")
    left.set_title("PE(pos+k) ≈ PE(pos)·M_k（最小二乘）", fontsize=9)
    left.legend(fontsize=7, ncol=2, loc="upper center")
    distances = torch.arange(1, len(ones_curve))
    right.plot(
        distances,
        ones_curve[1:] / ones_curve[0],
        linewidth=0.6,
        alpha=0.4,
        color="tab:blue",
        label="all-ones, every Δ",
    )
    centers = [math.sqrt(max(a, 0.5) * b) for a, b in bins]
    for (name, means), marker in zip(curves.items(), "os^", strict=True):
        right.plot(centers, [m / means[0] for m in means], marker + "-", label=name)
    right.set_xscale("log")
    right.set_xlabel("distance Δ between query and key (tokens, log scale)")
    right.set_ylabel("score / score at Δ=0 (bin means)")
    right.set_title("RoPE：打分随距离", fontsize=9)
    right.legend(fontsize=7)
    return fig
