"""Seed 000 §5.3: RMSNorm drops LayerNorm's mean-centering, "one statistic fewer", so it should
cost less. Timed at a GPT-2 training batch's shape and at Llama-7B's width, forward and
forward + backward, three ways: glassformer's RMSNorm and LayerNorm modules (what the models
run), torch's F.rms_norm and F.layer_norm, and the two formulas written out tensor op by tensor
op. Times are median CPU seconds of interleaved repeats, in rounds whose spread the difference
must exceed; the aten ops each forward dispatches are counted with a TorchDispatchMode.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from glassformer.lab import base as lab
from glassformer.nn.norm import LayerNorm, RMSNorm

EPS = 1e-5
PASSES = ("forward", "forward+backward")
# Threshold: RMSNorm counts as cheaper when LayerNorm's mean time exceeds RMSNorm's by the rounds'
# combined spread plus 5% of LayerNorm's time: dropping one of two reductions over C (and the
# subtraction it feeds) is worth far more than 5% in the formula, and 5% is above what the
# medians of interleaved repeats move by on this shared machine.
MARGIN = 0.05
REDUCTIONS = {"mean", "sum", "var", "var_mean", "std", "native_layer_norm"}
WAYS_ZH = {
    "glassformer modules": "glassformer 模块",
    "torch ops": "torch 算子",
    "written out": "逐个张量运算写出",
}
PASSES_ZH = {"forward": "前向", "forward+backward": "前向+反向"}
SHAPES_ZH = {
    "GPT-2 batch 8x512 tokens x 768": "GPT-2 批次 8x512 个 token x 768",
    "Llama-7B 1024 tokens x 4096": "Llama-7B 1024 个 token x 4096",
    "GPT-2 2x512 tokens x 768": "GPT-2 2x512 个 token x 768",
    "Llama-7B 256 tokens x 4096": "Llama-7B 256 个 token x 4096",
    "64 tokens x 128": "64 个 token x 128",
}


def layer_norm_written(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """LayerNorm as the seed writes it: center, scale by the standard deviation, then γ, β."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS) * weight + bias


