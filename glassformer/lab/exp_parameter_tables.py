"""Seed 000 §2.1's Llama-7B parameter table, row by row, and seed 002's "GPT-3 (175B) = 96 层 ×
96 头 × 12288 维": the seed's numbers against the real architectures (the llama-7b and gpt3-175b
presets), counted by glassformer.calc in closed form and from a model built on the meta device.
"""

from __future__ import annotations

from glassformer import calc
from glassformer.config import ModelConfig
from glassformer.lab import base as lab

# The seed's table, as written (per layer where it says 每层; the model has 32 layers).
D, D_FF, V, LAYERS = 4096, 11008, 32000, 32
SEED_ROWS = {
    "embedding": ("[32000 × 4096] ≈ 1.3 亿", V * D),
    "attention": ("每层 4 个 [4096×4096]", 4 * D * D),
    "ffn": ("每层 [11008×4096] × 2", 2 * D_FF * D),
    # "2 个 4096 维向量" is 2 x 4096 numbers. (Llama's two RMSNorms per layer have a γ each and
    # no β: 8,192 either way; reading it as two norms of γ and β each would double it.)
    "norms": ("每层 2 个 4096 维向量 (γ/β)", 2 * D),
}
# Thresholds, stated once: "≈ 1.3 亿" within 0.05 亿 (its rounding); the per-layer shapes are
# exact counts, so exact; "7B" is a rounded headline (± 0.5B), "175B" too (± 2%); "fp16 存约
# 14GB" within 1 GB. "参数量大头": the FFN holds more parameters than any other component.
EMBED_TOL, TOTAL_7B_TOL, GPT3_REL_TOL, FP16_GB_TOL = 5e6, 0.5e9, 0.02, 1.0
ROWS = "the table's per-layer rows"
FFN_LARGEST = "FFN is the largest part"
TOTALS = "the totals (7B, 14 GB, 175B)"


def _layer_row(rows: list[calc.Row], component: str) -> calc.Row:
    return next(r for r in rows if r.component == component and r.layers)


