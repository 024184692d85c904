"""Seed 002 and seed 000 §2.3: attention compares every token with every token, so its work and
the eager path's [T x T] score matrix grow as n²: ×10 length is ×100 attention FLOPs.

Counted with glassformer.calc (attention FLOPs of a whole sequence = per-token FLOPs x n), and
measured: the time of one attention layer on the eager path (the six steps, which build the
[B, H, T, T] weights) and on torch's fused SDPA, and the bytes of the weights tensor the eager
path materializes, for growing T.
"""

from __future__ import annotations

import time

import torch

from glassformer import calc
from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.nn.attention import AttentionMask, eager_attention, sdpa_attention

N_HEADS, HEAD_DIM = 8, 64
# Thresholds: counted FLOPs and the eager weights' bytes are exact n² (ratio 100 for ×10, 64 for
# ×8, to rounding); measured eager time over ×8 length grows at least ×16 (a quadratic cost
# under fixed overheads and caches; linear would be ×8).
MIN_TIME_GROWTH = 16.0


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
    rows, timings = [], {}
    for length in lengths:
        eager_s, weights_bytes = attention_seconds("eager", length, repeats, ctx.seed)
        sdpa_s, _ = attention_seconds("sdpa", length, repeats, ctx.seed)
        timings[length] = (eager_s, sdpa_s, weights_bytes)
        rows.append({"T": length, "eager ms": 1e3 * eager_s, "sdpa ms": 1e3 * sdpa_s,
                     "eager weights MiB": weights_bytes / 2**20})  # fmt: skip
    short, long = lengths[0], lengths[-1]
    growth = long / short
    checks = [
        lab.approx("Llama-7B attention FLOPs, 10,000 vs 1,000 tokens (calc)",
                   counted[10_000] / counted[1000], 100.0, 1e-9),
        lab.approx("Llama-7B attention FLOPs, 8192 vs 512 tokens (calc)",
                   counted[8192] / counted[512], 256.0, 1e-9),
        lab.approx(f"eager weights bytes, T={long} vs T={short}",
                   timings[long][2] / timings[short][2], growth**2, 1e-9),
        lab.at_least(f"eager time, T={long} vs T={short} (x{growth:g} length)",
                     timings[long][0] / timings[short][0], MIN_TIME_GROWTH),
    ]  # fmt: skip
    rows.append({"T": "calc: Llama-7B, 1,000 → 10,000 tokens",
                 "eager ms": counted[10_000] / counted[1000]})  # fmt: skip
    figure = _plot(lengths, timings)
    data = {"attention_flops_llama7b": counted, "heads": N_HEADS, "head_dim": HEAD_DIM}
    return lab.Result.from_checks(rows, checks, figure=figure, data=data)


def _plot(lengths: list[int], timings: dict):
    fig, (left, right) = lab.new_figure(9.0, 3.4, ncols=2)
    left.plot(lengths, [1e3 * timings[t][0] for t in lengths], marker="o", label="eager")
    left.plot(lengths, [1e3 * timings[t][1] for t in lengths], marker="o", label="SDPA")
    base = 1e3 * timings[lengths[0]][0]
    left.plot(lengths, [base * (t / lengths[0]) ** 2 for t in lengths], ":", color="gray",
              label="∝ T²")  # fmt: skip
    left.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="ms per attention call",
             title=f"one causal attention layer, {N_HEADS} heads x {HEAD_DIM}")  # fmt: skip
    left.legend(fontsize=7)
    right.plot(lengths, [timings[t][2] / 2**20 for t in lengths], marker="o")
    right.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="MiB",
              title="the [H, T, T] weights eager attention builds")  # fmt: skip
    return fig
