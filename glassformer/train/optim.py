"""The optimizer and the learning-rate schedule of every training run (seed 000 §2.1-2.2)."""

from __future__ import annotations

import math

import torch
from torch import nn


def make_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW (the fused kernel: fastest on CPU in benchmarks/train_throughput.py); weight decay
    only on matrices, not on biases and norm gains."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), fused=True)


def learning_rate(step: int, cfg) -> float:
    """Linear warmup, then cosine decay from learning_rate to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr + cosine * (cfg.learning_rate - cfg.min_lr)