@lab.register("parameter-tables")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    llama = ModelConfig.preset("llama-7b")
    rows_calc = calc.parameter_rows(llama)
    counts = calc.parameter_counts(llama)  # the model built on the meta device, counted
    # Setup: the closed-form rows describe the model that is built (else comparing them to the
    # seed would compare the seed with a formula, not with Llama).
    checks = [lab.precondition(lab.approx("Llama-7B closed-form rows - meta-device model count",
                                          sum(r.count for r in rows_calc) - counts["total"],
                                          0, 0))]  # fmt: skip
    embedding = next(r for r in rows_calc if r.component == "embedding")
    measured = {"embedding": (embedding.shape, embedding.count)}
    for component in ("attention", "ffn", "norms"):
        row = _layer_row(rows_calc, component)
        measured[component] = (f"每层 {row.shape} ({row.name})", row.per_layer)
    table = []
    seed_sum = 0
    for component, (seed_shape, seed_count) in SEED_ROWS.items():
        shape, count = measured[component]
        seed_sum += seed_count * (1 if component == "embedding" else LAYERS)
        table.append({"model": "Llama-7B", "row": component, "seed says": seed_shape,
                      "seed count": seed_count, "calc says": shape, "calc count": count,
                      "calc / seed": count / seed_count})  # fmt: skip
        tol = EMBED_TOL if component == "embedding" else 0
        target = 1.3e8 if component == "embedding" else seed_count
        what = f"Llama-7B {component}" + ("" if component == "embedding" else " per layer")
        checks.append(lab.approx(what, count, target, tol, group=ROWS))
    components = counts["components"]
    largest_other = max(n for c, n in components.items() if c != "ffn")
    ffn_share = components["ffn"] / largest_other
    checks.append(
        lab.at_least("Llama-7B FFN / the largest other component", ffn_share, 1.0, FFN_LARGEST)
    )
    lm_head = next(r for r in rows_calc if r.component == "lm_head").count
    table.append({"model": "Llama-7B", "row": "total",
                  "seed says": f"7B (its rows sum to {seed_sum / 1e9:.2f}B, "
                               f"{(seed_sum + lm_head) / 1e9:.2f}B with the untied output head "
                               "it does not list)",
                  "seed count": 7e9, "calc says": "parameter_counts (meta-device model)",
                  "calc count": counts["total"], "calc / seed": counts["total"] / 7e9})  # fmt: skip
    checks.append(
        lab.approx("Llama-7B total vs '7B'", counts["total"], 7e9, TOTAL_7B_TOL, group=TOTALS)
    )
    fp16_gb = counts["total"] * calc.DTYPE_BYTES["fp16"] / 1e9
    checks.append(
        lab.approx("Llama-7B fp16 weights (GB)", fp16_gb, 14.0, FP16_GB_TOL, group=TOTALS)
    )
    table.append({"model": "Llama-7B", "row": "fp16 bytes", "seed says": "约 14GB",
                  "seed count": 14e9, "calc count": fp16_gb * 1e9,
                  "calc / seed": fp16_gb / 14})  # fmt: skip

    gpt3 = ModelConfig.preset("gpt3-175b")
    gpt3_total = calc.parameter_counts(gpt3)["total"]
    table.append({"model": "GPT-3", "row": "total", "seed says": "175B = 96 层 × 96 头 × 12288 维",
                  "seed count": 175e9,
                  "calc says": f"{gpt3.n_layers} layers x {gpt3.n_heads} heads x d_model "
                               f"{gpt3.d_model}",
                  "calc count": gpt3_total, "calc / seed": gpt3_total / 175e9})  # fmt: skip
    checks.append(lab.approx("GPT-3 total / 175B", gpt3_total / 175e9, 1.0, GPT3_REL_TOL,
                             group=TOTALS))  # fmt: skip
    per_layer = {r["row"]: r for r in table if r["row"] in SEED_ROWS}
    notes = [
        "the real Llama-7B per layer: "
        + "; ".join(f"{c} {r['calc says']} = {r['calc count']:,} ({r['calc / seed']:.2f}x the "
                    f"table's {r['seed count']:,})"
                    for c, r in ((c, per_layer[c]) for c in ("attention", "ffn", "norms"))),
        f"the table as written sums to {seed_sum / 1e9:.2f}B ({(seed_sum + lm_head) / 1e9:.2f}B "
        f"with the output head); the model has {counts['total'] / 1e9:.3f}B, "
        f"{fp16_gb:.2f} GB in fp16; the FFN is {components['ffn'] / counts['total']:.0%} of it",
        f"GPT-3 preset ({gpt3.n_layers} layers, {gpt3.n_heads} heads, d_model {gpt3.d_model}, "
        f"d_ff {gpt3.d_ff}): {gpt3_total / 1e9:.1f}B parameters",
    ]  # fmt: skip
    figure = _plot([per_layer[c] for c in SEED_ROWS])
    data = {"llama7b_components": components, "seed_rows_sum": seed_sum, "gpt3_total": gpt3_total}
    return lab.Result.from_checks(table, checks, figure=figure, data=data, notes=notes)


def _plot(rows: list[dict]):
    fig, ax = lab.new_figure(6.4, 3.4)
    components = ["embedding", "attention\n(per layer)", "FFN\n(per layer)", "norms\n(per layer)"]
    lab.grouped_bars(ax, components, {
        "seed 000 §2.1 table": [r["seed count"] / 1e6 for r in rows],
        "glassformer.calc (llama-7b)": [r["calc count"] / 1e6 for r in rows],
    })  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylabel("parameters (millions, log)")
    ax.set_title("Llama-7B 参数表：教程 vs 计算")
    ax.legend(fontsize=8)
    return fig
