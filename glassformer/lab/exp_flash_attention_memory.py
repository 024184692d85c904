"""Seed 002: "后来的 Flash Attention（把注意力算得更省显存）…全是在跟这个 O(n²) 死磕": attention
computed in blocks never holds the whole T x T score matrix.

glassformer's Attention (d_model 512, 8 heads of 64) runs one causal forward at several lengths
T on each path: "eager" writes the H x T x T scores, masks them and takes their softmax as whole
tensors; "sdpa" calls torch's scaled_dot_product_attention, whose CPU kernel is a flash-attention
one (blocks of queries and keys with a running softmax). The memory a forward takes is the rise
of the peak resident memory (VmHWM, reset through /proc/self/clear_refs just before the forward)
of a fresh process for each forward, so no memory an earlier forward freed is reused; the
smallest over a few repeats. This CPU's RAM stands in for a GPU's
显存: the same tensors live there.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.nn.attention import Attention, AttentionMask

D_MODEL, N_HEADS = 512, 8
BACKENDS = ("eager", "sdpa")
# Thresholds, stated once. Precondition: both paths compute the same attention (max |difference|
# at most 1e-4). "更省显存": at the longest length the sdpa forward's peak is at most a quarter of
# the eager one's; the eager peak grows like T² (its growth exponent between the two longest
# lengths, log peak ratio / log length ratio, at least 1.7) and the sdpa one like T (at most
# 1.3).
SAME_OUTPUT = 1e-4
MAX_SHARE = 0.25
MIN_EAGER_EXPONENT, MAX_SDPA_EXPONENT = 1.7, 1.3
STATUS, CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def peak_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", STATUS.read_text()).group(1))


def reset_peak() -> None:
    CLEAR.write_text("5")  # Linux: the peak resident size restarts from the current one


def layer_for(backend: str, max_len: int, seed: int) -> Attention:
    cfg = ModelConfig(
        d_model=D_MODEL, n_heads=N_HEADS, attention_backend=backend, max_seq_len=max_len
    )
    torch.manual_seed(seed)
    return Attention(cfg).eval()


def child(backend: str, seq_len: int, seed: int) -> None:
    """In a fresh process (so no earlier forward's freed memory is reused): print the MiB one
    forward adds to the peak resident memory."""
    layer = layer_for(backend, seq_len, seed)
    x = torch.randn(1, seq_len, D_MODEL, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        reset_peak()
        before = peak_kib()
        layer(x, AttentionMask(is_causal=True))
        print((peak_kib() - before) / 1024)


def forward_peak(backend: str, seq_len: int, seed: int, repeats: int) -> float:
    """The smallest over `repeats` fresh processes of the MiB a forward adds to the peak."""
    code = f"from {__name__} import child; child({backend!r}, {seq_len}, {seed})"
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    rises = []
    for _ in range(repeats):
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the {backend} forward at T={seq_len} failed: {done.stderr}")
        rises.append(float(done.stdout.split()[-1]))
    return min(rises)


@torch.no_grad()
def outputs_differ(seq_len: int, seed: int) -> float:
    """max |eager - sdpa| of one forward at seq_len: the two paths compute the same thing."""
    x = torch.randn(1, seq_len, D_MODEL, generator=torch.Generator().manual_seed(seed))
    mask = AttentionMask(is_causal=True)
    out = {b: layer_for(b, seq_len, seed)(x, mask) for b in BACKENDS}
    return float((out["eager"] - out["sdpa"]).abs().max())


def exponent(lengths: list[int], peaks: list[float]) -> float:
    """The growth exponent between the two longest lengths, where the T x T term, if there is
    one, outweighs the fixed costs: log(peak ratio) / log(T ratio) (1: linear, 2: quadratic)."""
    ratio = max(peaks[-1], 1e-3) / max(peaks[-2], 1e-3)
    return math.log(ratio) / math.log(lengths[-1] / lengths[-2])


@lab.register("flash-attention-memory")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    if not CLEAR.exists():
        raise RuntimeError("flash-attention-memory reads /proc/self/clear_refs (Linux only)")
    say = ctx.say
    lengths = ctx.pick([512, 1024, 2048, 4096], [512, 1024, 2048], [64, 128])
    repeats = ctx.pick(3, 2, 1)
    peaks = {b: [forward_peak(b, t, ctx.seed, repeats) for t in lengths] for b in BACKENDS}
    differences = [outputs_differ(t, ctx.seed) for t in lengths]
    growth = {b: exponent(lengths, peaks[b]) for b in BACKENDS}
    group = say("flash attention saves memory", "Flash Attention 更省显存")
    checks = [
        lab.precondition(
            lab.at_most(
                say(
                    "max |eager - sdpa| output, any length",
                    "eager 与 sdpa 输出之差的最大绝对值，任一长度",
                ),
                max(differences),
                SAME_OUTPUT,
            )
        ),
        lab.at_most(
            say(
                f"T={lengths[-1]}: sdpa peak / eager peak",
                f"T={lengths[-1]}：sdpa 峰值 / eager 峰值",
            ),
            peaks["sdpa"][-1] / max(peaks["eager"][-1], 1e-3),
            MAX_SHARE,
            group=group,
        ),
        lab.at_least(
            say("eager: growth exponent of the peak with T", "eager：峰值随 T 增长的指数"),
            growth["eager"],
            MIN_EAGER_EXPONENT,
            group=group,
        ),
        lab.at_most(
            say("sdpa: growth exponent of the peak with T", "sdpa：峰值随 T 增长的指数"),
            growth["sdpa"],
            MAX_SDPA_EXPONENT,
            group=group,
        ),
    ]
    t_col = say("T", "T")
    eager_col, sdpa_col = (
        say("eager peak (MiB)", "eager 峰值（MiB）"),
        say("sdpa peak (MiB)", "sdpa 峰值（MiB）"),
    )
    scores_col = say("one H x T x T fp32 score tensor (MiB)", "一个 H x T x T fp32 分数张量（MiB）")
    rows = [
        {t_col: t, eager_col: e, sdpa_col: s, scores_col: N_HEADS * t * t * 4 / 2**20}
        for t, e, s in zip(lengths, peaks["eager"], peaks["sdpa"], strict=True)
    ]
    notes = [
        ctx.say(
            f"one causal forward of glassformer's Attention (d_model {D_MODEL}, {N_HEADS} "
            f"heads), batch 1, fp32, no gradient; the rise of the peak resident memory, the "
            f"smallest of {repeats} fresh processes; growth exponents between the two longest "
            f"lengths: eager {growth['eager']:.2f}, sdpa {growth['sdpa']:.2f}",
            f"glassformer 的 Attention（d_model {D_MODEL}，{N_HEADS} 个头）做一次因果前向，"
            f"批大小 1，fp32，不求梯度；取峰值常驻内存的增量，{repeats} 个新进程中的最小值；"
            f"两个最长长度之间的增长指数：eager {growth['eager']:.2f}，sdpa "
            f"{growth['sdpa']:.2f}",
        ),
        ctx.say(
            "this is the memory half of flash attention; its speed half (fewer trips to "
            "slow memory) is a GPU matter, left out on this CPU",
            "这是 Flash Attention 省显存的一半；它省时间的一半（减少对慢速显存的读写）是 GPU "
            "上的事，在这台 CPU 上不测",
        ),
    ]
    data = {"lengths": lengths, "peaks_mib": peaks, "max_difference": differences}
    return lab.Result.from_checks(
        rows, checks, figure=_plot(lengths, peaks), data=data, notes=notes
    )


def _plot(lengths: list[int], peaks: dict):
    fig, ax = lab.new_figure(6.0, 3.6)
    for backend in BACKENDS:
        ax.plot(lengths, [max(p, 1e-2) for p in peaks[backend]], "o-", label=backend)
    ax.plot(
        lengths,
        [N_HEADS * t * t * 4 / 2**20 for t in lengths],
        "k:",
        label="one H x T x T score tensor",
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length T",
        ylabel="peak memory added by a forward (MiB)",
        title="eager holds T x T scores; flash (sdpa) does not",
    )
    ax.legend(fontsize=7)
    return fig
