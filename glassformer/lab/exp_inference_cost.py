"""Seed 000 §2.5.1: "推理成本 ≈（prefill 一次 + decode × 输出长度）。输出越长花钱越多".

SmolLM2-135M generates with glassformer's Engine (batch 1, greedy, every requested token: the
end of turn ignored) over a grid of prompt lengths P and output lengths N, each point timed in
interleaved repeats (median). The seed's formula as a model of the time: t(P, N) = prefill(P) +
N x decode, with prefill(P) measured once per P (the time to the first token) and the decode
cost per token fitted on half of the grid. It is judged on the other half: does it predict the
total time there? Prefill happens once: the time to the first token does not depend on N.
"""

from __future__ import annotations

import statistics

import torch

from glassformer.infer.engine import Engine
from glassformer.infer.sampling import NO_EOS
from glassformer.lab import base as lab

# Thresholds, stated once. The formula holds when it predicts the held-out half of the grid
# within 10% at every point (timing noise on a shared CPU is a few percent); prefill is "一次"
# when the time to the first token at the longest output is within 20% of that at the shortest;
# "输出越长花钱越多": 8x the output costs at least 2x the time at the middle prompt length.
MAX_ERROR = 0.10
MAX_TTFT_CHANGE = 0.20
MIN_LONGER_COST = 2.0


def grid(ctx: lab.RunContext) -> tuple[list[int], list[int], int]:
    """(prompt lengths, output lengths, repeats)."""
    return ctx.pick(
        ([64, 256, 1024], [8, 24, 64], 5),
        ([64, 256, 512], [8, 24, 64], 3),
        ([8, 16], [2, 4, 16], 2),
    )


def measure(
    engine: Engine, prompts: dict[int, list[int]], outputs: list[int], repeats: int
) -> dict[tuple[int, int], dict[str, float]]:
    """Median total time and time to the first token of every (P, N), the points interleaved in
    every repeat so that a slow spell falls on all of them; one warm-up generation first."""
    longest = max(prompts)
    engine.generate(prompts[longest], max(outputs), temperature=0.0, eos_token_id=NO_EOS)
    times: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for _ in range(repeats):
        for p, ids in prompts.items():
            for n in outputs:
                stats = engine.generate(ids, n, temperature=0.0, eos_token_id=NO_EOS).stats
                if stats.generated_tokens != n:
                    raise RuntimeError(f"asked for {n} tokens, got {stats.generated_tokens}")
                times.setdefault((p, n), []).append(
                    (stats.total_time_s, stats.time_to_first_token_s)
                )
    return {
        key: {
            "total": statistics.median(t for t, _ in ts),
            "ttft": statistics.median(f for _, f in ts),
        }
        for key, ts in times.items()
    }


def fit_decode(points: dict, fit_keys: list, prefill: dict[int, float]) -> float:
    """Least squares of t - prefill(P) = N x decode over fit_keys (one unknown: decode)."""
    num = sum(n * (points[(p, n)]["total"] - prefill[p]) for p, n in fit_keys)
    return num / sum(n * n for _, n in fit_keys)