def rms_norm_written(x: Tensor, weight: Tensor) -> Tensor:
    """RMSNorm: no centering and no β, one statistic (the mean of squares)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * weight


def implementations(width: int) -> dict[str, dict[str, Callable[[Tensor], Tensor]]]:
    """{way: {"RMSNorm": f, "LayerNorm": f}}: the same γ (ones) and β (zeros) everywhere."""
    weight = torch.ones(width, requires_grad=True)
    bias = torch.zeros(width, requires_grad=True)
    return {
        "glassformer modules": {"RMSNorm": RMSNorm(width, EPS), "LayerNorm": LayerNorm(width, EPS)},
        "torch ops": {
            "RMSNorm": lambda x: F.rms_norm(x, (width,), weight, EPS),
            "LayerNorm": lambda x: F.layer_norm(x, (width,), weight, bias, EPS),
        },
        "written out": {
            "RMSNorm": lambda x: rms_norm_written(x, weight),
            "LayerNorm": lambda x: layer_norm_written(x, weight, bias),
        },
    }


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, by name (packet name: aten.mean.dim -> mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ops(norm: Callable[[Tensor], Tensor], x: Tensor) -> Counter[str]:
    with torch.no_grad(), OpCounter() as counter:
        norm(x)
    return counter.ops


def cpu_seconds(norm: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor, backward: bool) -> float:
    """CPU seconds of one call (process time: other processes on the machine do not count)."""
    if backward:
        x = x.detach().requires_grad_()
        start = time.process_time()
        norm(x).backward(grad)
        return time.process_time() - start
    with torch.no_grad():
        start = time.process_time()
        norm(x)
        return time.process_time() - start


def timed_rounds(
    pair: dict[str, Callable], x: Tensor, backward: bool, rounds: int, repeats: int
) -> dict[str, lab.Spread]:
    """Per norm, the median of `repeats` interleaved calls in each of `rounds` rounds."""
    grad = torch.randn_like(x)
    for norm in pair.values():
        cpu_seconds(norm, x, grad, backward)  # warm-up
    medians: dict[str, list[float]] = {name: [] for name in pair}
    for _ in range(rounds):
        calls: dict[str, list[float]] = {name: [] for name in pair}
        for _ in range(repeats):
            for name, norm in pair.items():
                calls[name].append(cpu_seconds(norm, x, grad, backward))
        for name in pair:
            medians[name].append(statistics.median(calls[name]))
    return {name: lab.over_seeds(values) for name, values in medians.items()}


def op_rows(x: Tensor) -> list[dict]:
    """The aten ops one forward of each norm dispatches on x, and how many are reductions."""
    rows = []
    for way, pair in implementations(x.shape[-1]).items():
        for norm_name, norm in pair.items():
            ops = count_ops(norm, x)
            rows.append(
                {
                    "way": way,
                    "norm": norm_name,
                    "aten ops": sum(ops.values()),
                    "reductions": sum(ops[r] for r in REDUCTIONS),
                    "ops": ", ".join(f"{k} x{v}" if v > 1 else k for k, v in ops.items()),
                }
            )
    return rows


@lab.register("rmsnorm-cost")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    shapes = ctx.pick(
        {
            "GPT-2 batch 8x512 tokens x 768": (4096, 768),
            "Llama-7B 1024 tokens x 4096": (1024, 4096),
        },
        {"GPT-2 2x512 tokens x 768": (1024, 768), "Llama-7B 256 tokens x 4096": (256, 4096)},
        {"64 tokens x 128": (64, 128)},
    )
    rounds, repeats = ctx.pick((5, 7), (3, 3), (2, 3))
    say = ctx.say
    for shape_name in shapes:
        say(shape_name, SHAPES_ZH[shape_name])
    for zh in (WAYS_ZH, PASSES_ZH):
        for en, words in zh.items():
            say(en, words)
    rows, checks, results = [], [], {}
    generator = torch.Generator().manual_seed(ctx.seed)
    ops_rows = op_rows(torch.randn(next(iter(shapes.values())), generator=generator))
    ops = {(r["way"], r["norm"]): r["aten ops"] for r in ops_rows}
    for shape_name, shape in shapes.items():
        x = torch.randn(shape, generator=generator)
        for way, pair in implementations(shape[-1]).items():
            for pass_name in PASSES:
                t = timed_rounds(pair, x, pass_name != "forward", rounds, repeats)
                rms, ln = t["RMSNorm"], t["LayerNorm"]
                results[(shape_name, way, pass_name)] = (rms.mean, ln.mean)
                rows.append(
                    {
                        say("shape", "形状"): shape_name,
                        say("way", "实现方式"): way,
                        say("pass", "计算"): pass_name,
                        say(
                            "RMSNorm ms", "RMSNorm 耗时 ms"
                        ): f"{1000 * rms.mean:.2f} ± {1000 * rms.spread:.2f}",
                        say(
                            "LayerNorm ms", "LayerNorm 耗时 ms"
                        ): f"{1000 * ln.mean:.2f} ± {1000 * ln.spread:.2f}",
                        say("RMS / LN", "RMS / LN 耗时比"): rms.mean / ln.mean,
                        say(
                            "forward aten ops RMS / LN", "前向 aten 算子数 RMS / LN"
                        ): f"{ops[(way, 'RMSNorm')]} / {ops[(way, 'LayerNorm')]}",
                    }
                )
                checks.append(
                    lab.exceeds_spread(
                        say(
                            f"{shape_name}, {way}, {pass_name}: LayerNorm - RMSNorm seconds",
                            f"{SHAPES_ZH[shape_name]}，{WAYS_ZH[way]}，{PASSES_ZH[pass_name]}："
                            "LayerNorm 减 RMSNorm 的秒数",
                        ),
                        ln,
                        rms,
                        margin=MARGIN * ln.mean,
                        group=way,
                    )
                )
    notes = _notes(ctx, results, ops_rows, rounds, repeats)
    figure = _plot(results, shapes)
    data = {
        "seconds": {" | ".join(k): {"rms": v[0], "ln": v[1]} for k, v in results.items()},
        "forward_ops": ops_rows,
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _notes(ctx, results: dict, ops_rows: list[dict], rounds: int, repeats: int) -> list[str]:
    say = ctx.say
    notes = [
        say(
            f"times: CPU seconds, {rounds} rounds x median of {repeats} interleaved calls, fp32",
            f"耗时：CPU 秒数，{rounds} 轮 x 每轮 {repeats} 次交替调用的中位数，fp32",
        )
    ]
    for way in ("glassformer modules", "torch ops", "written out"):
        ratios = [rms / ln for (_, w, _), (rms, ln) in results.items() if w == way]
        ops = {r["norm"]: r for r in ops_rows if r["way"] == way}
        counts = "; ".join(
            f"{name} {r['aten ops']} ops ({r['ops']}), {r['reductions']} reduction(s)"
            for name, r in ops.items()
        )
        counts_zh = "；".join(
            f"{name} {r['aten ops']} 个算子（{r['ops']}），{r['reductions']} 个归约"
            for name, r in ops.items()
        )
        low, high = min(ratios), max(ratios)
        notes.append(
            say(
                f"{way}: RMSNorm / LayerNorm time {low:.2f}-{high:.2f}; forward: {counts}",
                f"{WAYS_ZH[way]}：RMSNorm / LayerNorm 耗时比 {low:.2f}-{high:.2f}；"
                f"前向：{counts_zh}",
            )
        )
    if any("native_layer_norm" in r["ops"] for r in ops_rows):
        notes.append(
            say(
                "native_layer_norm is one fused kernel that computes both statistics in one "
                "pass; F.rms_norm dispatches its formula as separate ops on this CPU build",
                "native_layer_norm 是一个融合内核，一遍就算出两个统计量；在这个 CPU 版本上，"
                "F.rms_norm 把它的公式拆成多个独立算子分派",
            )
        )
    return notes


def _plot(results: dict, shapes: dict):
    fig, axes = lab.new_figure(9.0, 3.6, ncols=len(PASSES))
    ways = ("glassformer modules", "torch ops", "written out")
    for ax, pass_name in zip(axes, PASSES, strict=True):
        labels, series = [], {"RMSNorm": [], "LayerNorm": []}
        for shape_name in shapes:
            for way in ways:
                rms, ln = results[(shape_name, way, pass_name)]
                labels.append(f"{way.split(' ')[0]}\n{shape_name.split(' ')[0]}")
                series["RMSNorm"].append(1000 * rms)
                series["LayerNorm"].append(1000 * ln)
        lab.grouped_bars(ax, labels, series, fontsize=7)
        ax.set_ylabel("CPU ms per call")
        ax.set_title(pass_name, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("RMSNorm vs LayerNorm", fontsize=9)
    return fig
