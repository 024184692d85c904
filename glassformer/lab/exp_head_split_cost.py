"""Seed 000 §4.1: 8 heads × 64 dims cost about what one 512-dim head costs. glassformer's
Attention at d_model = 512 with 8 heads of 64 and with 1 head of 512, at several lengths T:
FLOPs from torch.utils.flop_counter (on the eager path, whose matmuls it sees: QKV, QKᵀ, AV, W_O)
and the median CPU time of a forward, interleaved repeats, on the fused sdpa path and on the eager
one, which also scales, masks and softmaxes H x T x T scores one element at a time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.nn.attention import Attention, AttentionMask

D_MODEL = 512
SPLITS = {"8 heads x 64": 8, "1 head x 512": 1}
SPLITS_ZH = {"8 heads x 64": "8 头 x 64", "1 head x 512": "1 头 x 512"}
BACKENDS = ("sdpa", "eager")
# Thresholds: "几乎相同" (almost the same): FLOP ratio within 5% of 1; time ratio (8 heads /
# 1 head) within a quarter either way, [0.8, 1.25] (symmetric in log), well above the few percent
# by which medians of interleaved repeats move on this shared machine.
FLOP_TOL = 0.05
TIME_LOW, TIME_HIGH = 0.8, 1.25


def attention_layer(n_heads: int, backend: str, seed: int) -> Attention:
    cfg = ModelConfig(d_model=D_MODEL, n_heads=n_heads, attention_backend=backend, max_seq_len=4096)
    torch.manual_seed(seed)
    return Attention(cfg).eval()


def counted_flops(layer: Attention, x: torch.Tensor) -> int:
    """FLOPs torch's counter sees in one causal forward of `layer` on x (B, T, C)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        layer(x, AttentionMask(is_causal=True))
    return counter.get_total_flops()


def closed_form_flops(seq_len: int, d_model: int = D_MODEL) -> int:
    """2 x T x C x 4C for the Q, K, V and output projections + 2 x 2 x T² x C for QKᵀ and AV
    (the full square, as the matmuls compute it): no term depends on the number of heads."""
    return 2 * seq_len * d_model * 4 * d_model + 4 * seq_len**2 * d_model