@lab.register("inference-cost")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    say = ctx.say
    model, name = lab.smollm2_or_stand_in(ctx, max_seq_len=64)
    lengths, outputs, repeats = grid(ctx)
    generator = torch.Generator().manual_seed(ctx.seed)
    vocab = model.cfg.vocab_size
    prompts = {p: torch.randint(100, vocab, (p,), generator=generator).tolist() for p in lengths}
    points = measure(Engine(model), prompts, outputs, repeats)
    # prefill(P): the time to the first token, a median over every N at that P
    prefill = {p: statistics.median(points[(p, n)]["ttft"] for n in outputs) for p in lengths}
    keys = [(p, n) for p in lengths for n in outputs]
    fit_keys, test_keys = keys[0::2], keys[1::2]  # a checkerboard: each half spans the grid
    decode = fit_decode(points, fit_keys, prefill)
    predicted = {k: prefill[k[0]] + k[1] * decode for k in keys}
    error = {k: abs(predicted[k] - points[k]["total"]) / points[k]["total"] for k in keys}
    mid = lengths[len(lengths) // 2]
    ttft_change = max(
        abs(points[(p, outputs[-1])]["ttft"] / points[(p, outputs[0])]["ttft"] - 1) for p in lengths
    )
    formula = say(
        "time = prefill once + decode x output length", "时间 = prefill 一次 + decode × 输出长度"
    )
    checks = [
        lab.at_most(
            say(
                "largest relative error of the formula on the held-out half of the grid",
                "公式在留出的一半网格点上的最大相对误差",
            ),
            max(error[k] for k in test_keys),
            MAX_ERROR,
            group=formula,
        ),
        lab.at_most(
            say(
                f"time to the first token, N={outputs[-1]} vs N={outputs[0]}: largest "
                "relative change over P",
                f"首 token 时间，N={outputs[-1]} 对 N={outputs[0]}：各 P 中最大的相对变化",
            ),
            ttft_change,
            MAX_TTFT_CHANGE,
            group=formula,
        ),
        lab.at_least(
            say(
                f"P={mid}: time for N={outputs[-1]} / for N={outputs[0]}",
                f"P={mid}：N={outputs[-1]} 的时间 / N={outputs[0]} 的时间",
            ),
            points[(mid, outputs[-1])]["total"] / points[(mid, outputs[0])]["total"],
            MIN_LONGER_COST,
            group=say("longer output costs more", "输出越长花钱越多"),
        ),
    ]
    p_col, n_col = (
        say("prompt tokens P", "提示 token 数 P"),
        say("output tokens N", "输出 token 数 N"),
    )
    t_col, f_col = say("measured s", "实测秒数"), say("formula s", "公式秒数")
    ttft_col, half = say("time to first token s", "首 token 秒数"), say("half", "所属一半")
    rows = [
        {
            p_col: p,
            n_col: n,
            t_col: points[(p, n)]["total"],
            f_col: predicted[(p, n)],
            ttft_col: points[(p, n)]["ttft"],
            half: say("fit", "拟合") if (p, n) in fit_keys else say("held out", "留出"),
        }
        for p, n in keys
    ]
    notes = [
        ctx.say(
            f"model: {name}, Engine at batch 1, greedy, end of turn ignored; random-token "
            f"prompts; {repeats} interleaved repeats per point, median; decode fitted on "
            f"half of the grid: {1000 * decode:.2f} ms per output token; prefill(P) "
            + ", ".join(f"P={p}: {1000 * prefill[p]:.0f} ms" for p in lengths),
            f"模型：{name}，Engine 批大小 1，贪心，忽略结束符；随机 token 提示；每个点交错重复 "
            f"{repeats} 次取中位数；decode 在一半网格上拟合：每个输出 token "
            f"{1000 * decode:.2f} 毫秒；prefill(P) "
            + "，".join(f"P={p}：{1000 * prefill[p]:.0f} 毫秒" for p in lengths),
        ),
        ctx.say(
            "the formula leaves out that a decode step reads a KV cache that grows with P + N; "
            "at these lengths that read is small beside the weights every step reads",
            "公式没有计入 decode 每一步要读的 KV cache 会随 P + N 变大；在这些长度下，它比"
            "每步都要读的权重小得多",
        ),
    ]
    data = {
        "points": {f"{p},{n}": v for (p, n), v in points.items()},
        "prefill": prefill,
        "decode_s": decode,
        "fit": fit_keys,
        "test": test_keys,
    }
    return lab.Result.from_checks(
        rows, checks, figure=_plot(points, predicted, lengths, outputs), data=data, notes=notes
    )


def _plot(points: dict, predicted: dict, lengths: list[int], outputs: list[int]):
    fig, ax = lab.new_figure(6.4, 3.6)
    for i, p in enumerate(lengths):
        ax.plot(
            outputs,
            [points[(p, n)]["total"] for n in outputs],
            "o",
            color=f"C{i}",
            label=f"P={p}, measured",
        )
        ax.plot(
            outputs,
            [predicted[(p, n)] for n in outputs],
            "-",
            color=f"C{i}",
            alpha=0.6,
            label=f"P={p}, prefill(P) + N x decode",
        )
    ax.set(
        xlabel="output tokens N",
        ylabel="seconds (median)",
        title="推理成本 ≈ prefill 一次 + decode × 输出长度",
    )
    ax.legend(fontsize=7)
    return fig
