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
    rows = []
    for name in models:
        row = {"model": name, "params": sum(p.numel() for p in models[name].parameters())}
        row.update({f"T={t} ms": 1e3 * seconds[name, t] for t in lengths})
        row["longest / shortest"] = seconds[name, lengths[-1]] / seconds[name, lengths[0]]
        row["sequential steps per layer"] = "T" if "GPT" not in name else "1"
        rows.append(row)
    shortest, longest = lengths[0], lengths[-1]
    checks = []
    for name in (RNN, LSTM):
        checks.append(lab.at_least(f"{name}: time at T={longest} / T={shortest}, {tokens} tokens "
                                   "per step", seconds[name, longest] / seconds[name, shortest],
                                   MIN_RNN_GROWTH, group=LONGER_SLOWER))  # fmt: skip
    for name in (RNN, LSTM):
        checks.append(lab.at_least(f"{name} / GPT time at T={longest}",
                                   seconds[name, longest] / seconds[GPT, longest], MIN_SPEEDUP,
                                   group=ONE_PASS_FASTER))  # fmt: skip
    growth = {row["model"]: row["longest / shortest"] for row in rows}
    notes = [
        f"at {tokens} tokens per step, from T={shortest} to T={longest}, the step time changes "
        + ", ".join(f"x{growth[name]:.2f} for {name}" for name in models)
        + " (the GPT's attention grows with T; the recurrent models' arithmetic does not)",
        f"median of {runs} timed steps after a warm-up, one CPU thread; the seed's 'GPU 大量算力"
        "闲置' is not measured here (no GPU)",
    ]
    figure = _plot(models, lengths, seconds)
    data = {"tokens_per_step": tokens, "seconds": {f"{n}|{t}": s for (n, t), s in seconds.items()}}
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(models, lengths, seconds):
    fig, ax = lab.new_figure(6.0, 3.4)
    for name in models:
        ax.plot(lengths, [1e3 * seconds[name, t] for t in lengths], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="T (tokens per sequence)",
           ylabel="ms per training step", title="same tokens per step")  # fmt: skip
    ax.legend(fontsize=7)
    return fig
