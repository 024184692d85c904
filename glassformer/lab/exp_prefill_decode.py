"""Seed 000 §2.5.1 and seed 002 "KV Cache": prefill is compute-bound, decode memory-bound, and the
first token waits longer the longer the prompt. On SmolLM2-135M (fp32, one thread): the FLOPs of
a prefill and of one decode step (torch.utils.flop_counter, checked against calc cost) over the
bytes each must read (every weight once, plus the KV cache: calc.decode_step_bytes) is the
arithmetic intensity, set against this machine's ridge point (peak matmul FLOP/s over peak
memory-read bytes/s, calc.measure_peaks' two kernels timed in CPU seconds); the achieved FLOP/s
and bytes/s against those peaks; and the Engine's time to first token at several prompt lengths.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from glassformer import calc
from glassformer.infer.engine import Engine
from glassformer.lab import base as lab

# Thresholds. Roofline: a phase is compute-bound when its FLOPs per byte exceed the machine's
# ridge point (peak FLOP/s / peak bytes/s) and memory-bound when below it. A bound phase runs
# near its roof: at least half the measured peak of the resource that bounds it (the rest of a
# forward, norms, softmax, RoPE and Python, is not matmul or streaming reads).
ROOF_SHARE = 0.5
# Time to first token: it must rise at every longer prompt, and the longest prompt (8x the
# shortest) must take at least twice as long: "prompt 越长这步越慢", beyond a fixed overhead.
TTFT_GROWTH = 2.0
FLOP_TOL = 0.01  # counted vs calc cost: the same matmuls, so within 1%
PHASES_ZH = {"prefill": "prefill", "decode step": "decode 单步"}
NAMES_ZH = {
    "SmolLM2-shaped (2 random layers, vocab 512)": "SmolLM2 形状的模型（2 层随机初始化，词表 512）"
}


def _cpu_sdpa_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of torch's CPU flash-attention kernel, which the counter does not know: QKᵀ and AV
    over the full square, with GQA's key/value heads counted once per query head."""
    heads = query[1]
    return sdpa_flop_count(query, (key[0], heads, *key[2:]), (value[0], heads, *value[2:]))


def counted_flops(model: torch.nn.Module, ids: torch.Tensor, cache, start: int) -> int:
    """FLOPs torch's counter sees in a forward of ids at positions start.. into the cache."""
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}
    positions = torch.arange(start, start + ids.shape[1])
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(ids, positions, cache=cache, last_token_only=True)
    return counter.get_total_flops()


def cpu_peaks(seconds: float) -> tuple[float, float]:
    """(matmul GFLOP/s, memory-read GB/s): calc.measure_peaks' kernels, a 1024² fp32 matmul and
    the sum of a 256 MiB tensor, best of repeats for about `seconds`, but timed in CPU seconds
    like everything here (measure_peaks times wall clock, which other processes on a shared
    machine stretch, and the peaks would come out below what a forward achieves)."""
    a = torch.randn(1024, 1024)
    big = torch.ones(64 * 2**20)  # 256 MiB: larger than any cache
    best_mm = best_read = 0.0
    deadline = time.process_time() + seconds
    while time.process_time() < deadline:
        best_mm = max(best_mm, 2 * 1024**3 / cpu_seconds(lambda: a @ a) / 1e9)
        best_read = max(best_read, big.numel() * 4 / cpu_seconds(big.sum) / 1e9)
    return best_mm, best_read


