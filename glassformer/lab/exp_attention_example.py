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


@lab.register("attention-example")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    example = numpy_ref.worked_example()
    scaled = np.array(PROSE_SCORES) / np.sqrt(D_K)
    prose = numpy_ref.softmax(scaled)
    rows, checks = [], []
    for i, token in enumerate(TOKENS):
        rows.append(
            {
                "token": token,
                "numpy weight": round(float(example.weights[i]), 4),
                "printed": PRINTED_WEIGHTS[i],
                "prose score/√64": float(scaled[i]),
                "prose softmax": round(float(prose[i]), 4),
                "prose claims": PROSE_WEIGHTS[i],
            }
        )
        checks.append(lab.approx(f"numpy weight {token}", example.weights[i], PRINTED_WEIGHTS[i],
                                 PRINTED_TOL, group=NUMPY))  # fmt: skip
    for i, printed in enumerate(PRINTED_OUTPUT):
        checks.append(lab.approx(f"output[{i}]", example.output[i], printed, OUTPUT_TOL, NUMPY))
    for i, token in enumerate(TOKENS):
        # Arithmetic on the seed's own numbers: the setup reads them right, not evidence.
        scaled_check = lab.approx(f"prose scaled score {token}", scaled[i], PROSE_SCALED[i], 1e-12)
        checks.append(lab.precondition(scaled_check))
    for i, token in enumerate(TOKENS):
        checks.append(
            lab.approx(f"prose weight {token}", prose[i], PROSE_WEIGHTS[i], ROUGH_TOL, PROSE)
        )
    # The qualitative point of both: 猫 takes the largest share.
    checks.append(
        lab.at_least("猫's lead over the next weight (numpy)", _lead(example.weights), 0.0, LEAD)
    )
    checks.append(lab.at_least("猫's lead over the next weight (prose)", _lead(prose), 0.0, LEAD))

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
    why = (
        f"the numpy run reproduces the printed weights {np.round(example.weights, 3).tolist()}"
        f"{'' if numpy_ok else ' only in part'}, but softmax(1.0, 0.25, 0.375) is "
        f"{np.round(prose, 3).tolist()}, not the prose's 0.60/0.16/0.24 (those would need "
        f"dividing by about {implied['猫 vs 累']:.1f} and {implied['猫 vs 它']:.1f}, not 8); "
        "猫 still gets the most in both."
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
    lab.grouped_bars(ax, [f"「它」→「{t}」" for t in TOKENS], {
        "numpy run (ours)": numpy_weights,
        "printed ≈[0.503 0.237 0.260]": PRINTED_WEIGHTS,
        "softmax(8,2,3 / √64) (ours)": prose,
        "prose claims 0.60/0.16/0.24": PROSE_WEIGHTS,
    })  # fmt: skip
    ax.set_ylabel("attention weight")
    ax.set_title("seed 002: 它 attends to 猫 / 累 / 它")
    ax.legend(fontsize=7)
    return fig
