"""Seed 000 §1.3 and §2.2: an RNN computes h(t) from h(t-1), T sequential steps per layer, so
"training is slow, and slower the longer the sequence"; a Transformer reads all T positions in
one pass.

Measured: one training step (forward + backward) at a fixed number of tokens per step (the batch
shrinks as T grows, so the arithmetic stays about the same) for the tutorial's tanh RNN cell
(looped over time in Python), torch's fused LSTM, and a GPT, all from glassformer's models, at
growing T. What changes with T is how many sequential steps the recurrent models take.
"""

from __future__ import annotations

import statistics
import time

import torch

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.models import build_model

VOCAB = 96
# Thresholds, stated once. "序列越长越慢": at a constant number of tokens per step, each
# recurrent model's step gets at least 2x slower from the shortest T to the longest (x8): the
# arithmetic is the same, so only the T sequential steps can make it slower, and 2x is well
# beyond the timing noise of a median over repeated steps (a linear cost would be x8). "训练慢"
# against the Transformer: the one-pass GPT's step is faster than each recurrent model's at the
# longest T (ratio >= 1). The models are not matched in size: the table lists their parameters.
MIN_RNN_GROWTH = 2.0
MIN_SPEEDUP = 1.0
LONGER_SLOWER = "recurrent training is slower the longer the sequence"
ONE_PASS_FASTER = "the one-pass Transformer trains faster"
RNN, LSTM, GPT = "RNN cell (tutorial, Python loop)", "LSTM (torch, fused)", "GPT (one pass)"
MODELS_ZH = {
    RNN: "RNN 单元（教程写法，Python 循环）",
    LSTM: "LSTM（torch 融合实现）",
    GPT: "GPT（一次读完）",
}


def _models(ctx: lab.RunContext) -> dict[str, torch.nn.Module]:
    width = ctx.pick(256, 192, 64)
    common = dict(vocab_size=VOCAB, d_model=width, n_layers=2, max_seq_len=1024)
    torch.manual_seed(ctx.seed)
    return {
        RNN: build_model(ModelConfig(family="rnn", cell="rnn", **common)),
        LSTM: build_model(ModelConfig(family="rnn", cell="lstm", **common)),
        GPT: build_model(
            ModelConfig(n_heads=4, position="rope", norm="rms", ffn="swiglu", **common)
        ),
    }


def step_seconds(model: torch.nn.Module, ids: torch.Tensor, runs: int) -> float:
    """Median seconds of forward + backward over ids (B, T), after one warm-up step."""
    times = []
    for i in range(runs + 1):
        start = time.perf_counter()
        model.loss(ids, ids).loss.backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@lab.register("rnn-parallel")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    lengths = ctx.pick([64, 128, 256, 512], [64, 128, 256, 512], [16, 64])
    tokens = ctx.pick(4096, 2048, 256)
    runs = ctx.pick(3, 2, 1)
    models = _models(ctx)
    seconds: dict[tuple[str, int], float] = {}
    generator = torch.Generator().manual_seed(ctx.seed)
    for length in lengths:
        ids = torch.randint(0, VOCAB, (tokens // length, length), generator=generator)
        for name, model in models.items():
            seconds[name, length] = step_seconds(model, ids, runs)
    say = ctx.say
    for name in models:
        say(name, MODELS_ZH[name])
    rows = []
    for name in models:
        row = {
            say("model", "模型"): name,
            say("params", "参数量"): sum(p.numel() for p in models[name].parameters()),
        }
        row.update({say(f"T={t} ms", f"T={t} 耗时 ms"): 1e3 * seconds[name, t] for t in lengths})
        row[say("longest / shortest", "最长 / 最短")] = (
            seconds[name, lengths[-1]] / seconds[name, lengths[0]]
        )
        row[say("sequential steps per layer", "每层的串行步数")] = "T" if "GPT" not in name else "1"
        rows.append(row)
    shortest, longest = lengths[0], lengths[-1]
    longer_slower = say(LONGER_SLOWER, "循环模型的训练随序列变长而变慢")
    one_pass_faster = say(ONE_PASS_FASTER, "一次读完整条序列的 Transformer 训练更快")
    checks = []
    for name in (RNN, LSTM):
        checks.append(
            lab.at_least(
                say(
                    f"{name}: time at T={longest} / T={shortest}, {tokens} tokens per step",
                    f"{MODELS_ZH[name]}：T={longest} 与 T={shortest} "
                    f"的耗时之比，每步 {tokens} 个 token",
                ),
                seconds[name, longest] / seconds[name, shortest],
                MIN_RNN_GROWTH,
                group=longer_slower,
            )
        )
    for name in (RNN, LSTM):
        checks.append(
            lab.at_least(
                say(
                    f"{name} / GPT time at T={longest}",
                    f"T={longest} 时 {MODELS_ZH[name]} 与 GPT 的耗时之比",
                ),
                seconds[name, longest] / seconds[GPT, longest],
                MIN_SPEEDUP,
                group=one_pass_faster,
            )
        )
    growth = {row["model"]: row["longest / shortest"] for row in rows}
    notes = [
        say(
            f"at {tokens} tokens per step, from T={shortest} to T={longest}, the step time changes "
            + ", ".join(f"x{growth[name]:.2f} for {name}" for name in models)
            + " (the GPT's attention grows with T; the recurrent models' arithmetic does not)",
            f"每步 {tokens} 个 token，从 T={shortest} 到 T={longest}，每步耗时的变化："
            + "，".join(f"{MODELS_ZH[name]} x{growth[name]:.2f}" for name in models)
            + "（GPT 的注意力计算量随 T 增长，循环模型的计算量不随 T 变）",
        ),
        say(
            f"median of {runs} timed steps after a warm-up, one CPU thread; the seed's 'GPU "
            "大量算力闲置' is not measured here (no GPU)",
            f"预热一步后计时 {runs} 步取中位数，单个 CPU 线程；原文的“GPU 大量算力闲置”这里没有"
            "测量（没有 GPU）",
        ),
    ]
    figure = _plot(models, lengths, seconds)
    data = {"tokens_per_step": tokens, "seconds": {f"{n}|{t}": s for (n, t), s in seconds.items()}}
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(models, lengths, seconds):
    fig, ax = lab.new_figure(6.0, 3.4)
    for name in models:
        ax.plot(lengths, [1e3 * seconds[name, t] for t in lengths], marker="o", label=name)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="T (tokens per sequence)",
        ylabel="ms per training step",
        title="same tokens per step",
    )
    ax.legend(fontsize=7)
    return fig
