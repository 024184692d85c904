"""Seed 002's worked attention example ("上手算一遍" and the 20-line numpy run): the printed
numpy weights for 猫/累/它, and the prose numbers for scores 8.0/2.0/3.0 scaled by √64.
"""

from __future__ import annotations

import numpy as np

from glassformer import numpy_ref
from glassformer.lab import base as lab

TOKENS = ("猫", "累", "它")
PRINTED_WEIGHTS = (0.503, 0.237, 0.260)  # the tutorial's print, 3 decimals
PRINTED_OUTPUT = (5.03, 2.37, 2.6, 0.0)  # 2 decimals
PROSE_SCORES = (8.0, 2.0, 3.0)  # "它" against 猫/累/它, before scaling
PROSE_SCALED = (1.0, 0.25, 0.375)  # "1.0 / 0.25 / 0.375"
PROSE_WEIGHTS = (0.60, 0.16, 0.24)  # "大致得到"
D_K = 64
# Thresholds: a printed number holds when it is our number rounded (half a unit of its last
# digit); "大致" (roughly) two-decimal weights get +-0.02.
PRINTED_TOL, OUTPUT_TOL, ROUGH_TOL = 0.0005, 0.005, 0.02

# The claim's three parts, for the verdict's why.
NUMPY = "the printed numpy run"
PROSE = "the prose's 0.60/0.16/0.24"
LEAD = "猫 gets the most"
GROUPS_ZH = {
    NUMPY: "教程打印的 numpy 运行结果",
    PROSE: "原文的 0.60/0.16/0.24",
    LEAD: "猫 得到的权重最大",
}


@lab.register("attention-example")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    for group, zh in GROUPS_ZH.items():
        ctx.say(group, zh)
    example = numpy_ref.worked_example()
    scaled = np.array(PROSE_SCORES) / np.sqrt(D_K)
    prose = numpy_ref.softmax(scaled)
    rows, checks = [], []
    for i, token in enumerate(TOKENS):
        rows.append(
            {
                ctx.say("token", "被关注的 token"): token,
                ctx.say("numpy weight", "numpy 权重"): round(float(example.weights[i]), 4),
                ctx.say("printed", "教程打印值"): PRINTED_WEIGHTS[i],
                ctx.say("prose score/√64", "原文分数/√64"): float(scaled[i]),
                ctx.say("prose softmax", "原文分数的 softmax"): round(float(prose[i]), 4),
                ctx.say("prose claims", "原文给出的值"): PROSE_WEIGHTS[i],
            }
        )
        what = ctx.say(f"numpy weight {token}", f"numpy 权重 {token}")
        checks.append(
            lab.approx(what, example.weights[i], PRINTED_WEIGHTS[i], PRINTED_TOL, group=NUMPY)
        )
    for i, printed in enumerate(PRINTED_OUTPUT):
        what = ctx.say(f"output[{i}]", f"输出[{i}]")
        checks.append(lab.approx(what, example.output[i], printed, OUTPUT_TOL, NUMPY))
    for i, token in enumerate(TOKENS):
        # Arithmetic on the seed's own numbers: the setup reads them right, not evidence.
        what = ctx.say(f"prose scaled score {token}", f"原文缩放后的分数 {token}")
        scaled_check = lab.approx(what, scaled[i], PROSE_SCALED[i], 1e-12)
        checks.append(lab.precondition(scaled_check))
    for i, token in enumerate(TOKENS):
        what = ctx.say(f"prose weight {token}", f"原文权重 {token}")
        checks.append(lab.approx(what, prose[i], PROSE_WEIGHTS[i], ROUGH_TOL, PROSE))
    # The qualitative point of both: 猫 takes the largest share.
    lead_numpy = ctx.say("猫's lead over the next weight (numpy)", "猫 领先次大权重的幅度（numpy）")
    lead_prose = ctx.say("猫's lead over the next weight (prose)", "猫 领先次大权重的幅度（原文）")
    checks.append(lab.at_least(lead_numpy, _lead(example.weights), 0.0, LEAD))
    checks.append(lab.at_least(lead_prose, _lead(prose), 0.0, LEAD))

    # Which divisor would the prose's 0.60/0.16/0.24 need? Each pair of weights implies one.
    implied = {
        "猫 vs 累": (PROSE_SCORES[0] - PROSE_SCORES[1])
        / np.log(PROSE_WEIGHTS[0] / PROSE_WEIGHTS[1]),
        "猫 vs 它": (PROSE_SCORES[0] - PROSE_SCORES[2])
        / np.log(PROSE_WEIGHTS[0] / PROSE_WEIGHTS[2]),
    }
    figure = _plot(example.weights, prose)
    numpy_ok = all(c.passed for c in checks if c.group == NUMPY)
    prose_ok = all(c.passed for c in checks if c.group == PROSE)
    printed, ours = np.round(example.weights, 3).tolist(), np.round(prose, 3).tolist()
    a, b = implied["猫 vs 累"], implied["猫 vs 它"]
    why = (
        ctx.say(
            f"the numpy run reproduces the printed weights {printed}"
            f"{'' if numpy_ok else ' only in part'}, but softmax(1.0, 0.25, 0.375) is "
            f"{ours}, not the prose's 0.60/0.16/0.24 (those would need "
            f"dividing by about {a:.1f} and {b:.1f}, not 8); 猫 still gets the most in both.",
            f"numpy 运行{'' if numpy_ok else '只部分'}复现了教程打印的权重 {printed}，但 "
            f"softmax(1.0, 0.25, 0.375) 是 {ours}，不是原文的 0.60/0.16/0.24（要得到那组数，"
            f"得分别除以约 {a:.1f} 和 {b:.1f}，而不是 8）；两种算法里 猫 的权重仍然最大。",
        )
        if not prose_ok
        else None
    )
    return lab.Result.from_checks(
        rows,
        checks,
        notes=[why] if why else [],
        figure=figure,
        data={
            "numpy_weights": example.weights.tolist(),
            "numpy_output": example.output.tolist(),
            "numpy_scores": example.scores.tolist(),
            "prose_softmax": prose.tolist(),
            "implied_divisor": {k: float(v) for k, v in implied.items()},
        },
    )


def _lead(weights: np.ndarray) -> float:
    rest = np.delete(weights, 0)
    return float(weights[0] - rest.max())


def _plot(numpy_weights: np.ndarray, prose: np.ndarray):
    fig, ax = lab.new_figure(6.4, 3.4)
    lab.grouped_bars(
        ax,
        [f"「它」→「{t}」" for t in TOKENS],
        {
            "numpy run (ours)": numpy_weights,
            "printed ≈[0.503 0.237 0.260]": PRINTED_WEIGHTS,
            "softmax(8,2,3 / √64) (ours)": prose,
            "prose claims 0.60/0.16/0.24": PROSE_WEIGHTS,
        },
    )
    ax.set_ylabel("attention weight")
    ax.set_title("seed 002: 它 attends to 猫 / 累 / 它")
    ax.legend(fontsize=7)
    return fig
