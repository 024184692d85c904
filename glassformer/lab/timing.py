"""Timing models in turns, for experiments whose claim is a cost: a training step (forward,
backward, AdamW) and the Engine's seconds per prompt token and per generated token, each model
once per round so that a busy machine slows all alike, the median of the rounds.
"""

from __future__ import annotations

import statistics
import time

import torch

from glassformer.infer.engine import Engine
from glassformer.lab.fit import Schedule
from glassformer.train.optim import make_optimizer


class Timer:
    """Times one model: a training step (forward, backward, AdamW) on a fixed batch, and greedy
    generation with the Engine (seconds per prompt token and per generated token). All three run
    the same PyTorch modules: the fused C decode step (infer/fused.py) has no MoE, so it is off
    for the dense models too, and the times compare architectures, not kernels."""

    def __init__(self, model, batch: dict[str, torch.Tensor], prompt: list[int], n_new: int):
        self.model, self.batch, self.prompt, self.n_new = model, batch, prompt, n_new
        self.optimizer = make_optimizer(model, Schedule(max_steps=1))

    def train_step(self) -> float:
        self.model.train()
        start = time.perf_counter()
        self.model.loss(**self.batch).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def generate(self) -> tuple[float, float]:
        stats = (
            Engine(self.model.eval(), fast=False)
            .generate(self.prompt, self.n_new, temperature=0.0)
            .stats
        )
        return 1 / stats.prefill_tokens_per_s, 1 / stats.decode_tokens_per_s


def time_models(models: dict, batch, prompt: list[int], n_new: int, rounds: int) -> dict:
    """Median seconds per train step / prompt token / generated token of each model, timed in
    turns (each round times every model once) so that a busy machine slows all alike. The first
    round is dropped: it pays one-time costs (allocations, AdamW's state)."""
    timers = {name: Timer(model, batch, prompt, n_new) for name, model in models.items()}
    times = {name: {"train step": [], "prefill token": [], "decode token": []} for name in models}
    for round_ in range(rounds + 1):
        for name, timer in timers.items():
            step = timer.train_step()
            prefill, decode = timer.generate()
            if round_ > 0:
                for kind, t in zip(times[name], (step, prefill, decode), strict=True):
                    times[name][kind].append(t)
    return {
        name: {kind: statistics.median(ts) for kind, ts in by_kind.items()}
        for name, by_kind in times.items()
    }
