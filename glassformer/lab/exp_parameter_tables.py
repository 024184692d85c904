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


COMPONENTS_ZH = {
    "embedding": "嵌入",
    "attention": "注意力",
    "ffn": "前馈网络 FFN",
    "norms": "归一化",
}
ROW_NAMES_ZH = {
    "Attention W_Q/W_K/W_V/W_O": "注意力的 W_Q/W_K/W_V/W_O",
    "FFN W_gate/W_up/W_down (SwiGLU)": "FFN 的 W_gate/W_up/W_down（SwiGLU）",
    "RMSNorm gamma": "RMSNorm 的 gamma",
}
KEYS_ZH = {
    "model": "模型",
    "row": "行",
    "seed says": "原文写的",
    "seed count": "原文的数",
    "calc says": "calc 给出的",
    "calc count": "calc 的数",
    "calc / seed": "calc / 原文",
}


def _layer_row(rows: list[calc.Row], component: str) -> calc.Row:
    return next(r for r in rows if r.component == component and r.layers)


@lab.register("parameter-tables")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    for en, zh in KEYS_ZH.items():
        say(en, zh)
    say(ROWS, "表中逐层的各行")
    say(FFN_LARGEST, "FFN 是最大的部分")
    say(TOTALS, "总量（7B、14 GB、175B）")
    llama = ModelConfig.preset("llama-7b")
    rows_calc = calc.parameter_rows(llama)
    counts = calc.parameter_counts(llama)  # the model built on the meta device, counted
    # Setup: the closed-form rows describe the model that is built (else comparing them to the
    # seed would compare the seed with a formula, not with Llama).
    checks = [
        lab.precondition(
            lab.approx(
                say(
                    "Llama-7B closed-form rows - meta-device model count",
                    "Llama-7B 闭式公式各行之和 - meta 设备上所建模型的参数计数",
                ),
                sum(r.count for r in rows_calc) - counts["total"],
                0,
                0,
            )
        )
    ]
    embedding = next(r for r in rows_calc if r.component == "embedding")
    measured = {"embedding": (embedding.shape, embedding.count)}
    measured_zh = {"embedding": embedding.shape}
    for component in ("attention", "ffn", "norms"):
        row = _layer_row(rows_calc, component)
        measured[component] = (f"每层 {row.shape} ({row.name})", row.per_layer)
        measured_zh[component] = f"每层 {row.shape}（{ROW_NAMES_ZH.get(row.name, row.name)}）"
    table = []
    seed_sum = 0
    for component, (seed_shape, seed_count) in SEED_ROWS.items():
        shape, count = measured[component]
        seed_sum += seed_count * (1 if component == "embedding" else LAYERS)
        table.append(
            {
                "model": "Llama-7B",
                "row": say(component, COMPONENTS_ZH[component]),
                "seed says": seed_shape,
                "seed count": seed_count,
                "calc says": say(shape, measured_zh[component]),
                "calc count": count,
                "calc / seed": count / seed_count,
            }
        )
        tol = EMBED_TOL if component == "embedding" else 0
        target = 1.3e8 if component == "embedding" else seed_count
        per = component != "embedding"
        what = say(
            f"Llama-7B {component}" + (" per layer" if per else ""),
            f"Llama-7B {COMPONENTS_ZH[component]}" + ("（每层）" if per else ""),
        )
        checks.append(lab.approx(what, count, target, tol, group=ROWS))
    components = counts["components"]
    largest_other = max(n for c, n in components.items() if c != "ffn")
    ffn_share = components["ffn"] / largest_other
    checks.append(
        lab.at_least(
            say(
                "Llama-7B FFN / the largest other component", "Llama-7B FFN / 其余组成部分中最大的"
            ),
            ffn_share,
            1.0,
            FFN_LARGEST,
        )
    )
    lm_head = next(r for r in rows_calc if r.component == "lm_head").count
    table_b, with_head_b = seed_sum / 1e9, (seed_sum + lm_head) / 1e9
    table.append(
        {
            "model": "Llama-7B",
            "row": say("total", "总计"),
            "seed says": say(
                f"7B (its rows sum to {table_b:.2f}B, "
                f"{with_head_b:.2f}B with the untied output head "
                "it does not list)",
                f"7B（表中各行合计 {table_b:.2f}B，加上它没有列出的、不与嵌入"
                f"共享的输出头则为 {with_head_b:.2f}B）",
            ),
            "seed count": 7e9,
            "calc says": say(
                "parameter_counts (meta-device model)",
                "parameter_counts（在 meta 设备上构建的模型）",
            ),
            "calc count": counts["total"],
            "calc / seed": counts["total"] / 7e9,
        }
    )
    checks.append(
        lab.approx(
            say("Llama-7B total vs '7B'", "Llama-7B 总参数量 vs “7B”"),
            counts["total"],
            7e9,
            TOTAL_7B_TOL,
            group=TOTALS,
        )
    )
    fp16_gb = counts["total"] * calc.DTYPE_BYTES["fp16"] / 1e9
    checks.append(
        lab.approx(
            say("Llama-7B fp16 weights (GB)", "Llama-7B 的 fp16 权重（GB）"),
            fp16_gb,
            14.0,
            FP16_GB_TOL,
            group=TOTALS,
        )
    )
    table.append(
        {
            "model": "Llama-7B",
            "row": say("fp16 bytes", "fp16 字节数"),
            "seed says": "约 14GB",
            "seed count": 14e9,
            "calc count": fp16_gb * 1e9,
            "calc / seed": fp16_gb / 14,
        }
    )

    gpt3 = ModelConfig.preset("gpt3-175b")
    gpt3_total = calc.parameter_counts(gpt3)["total"]
    g_layers, g_heads, g_d, g_ff = gpt3.n_layers, gpt3.n_heads, gpt3.d_model, gpt3.d_ff
    table.append(
        {
            "model": "GPT-3",
            "row": "total",
            "seed says": "175B = 96 层 × 96 头 × 12288 维",
            "seed count": 175e9,
            "calc says": say(
                f"{g_layers} layers x {g_heads} heads x d_model {g_d}",
                f"{g_layers} 层 x {g_heads} 头 x d_model {g_d}",
            ),
            "calc count": gpt3_total,
            "calc / seed": gpt3_total / 175e9,
        }
    )
    checks.append(
        lab.approx(
            say("GPT-3 total / 175B", "GPT-3 总参数量 / 175B"),
            gpt3_total / 175e9,
            1.0,
            GPT3_REL_TOL,
            group=TOTALS,
        )
    )
    per_layer = {r["row"]: r for r in table if r["row"] in SEED_ROWS}
    parts, parts_zh = [], []
    for c in ("attention", "ffn", "norms"):
        r = per_layer[c]
        says, n, ratio, seed_n = r["calc says"], r["calc count"], r["calc / seed"], r["seed count"]
        parts.append(f"{c} {says} = {n:,} ({ratio:.2f}x the table's {seed_n:,})")
        parts_zh.append(
            f"{COMPONENTS_ZH[c]}：{measured_zh[c]} = {n:,}（是表中 {seed_n:,} 的 {ratio:.2f} 倍）"
        )
    total_b, ffn_of_total = counts["total"] / 1e9, components["ffn"] / counts["total"]
    total_gpt3_b = gpt3_total / 1e9
    notes = [
        say(
            "the real Llama-7B per layer: " + "; ".join(parts),
            "真实的 Llama-7B 每层：" + "；".join(parts_zh),
        ),
        say(
            f"the table as written sums to {table_b:.2f}B ({with_head_b:.2f}B "
            f"with the output head); the model has {total_b:.3f}B, "
            f"{fp16_gb:.2f} GB in fp16; the FFN is {ffn_of_total:.0%} of it",
            f"表中所写各行合计 {table_b:.2f}B（加上输出头为 {with_head_b:.2f}B）；模型实际有 "
            f"{total_b:.3f}B，fp16 下占 {fp16_gb:.2f} GB；FFN 占其中的 {ffn_of_total:.0%}",
        ),
        say(
            f"GPT-3 preset ({g_layers} layers, {g_heads} heads, d_model {g_d}, "
            f"d_ff {g_ff}): {total_gpt3_b:.1f}B parameters",
            f"GPT-3 预设（{g_layers} 层，{g_heads} 个头，d_model {g_d}，d_ff {g_ff}）："
            f"{total_gpt3_b:.1f}B 个参数",
        ),
    ]
    figure = _plot([per_layer[c] for c in SEED_ROWS])
    data = {"llama7b_components": components, "seed_rows_sum": seed_sum, "gpt3_total": gpt3_total}
    return lab.Result.from_checks(table, checks, figure=figure, data=data, notes=notes)


def _plot(rows: list[dict]):
    fig, ax = lab.new_figure(6.4, 3.4)
    components = ["embedding", "attention\n(per layer)", "FFN\n(per layer)", "norms\n(per layer)"]
    lab.grouped_bars(
        ax,
        components,
        {
            "seed 000 §2.1 table": [r["seed count"] / 1e6 for r in rows],
            "glassformer.calc (llama-7b)": [r["calc count"] / 1e6 for r in rows],
        },
    )
    ax.set_yscale("log")
    ax.set_ylabel("parameters (millions, log)")
    ax.set_title("Llama-7B 参数表：教程 vs 计算")
    ax.legend(fontsize=8)
    return fig
