"""Seed 000 §1.3: an RNN's long-range dependency is weak: what it saw d steps ago has to survive
d updates of one fixed-size state, while attention reads position t - d directly.

Measured on delayed recall: the inputs are random symbols, the target at position t is the
input at t - d (positions before d carry no loss). For each delay d an LSTM and a GPT (RoPE,
2 layers) of about the same size train for the same steps on the same batches (glassformer's
models, lab.fit), then predict fresh sequences; accuracy is the share of recalled symbols
(chance 1 / VOCAB). The LSTM has to hold the last d symbols in its state; the GPT can attend
to the one it needs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from glassformer.config import ModelConfig
from glassformer.lab import base as lab
from glassformer.lab.fit import Batch, Schedule, fit, step_generator
from glassformer.models import build_model

VOCAB = 16  # random symbols; chance accuracy 1/16
IGNORE_INDEX = -100  # the models' loss ignores this target (models/gpt.py, models/rnn.py)
# Thresholds, stated once. "Does not fall": the GPT recalls at least 90% of the symbols at the
# longest delay and loses at most 5 points from the shortest. "Falls with d": the LSTM's
# accuracy at the longest delay is at least 30 points below its own at the shortest.
MIN_GPT_ACCURACY = 0.9
MAX_GPT_DROP = 0.05
MIN_LSTM_DROP = 0.3


def recall_batch(batch_size: int, length: int, delay: int, generator: torch.Generator) -> Batch:
    """Random symbols (B, T) and their targets: the input `delay` positions back, ignored
    where t < delay."""
    if not 1 <= delay < length:
        raise ValueError(f"delay={delay} must be in 1..length-1={length - 1}")
    input_ids = torch.randint(0, VOCAB, (batch_size, length), generator=generator)
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[:, delay:] = input_ids[:, :-delay]
    return {"input_ids": input_ids, "targets": targets}


def recall_batches(batch_size: int, length: int, delay: int, seed: int) -> Callable[[int], Batch]:
    """batch(step) for fit(): a pure function of (seed, step), the same for every model."""

    def batch(step: int) -> Batch:
        return recall_batch(batch_size, length, delay, step_generator(seed, step))

    return batch


def evaluation(delay: int) -> torch.Generator:
    """The fresh sequences' generator, far from every training step's (fit.step_generator)."""
    return torch.Generator().manual_seed(2**62 + delay)


@torch.no_grad()
def recall_accuracy(model: torch.nn.Module, batch: Batch) -> float:
    """Share of the scored positions where the argmax prediction is the target."""
    model.eval()
    predicted = model(batch["input_ids"]).argmax(dim=-1)  # (B, T)
    scored = batch["targets"] != IGNORE_INDEX
    return (predicted[scored] == batch["targets"][scored]).float().mean().item()


def _configs(ctx: lab.RunContext, length: int) -> dict[str, ModelConfig]:
    width = ctx.pick(64, 64, 16)
    # The LSTM is a bit wider so that both have about the same parameter count.
    lstm_width = ctx.pick(96, 96, 24)
    return {
        "LSTM": ModelConfig(
            family="rnn", cell="lstm", vocab_size=VOCAB, d_model=lstm_width, n_layers=2,
            max_seq_len=length,
        ),
        "GPT": ModelConfig(
            vocab_size=VOCAB, d_model=width, n_layers=2, n_heads=4, position="rope", norm="rms",
            ffn="swiglu", max_seq_len=length,
        ),
    }  # fmt: skip


@lab.register("long-range")  # its claim: lab/claims.toml
def run(ctx: lab.RunContext) -> lab.Result:
    delays = ctx.pick([2, 4, 8, 16, 32, 64, 128], [2, 4, 8, 16, 32, 64], [2, 8])
    length = ctx.pick(192, 96, 16)  # one length for every delay: the same cost per step
    steps = ctx.pick(400, 200, 5)
    batch_size, n_eval = ctx.pick(32, 32, 8), ctx.pick(128, 64, 4)
    schedule = Schedule(max_steps=steps, learning_rate=3e-3, warmup_steps=min(20, steps // 4),
                        weight_decay=0.0)  # fmt: skip
    accuracy: dict[str, list[float]] = {}
    final_loss: dict[str, list[float]] = {}
    params: dict[str, int] = {}
    for name, cfg in _configs(ctx, length).items():
        accuracy[name], final_loss[name] = [], []
        for delay in delays:
            torch.manual_seed(ctx.seed)
            model = build_model(cfg)
            params[name] = sum(p.numel() for p in model.parameters())
            losses = fit(model, recall_batches(batch_size, length, delay, ctx.seed), schedule)
            fresh = recall_batch(n_eval, length, delay, evaluation(delay))
            accuracy[name].append(recall_accuracy(model, fresh))
            final_loss[name].append(losses[-1])
    rows = [
        {"delay d": d, "LSTM accuracy": accuracy["LSTM"][i], "GPT accuracy": accuracy["GPT"][i],
         "LSTM train loss (last step)": final_loss["LSTM"][i],
         "GPT train loss (last step)": final_loss["GPT"][i]}
        for i, d in enumerate(delays)
    ]  # fmt: skip
    first, last = delays[0], delays[-1]
    lstm_drop = accuracy["LSTM"][0] - accuracy["LSTM"][-1]
    gpt_drop = accuracy["GPT"][0] - accuracy["GPT"][-1]
    checks = [
        lab.at_least(f"GPT accuracy at d={last}", accuracy["GPT"][-1], MIN_GPT_ACCURACY),
        lab.at_most(f"GPT accuracy drop, d={first} -> d={last}", gpt_drop, MAX_GPT_DROP),
        lab.at_least(f"LSTM accuracy drop, d={first} -> d={last}", lstm_drop, MIN_LSTM_DROP),
    ]
    notes = [
        f"parameters: LSTM {params['LSTM']:,}, GPT {params['GPT']:,}; {steps} steps of "
        f"{batch_size} sequences of {length} symbols each, the same batches for both; "
        f"chance accuracy 1/{VOCAB} = {1 / VOCAB:.3f}",
        "the LSTM's loss is the seed's two causes together: recalling d steps back means "
        f"holding the last d symbols ({VOCAB} kinds each) in one state vector, and the "
        "gradient that would teach it to do so crosses d steps; more steps or a wider state "
        "push its limit further out (the gates mitigate, as the seed says), not away",
    ]
    figure = _plot(delays, accuracy)
    data = {"delays": delays, "accuracy": accuracy, "final_train_loss": final_loss,
            "params": params, "steps": steps, "length": length}  # fmt: skip
    return lab.Result.from_checks(rows, checks, figure=figure, data=data, notes=notes)


def _plot(delays: list[int], accuracy: dict[str, list[float]]):
    fig, ax = lab.new_figure(6.0, 3.4)
    for name, values in accuracy.items():
        ax.plot(delays, values, marker="o", label=name)
    ax.axhline(1 / VOCAB, color="grey", linestyle=":", label=f"chance (1/{VOCAB})")
    ax.set(xscale="log", xlabel="delay d (recall the symbol d positions back)",
           ylabel="accuracy on fresh sequences", ylim=(0, 1.05),
           title="delayed recall: same steps, same batches")  # fmt: skip
    ax.minorticks_off()
    ax.set_xticks(delays, [str(d) for d in delays])
    ax.legend(fontsize=8)
    return fig