def median_times(layers: dict[str, Attention], x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median CPU seconds per forward of each layer (process time: what the forward costs, not
    the time other processes on a shared machine take), the layers' runs interleaved so that a
    busy moment of the machine falls on all of them alike."""
    mask = AttentionMask(is_causal=True)
    times: dict[str, list[float]] = {name: [] for name in layers}
    with torch.no_grad():
        for layer in layers.values():
            layer(x, mask)  # warm-up: first-call allocation is not attention's cost
        for _ in range(repeats):
            for name, layer in layers.items():
                start = time.process_time()
                layer(x, mask)
                times[name].append(time.process_time() - start)
    return {name: statistics.median(t) for name, t in times.items()}


@lab.register("head-split-cost")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    lengths = ctx.pick((128, 512, 1024, 2048), (128, 256, 512), (16, 32))
    repeats = ctx.pick(15, 4, 2)
    say = ctx.say
    keys = {
        "T": "T（序列长度）",
        "attention": "注意力实现",
        "GFLOP (both)": "GFLOP（两者相同）",
        "ms 8 heads x 64": "毫秒，8 头 x 64",
        "ms 1 head x 512": "毫秒，1 头 x 512",
        "time ratio 8/1": "时间比 8/1",
        "score elements 8/1": "分数元素数 8/1",
    }
    for en, zh in keys.items():
        say(en, zh)
    rows, checks, timings, flop_ratios = [], [], {}, []
    generator = torch.Generator().manual_seed(ctx.seed)
    for seq_len in lengths:
        x = torch.randn(1, seq_len, D_MODEL, generator=generator)
        flops = {
            n: counted_flops(attention_layer(h, "eager", ctx.seed), x) for n, h in SPLITS.items()
        }
        # Precondition: the counter sees every matmul of the closed form, attention's included.
        for name, counted in flops.items():
            checks.append(
                lab.precondition(
                    lab.approx(
                        say(
                            f"T={seq_len}, {name}: counted FLOPs - closed form",
                            f"T={seq_len}，{SPLITS_ZH[name]}：计数所得 FLOPs - 闭式公式",
                        ),
                        counted - closed_form_flops(seq_len),
                        0,
                        0,
                    )
                )
            )
        flop_ratio = flops["8 heads x 64"] / flops["1 head x 512"]
        flop_ratios.append(flop_ratio)
        # The closed form has no H in it (H x T x T x d_k = T x T x d_model), so equal FLOPs are
        # arithmetic, a precondition; what could come out either way is the time they take.
        checks.append(
            lab.precondition(
                lab.approx(
                    say(
                        f"T={seq_len}: FLOPs 8x64 / 1x512", f"T={seq_len}：FLOPs 之比 8x64 / 1x512"
                    ),
                    flop_ratio,
                    1.0,
                    FLOP_TOL,
                )
            )
        )
        for backend in BACKENDS:
            layers = {n: attention_layer(h, backend, ctx.seed) for n, h in SPLITS.items()}
            t = median_times(layers, x, repeats)
            ratio = t["8 heads x 64"] / t["1 head x 512"]
            timings[(backend, seq_len)] = (t, ratio)
            rows.append(
                {
                    "T": seq_len,
                    "attention": backend,
                    "GFLOP (both)": flops["1 head x 512"] / 1e9,
                    "ms 8 heads x 64": 1000 * t["8 heads x 64"],
                    "ms 1 head x 512": 1000 * t["1 head x 512"],
                    "time ratio 8/1": ratio,
                    "score elements 8/1": f"{8 * seq_len**2:,} / {seq_len**2:,}",
                }
            )
            checks.append(
                lab.approx(
                    say(
                        f"T={seq_len}, {backend}: time 8x64 / 1x512",
                        f"T={seq_len}，{backend}：时间之比 8x64 / 1x512",
                    ),
                    ratio,
                    (TIME_LOW + TIME_HIGH) / 2,
                    (TIME_HIGH - TIME_LOW) / 2,
                    group=say(f"measured time, {backend}", f"实测时间，{backend}"),
                )
            )
    notes = _notes(timings, lengths, repeats, say)
    figure = _plot(timings, lengths, flop_ratios)
    data = {f"{b} T={t}": {"seconds": s, "ratio": r} for (b, t), (s, r) in timings.items()}
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _notes(timings: dict, lengths, repeats: int, say: Callable[[str, str], str]) -> list[str]:
    notes = [
        say(
            f"times: median CPU seconds of {repeats} interleaved forwards, batch 1, no grad",
            f"时间：{repeats} 次交错前向的 CPU 秒数中位数，batch 1，不计梯度",
        )
    ]
    for backend in BACKENDS:
        ratios = [timings[(backend, t)][1] for t in lengths]
        outside = [
            f"T={t} x{r:.2f}"
            for t, r in zip(lengths, ratios, strict=True)
            if not TIME_LOW <= r <= TIME_HIGH
        ]
        low, high, listed = min(ratios), max(ratios), ", ".join(outside)
        notes.append(
            say(
                f"{backend}: 8 heads / 1 head time ratio {low:.2f}-{high:.2f}"
                + (f"; outside [{TIME_LOW}, {TIME_HIGH}]: {listed}" if outside else ""),
                f"{backend}：8 头 / 1 头的时间比为 {low:.2f}-{high:.2f}"
                + (f"；超出 [{TIME_LOW}, {TIME_HIGH}] 的：{listed}" if outside else ""),
            )
        )
    notes.append(
        say(
            "the FLOP counter counts matmuls only; the eager path also scales, masks and softmaxes "
            "H x T² score elements one by one, 8 times as many with 8 heads",
            "FLOP 计数器只统计矩阵乘法；eager 路径还要对 H x T² 个分数元素逐个做缩放、掩码和 "
            "softmax，8 个头时元素数是 1 个头的 8 倍",
        )
    )
    return notes


def _plot(timings: dict, lengths, flop_ratios: list[float]):
    fig, (left, right) = lab.new_figure(9.0, 3.6, ncols=2)
    for backend, marker in zip(BACKENDS, "os", strict=True):
        for name, style in zip(SPLITS, ("-", "--"), strict=True):
            ms = [1000 * timings[(backend, t)][0][name] for t in lengths]
            left.plot(lengths, ms, marker + style, label=f"{backend}, {name}")
        right.plot(
            lengths, [timings[(backend, t)][1] for t in lengths], marker + "-", label=backend
        )
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(t) for t in lengths])
    left.set_yscale("log")
    left.set_xlabel("sequence length T (tokens)")
    left.set_ylabel("CPU ms per forward (median)")
    left.set_title("d_model=512 的注意力层", fontsize=9)
    left.legend(fontsize=7)
    right.axhspan(TIME_LOW, TIME_HIGH, color="0.85", zorder=0, label="almost the same")
    right.plot(lengths, flop_ratios, "k:", linewidth=1, label="FLOPs (counted)")
    right.set_xlabel("sequence length T (tokens)")
    right.set_ylabel("8 heads x 64 / 1 head x 512")
    right.set_title("8 头 × 64 vs 1 头 × 512", fontsize=9)
    right.legend(fontsize=7)
    return fig
