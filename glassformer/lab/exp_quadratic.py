"""Seed 002 and seed 000 §2.3: attention compares every token with every token, so its work and
the eager path's [T x T] score matrix grow as n²: ×10 length is ×100 attention FLOPs.

Counted with glassformer.calc (attention FLOPs of a whole sequence = per-token FLOPs x n: rows),
and measured, as the evidence: the time of one attention layer on the eager path (the six steps,
which build the [B, H, T, T] weights) and on torch's fused SDPA, for growing T; the bytes of
the weights tensor the eager path materializes are the setup's check.
"""

from __future__ import annotations

import time

import torch

from glassformer import calc
from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.nn.attention import AttentionMask, eager_attention, sdpa_attention

N_HEADS, HEAD_DIM = 8, 64
# Thresholds, stated once. Evidence: over x8 length the measured time of one attention call
# grows at least x16, on the eager path and on fused SDPA: twice what a linear cost would give,
# so a quadratic term must dominate the fixed overheads (x64 is pure n²). The counted FLOPs and
# the eager weights' bytes are n² by construction: rows and a precondition, not evidence.
MIN_TIME_GROWTH = 16.0
COMPUTE = "attention time grows as n²"


def attention_seconds(path: str, length: int, repeats: int, seed: int) -> tuple[float, int]:
    """(best seconds of one causal attention call, bytes of eager's weights or 0) at T=length."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, N_HEADS, length, HEAD_DIM, generator=generator) for _ in range(3))
    mask = AttentionMask(is_causal=True)
    scale = HEAD_DIM**-0.5
    weights_bytes = 0
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            if path == "eager":
                _, weights = eager_attention(q, k, v, mask, scale, return_weights=True)
                weights_bytes = weights.nbytes
            else:
                sdpa_attention(q, k, v, mask, scale)
            best = min(best, time.perf_counter() - start)
    return best, weights_bytes


@lab.register("quadratic")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    cfg = ModelConfig.preset("llama-7b")
    counted = {}
    for n in (1000, 10_000, 512, 8192):
        counted[n] = calc.flops_per_token(cfg, n)["attention"] * n  # a whole sequence
    lengths = ctx.pick([128, 256, 512, 1024, 2048], [128, 256, 512, 1024], [64, 128, 256, 512])
    repeats = ctx.pick(5, 3, 2)
    say = ctx.say
    rows, timings = [], {}
    for length in lengths:
        eager_s, weights_bytes = attention_seconds("eager", length, repeats, ctx.seed)
        sdpa_s, _ = attention_seconds("sdpa", length, repeats, ctx.seed)
        timings[length] = (eager_s, sdpa_s, weights_bytes)
        rows.append(
            {
                say("T", "T（token 数）"): length,
                say("eager ms", "eager 耗时 ms"): 1e3 * eager_s,
                say("sdpa ms", "sdpa 耗时 ms"): 1e3 * sdpa_s,
                say("eager weights MiB", "eager 权重 MiB"): weights_bytes / 2**20,
            }
        )
    short, long = lengths[0], lengths[-1]
    growth = long / short
    eager_growth = timings[long][0] / timings[short][0]
    sdpa_growth = timings[long][1] / timings[short][1]
    compute = say(COMPUTE, "注意力耗时按 n² 增长")
    checks = [
        # setup: the eager path materializes the [B, H, T, T] weights it is meant to
        lab.precondition(
            lab.approx(
                say(
                    f"eager weights bytes, T={long} / T={short} - (x{growth:g})²",
                    f"eager 权重矩阵字节数，T={long} / T={short} 减 (x{growth:g})²",
                ),
                timings[long][2] / timings[short][2] - growth**2,
                0,
                1e-9,
            )
        ),
        lab.at_least(
            say(
                f"eager time, T={long} / T={short} (x{growth:g} length)",
                f"eager 耗时，T={long} / T={short}（长度 x{growth:g}）",
            ),
            eager_growth,
            MIN_TIME_GROWTH,
            group=compute,
        ),
        lab.at_least(
            say(
                f"SDPA time, T={long} / T={short} (x{growth:g} length)",
                f"SDPA 耗时，T={long} / T={short}（长度 x{growth:g}）",
            ),
            sdpa_growth,
            MIN_TIME_GROWTH,
            group=compute,
        ),
    ]
    rows += [
        {
            "T": say(
                "calc: Llama-7B attention FLOPs, 1,000 → 10,000 tokens",
                "calc：Llama-7B 注意力 FLOPs，1,000 → 10,000 个 token",
            ),
            say("calc ratio", "calc 比值"): counted[10_000] / counted[1000],
        },
        {
            "T": say(
                "calc: Llama-7B attention FLOPs, 512 → 8192 tokens",
                "calc：Llama-7B 注意力 FLOPs，512 → 8192 个 token",
            ),
            "calc ratio": counted[8192] / counted[512],
        },
    ]
    square, weights_mib = growth**2, timings[long][2] / 2**20
    notes = [
        say(
            f"one causal attention call, {N_HEADS} heads x {HEAD_DIM}, best of {repeats}; over "
            f"x{growth:g} length the eager path's time grows x{eager_growth:.1f} and SDPA's "
            f"x{sdpa_growth:.1f} (linear: x{growth:g}, quadratic: x{square:g})",
            f"一次因果注意力调用，{N_HEADS} 个头 x {HEAD_DIM} 维，取 {repeats} 次中最快的一次；长度"
            f"增至 x{growth:g} 时，eager 路径的耗时增至 x{eager_growth:.1f}，SDPA 的增至 "
            f"x{sdpa_growth:.1f}（线性应为 x{growth:g}，平方应为 x{square:g}）",
        ),
        say(
            "the calc rows (the seed's x100 and x256) are the closed form: attention FLOPs per "
            "token grow with the context, so a whole sequence costs n²",
            "calc 两行（原文的 x100 与 x256）是闭式公式：每个 token 的注意力 FLOPs 随上下文增长，"
            "所以整条序列的代价是 n²",
        ),
        say(
            f"memory: the eager path keeps [H, T, T] weights ({weights_mib:.0f} MiB at "
            f"T={long}); torch's fused SDPA is built not to keep them (the kind of fix seed 002 "
            "names: Flash Attention); memory is not measured here beyond that tensor's size",
            f"内存：eager 路径保留 [H, T, T] 权重矩阵（T={long} 时 {weights_mib:.0f} MiB）；torch "
            "的融合 SDPA 就是为了不保留它而设计的（即教程 002 提到的那类解法：Flash Attention）；"
            "除这个张量的大小外，这里没有测量内存",
        ),
    ]
    figure = _plot(lengths, timings)
    data = {"attention_flops_llama7b": counted, "heads": N_HEADS, "head_dim": HEAD_DIM}
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(lengths: list[int], timings: dict):
    fig, (left, right) = lab.new_figure(9.0, 3.4, ncols=2)
    left.plot(lengths, [1e3 * timings[t][0] for t in lengths], marker="o", label="eager")
    left.plot(lengths, [1e3 * timings[t][1] for t in lengths], marker="o", label="SDPA")
    base = 1e3 * timings[lengths[0]][0]
    left.plot(
        lengths, [base * (t / lengths[0]) ** 2 for t in lengths], ":", color="gray", label="∝ T²"
    )
    left.set(
        xscale="log",
        yscale="log",
        xlabel="T (tokens)",
        ylabel="ms per attention call",
        title=f"one causal attention layer, {N_HEADS} heads x {HEAD_DIM}",
    )
    left.legend(fontsize=7)
    right.plot(lengths, [timings[t][2] / 2**20 for t in lengths], marker="o")
    right.set(
        xscale="log",
        yscale="log",
        xlabel="T (tokens)",
        ylabel="MiB",
        title="the [H, T, T] weights eager attention builds",
    )
    return fig