def cpu_seconds(fn) -> float:
    """CPU seconds of fn() (process time: on a shared machine other processes do not count;
    with one thread and a machine to itself it equals wall time)."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def prefill_seconds(model, ids: torch.Tensor, repeats: int) -> float:
    """Median CPU seconds of a prefill into a fresh cache (run after a first forward, so that
    first-call allocation is not counted)."""

    def prefill() -> None:
        cache = model.new_cache(batch_size=1, max_seq_len=ids.shape[1] + 1)
        with torch.no_grad():
            model(ids, torch.arange(ids.shape[1]), cache=cache, last_token_only=True)

    return statistics.median(cpu_seconds(prefill) for _ in range(repeats))


def decode_seconds(model, token: torch.Tensor, cache, start: int, steps: int) -> float:
    """Median CPU seconds of one decode step continuing `cache` at positions start.. (one
    position a step); the first step is a warm-up."""
    times = []
    with torch.no_grad():
        for position in range(start, start + steps + 1):
            at = torch.tensor([position])
            times.append(cpu_seconds(lambda at=at: model(token, at, cache=cache,
                                                          last_token_only=True)))  # fmt: skip
    return statistics.median(times[1:])


def first_token_seconds(engine: Engine, prompt: list[int], repeats: int) -> tuple[float, float]:
    """(median CPU seconds of Engine.generate with one new token: prefill + sampling the first
    token, median wall-clock time_to_first_token_s the Engine reports)."""
    cpu, wall = [], []
    for _ in range(repeats):
        start = time.process_time()
        stats = engine.generate(prompt, max_new_tokens=1, temperature=0.0).stats
        cpu.append(time.process_time() - start)
        wall.append(stats.time_to_first_token_s)
    return statistics.median(cpu), statistics.median(wall)


@lab.register("prefill-decode")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    model, name = lab.smollm2_or_stand_in(ctx)
    cfg = model.cfg
    gflops, gbps = cpu_peaks(seconds=ctx.pick(2.0, 0.5, 0.3))
    ridge = gflops / gbps  # FLOPs per byte where the two roofs meet
    prompt_len = ctx.pick(512, 256, 32)
    generator = torch.Generator().manual_seed(ctx.seed)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=generator)

    steps = ctx.pick(16, 8, 3)
    cache = model.new_cache(batch_size=1, max_seq_len=prompt_len + steps + 2)
    prefill_flops = counted_flops(model, ids, cache, 0)  # also the warm-up of both timings
    decode_flops = counted_flops(model, ids[:, -1:], cache, prompt_len)  # step prompt_len + 1
    prefill_bytes = calc.decode_step_bytes(cfg, 0, "fp32") + calc.kv_cache_bytes(
        cfg, prompt_len, "fp32"
    )  # every weight read once, the prompt's keys/values written once
    decode_bytes = calc.decode_step_bytes(cfg, prompt_len + 1, "fp32")
    prefill_s = prefill_seconds(model, ids, ctx.pick(5, 2, 2))
    decode_s = decode_seconds(model, ids[:, -1:], cache, prompt_len + 1, steps)  # context P + 2..

    phases = {
        "prefill": (prefill_flops, prefill_bytes, prefill_s),
        "decode step": (decode_flops, decode_bytes, decode_s),
    }
    say = ctx.say
    rows, checks = [], []
    checks.append(
        lab.precondition(
            lab.approx(
                say("counted prefill FLOPs / calc cost", "计数得到的 prefill FLOPs / calc 估算"),
                prefill_flops / calc.prefill_flops(cfg, prompt_len),
                1.0,
                FLOP_TOL,
            )
        )
    )
    checks.append(
        lab.precondition(
            lab.approx(
                say("counted decode FLOPs / calc cost", "计数得到的 decode FLOPs / calc 估算"),
                decode_flops / calc.decode_flops(cfg, prompt_len, 1),
                1.0,
                FLOP_TOL,
            )
        )
    )
    achieved = {}
    for phase, (flops, nbytes, seconds) in phases.items():
        achieved[phase] = (flops / seconds / 1e9, nbytes / seconds / 1e9)
        rows.append(
            {
                say("phase", "阶段"): say(
                    f"{phase} ({prompt_len}-token context)",
                    f"{PHASES_ZH[phase]}（上下文 {prompt_len} 个 token）",
                ),
                say("GFLOP", "GFLOP（十亿次浮点运算）"): flops / 1e9,
                say("MB read", "读取 MB"): nbytes / 1e6,
                say("FLOP/byte", "FLOP/字节"): flops / nbytes,
                say("ridge FLOP/byte", "拐点 FLOP/字节"): ridge,
                say("ms (CPU)", "耗时 ms（CPU）"): 1000 * seconds,
                say(
                    "GFLOP/s (peak)", "GFLOP/s（峰值）"
                ): f"{achieved[phase][0]:.1f} ({gflops:.1f})",
                say("GB/s (peak)", "GB/s（峰值）"): f"{achieved[phase][1]:.2f} ({gbps:.1f})",
            }
        )
    group = say("prefill compute-bound", "prefill 受算力限制")
    checks.append(
        lab.at_least(
            say("prefill FLOPs/byte / ridge point", "prefill 的 FLOP/字节 / 拐点"),
            prefill_flops / prefill_bytes / ridge,
            1.0,
            group=group,
        )
    )
    checks.append(
        lab.at_least(
            say("prefill achieved / peak FLOP/s", "prefill 实际 FLOP/s / 峰值 FLOP/s"),
            achieved["prefill"][0] / gflops,
            ROOF_SHARE,
            group=group,
        )
    )
    group = say("decode memory-bound", "decode 受内存带宽限制")
    checks.append(
        lab.at_most(
            say("decode FLOPs/byte / ridge point", "decode 的 FLOP/字节 / 拐点"),
            decode_flops / decode_bytes / ridge,
            1.0,
            group=group,
        )
    )
    checks.append(
        lab.at_least(
            say("decode achieved / peak read bytes/s", "decode 实际读取字节/s / 峰值读取字节/s"),
            achieved["decode step"][1] / gbps,
            ROOF_SHARE,
            group=group,
        )
    )

    lengths = ctx.pick((64, 128, 256, 512), (16, 32, 64, 128), (4, 8, 16, 32))
    engine = Engine(model, max_rows=1, max_seq_len=max(lengths) + 2)
    ttft = {}
    first_token_seconds(engine, ids[0, : max(lengths)].tolist(), 1)  # warm-up at the longest
    for n in lengths:
        prompt = torch.randint(0, cfg.vocab_size, (n,), generator=generator).tolist()
        ttft[n] = first_token_seconds(engine, prompt, ctx.pick(3, 1, 1))
        rows.append(
            {
                "phase": say(
                    f"first token after a {n}-token prompt",
                    f"{n} 个 token 的 prompt 之后的首个 token",
                ),
                "ms (CPU)": 1000 * ttft[n][0],
                say("wall ms (Engine TTFT)", "墙钟 ms（Engine TTFT）"): 1000 * ttft[n][1],
                "GFLOP": calc.prefill_flops(cfg, n) / 1e9,
            }
        )
    cpu = [ttft[n][0] for n in lengths]
    rises = sum(b > a for a, b in itertools.pairwise(cpu))
    group = say("first-token time grows with the prompt", "首 token 时间随 prompt 增长")
    checks.append(
        lab.at_least(
            say(
                "longer prompts with a longer first-token time",
                "prompt 变长时首 token 时间也变长的次数",
            ),
            rises,
            len(lengths) - 1,
            group=group,
        )
    )
    checks.append(
        lab.at_least(
            say(
                f"first-token time, {lengths[-1]} / {lengths[0]} tokens",
                f"首 token 时间，{lengths[-1]} / {lengths[0]} 个 token",
            ),
            cpu[-1] / cpu[0],
            TTFT_GROWTH,
            group=group,
        )
    )
    notes = _notes(ctx, name, phases, achieved, gflops, gbps, ridge, lengths, cpu)
    figure = _plot(phases, ridge, gflops, gbps, lengths, ttft)
    data = {
        "peaks": {"gflops": gflops, "gbps": gbps},
        "ridge": ridge,
        "phases": {k: {"flops": f, "bytes": b, "seconds": s} for k, (f, b, s) in phases.items()},
        "ttft": {str(n): {"cpu_s": c, "wall_s": w} for n, (c, w) in ttft.items()},
    }
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _notes(ctx, name, phases, achieved, gflops, gbps, ridge, lengths, cpu) -> list[str]:
    say = ctx.say
    name_zh = NAMES_ZH.get(name, name)
    notes = [
        say(
            f"model: {name}, one thread; peaks measured here: {gflops:.1f} GFLOP/s matmul, "
            f"{gbps:.1f} GB/s read, ridge {ridge:.1f} FLOP/byte; times are CPU seconds (process "
            "time), wall-clock TTFT from the Engine is shown beside them",
            f"模型：{name_zh}，单线程；这里测得的峰值：matmul {gflops:.1f} GFLOP/s，读取 "
            f"{gbps:.1f} GB/s，拐点 {ridge:.1f} FLOP/字节；时间是 CPU 秒数（进程时间），旁边列出 "
            "Engine 报告的墙钟 TTFT",
        )
    ]
    for phase, (flops, nbytes, _) in phases.items():
        intensity = flops / nbytes
        above = intensity > ridge
        side = "above" if above else "below"
        flop_share, read_share = achieved[phase][0] / gflops, achieved[phase][1] / gbps
        notes.append(
            say(
                f"{phase}: {intensity:.1f} FLOP/byte, {side} the ridge; runs at "
                f"{flop_share:.0%} of the FLOP/s peak and "
                f"{read_share:.0%} of the read peak",
                f"{PHASES_ZH[phase]}：{intensity:.1f} FLOP/字节，"
                f"{'高于' if above else '低于'}拐点；"
                f"运行速度达到 FLOP/s 峰值的 {flop_share:.0%}、读取峰值的 {read_share:.0%}",
            )
        )
    slope = (cpu[-1] - cpu[0]) / (lengths[-1] - lengths[0])
    first_ms, last_ms, slope_ms = 1000 * cpu[0], 1000 * cpu[-1], 1000 * slope
    notes.append(
        say(
            f"first token: {first_ms:.0f} ms at {lengths[0]} tokens, {last_ms:.0f} ms at "
            f"{lengths[-1]} ({slope_ms:.2f} ms per extra prompt token)",
            f"首个 token：{lengths[0]} 个 token 时 {first_ms:.0f} ms，{lengths[-1]} 个时 "
            f"{last_ms:.0f} ms（prompt 每多一个 token 多 {slope_ms:.2f} ms）",
        )
    )
    return notes


def _plot(phases, ridge, gflops, gbps, lengths, ttft):
    fig, (left, right) = lab.new_figure(9.0, 3.6, ncols=2)
    xs = torch.logspace(-1, 4, 200).tolist()
    left.plot(xs, [min(gflops, x * gbps) for x in xs], "k-", linewidth=1, label="roofline")
    left.axvline(ridge, color="0.6", linestyle=":", label=f"ridge {ridge:.1f} FLOP/B")
    for (phase, (flops, nbytes, seconds)), marker in zip(phases.items(), "os", strict=True):
        left.plot(flops / nbytes, flops / seconds / 1e9, marker, markersize=8, label=phase)
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("arithmetic intensity (FLOPs per byte read)")
    left.set_ylabel("achieved GFLOP/s")
    left.set_title("Roofline：prefill vs decode", fontsize=9)
    left.legend(fontsize=7)
    right.plot(lengths, [1000 * ttft[n][0] for n in lengths], "o-", label="CPU time")
    right.plot(lengths, [1000 * ttft[n][1] for n in lengths], "s--", label="wall (Engine TTFT)")
    right.set_xlabel("prompt length (tokens)")
    right.set_ylabel("time to first token (ms)")
    right.set_title("首 token 延迟随 prompt 增长", fontsize=9)
    right.legend(fontsize=7)
    return fig
