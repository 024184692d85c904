"""Small in-process training for the lab's experiments: the trainer's AdamW and warmup + cosine
schedule (train/trainer.py) over batches an experiment makes itself (a synthetic task, random
windows of Shakespeare), with no checkpoints on disk. `train/` stays the way to train a real
model; this is for the experiments that train a few small models for a minute each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor, nn

from glassformer.tokenizers import CharTokenizer
from glassformer.train.trainer import learning_rate, make_optimizer

Batch = dict[str, Tensor]


@dataclass(frozen=True)
class Schedule:
    """The optimizer settings fit() hands to the trainer's make_optimizer and learning_rate."""

    max_steps: int
    learning_rate: float = 1e-3
    warmup_steps: int = 0
    min_lr: float | None = None  # None: learning_rate / 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        if self.min_lr is None:
            object.__setattr__(self, "min_lr", self.learning_rate / 10)


def fit(model: nn.Module, batch: Callable[[int], Batch], schedule: Schedule) -> list[float]:
    """Train `model` for schedule.max_steps steps on batch(step) (the kwargs of model.loss);
    the per-step cross-entropy. A step whose loss is not finite ends the run early (a model
    that diverged), so the list can be shorter than max_steps and end in nan/inf."""
    optimizer = make_optimizer(model, schedule)
    model.train()
    losses: list[float] = []
    for step in range(schedule.max_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, schedule)
        out = model.loss(**batch(step))
        losses.append(out.ce_loss.item())
        if not math.isfinite(losses[-1]):
            break
        out.loss.backward()
        if schedule.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), schedule.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return losses


# --- Shakespeare, one token per character -------------------------------------------------------


@dataclass(frozen=True)
class CharCorpus:
    tokenizer: CharTokenizer
    train: Tensor  # (N,) token ids, long
    val: Tensor  # (M,) the held-out tail of the same text


@lru_cache(maxsize=2)
def shakespeare_chars(n_chars: int | None = None, val_fraction: float = 0.1) -> CharCorpus:
    """The modern-spelling plays as character ids (the first n_chars characters, or all), the
    last val_fraction held out. The tokenizer knows every character of the whole corpus."""
    from glassformer.data.corpus import corpus_text

    text = corpus_text("modern")
    tokenizer = CharTokenizer.from_text(text)
    if n_chars is not None:
        text = text[:n_chars]
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    split = int(len(ids) * (1 - val_fraction))
    return CharCorpus(tokenizer, ids[:split], ids[split:])


def random_windows(ids: Tensor, batch_size: int, length: int, generator: torch.Generator) -> Batch:
    """batch_size windows of length + 1 tokens at random offsets, as next-token inputs/targets."""
    if len(ids) <= length:
        raise ValueError(f"a window of {length} tokens needs more than the {len(ids)} given")
    starts = torch.randint(0, len(ids) - length, (batch_size,), generator=generator)
    rows = torch.stack([ids[s : s + length + 1] for s in starts.tolist()])
    return {"input_ids": rows[:, :-1], "targets": rows[:, 1:]}


def step_generator(seed: int, step: int) -> torch.Generator:
    """The random source of training step `step`: batches drawn from it are a pure function of
    (seed, step), so every model an experiment compares trains on the same ones."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def window_batches(ids: Tensor, batch_size: int, length: int, seed: int) -> Callable[[int], Batch]:
    """batch(step) for fit(): random windows, a pure function of (seed, step)."""

    def batch(step: int) -> Batch:
        return random_windows(ids, batch_size, length, step_generator(seed, step))

    return batch


@torch.no_grad()
def eval_loss(model: nn.Module, ids: Tensor, length: int, n_windows: int, seed: int = 0) -> float:
    """Mean next-token cross-entropy over n_windows random windows of `length` tokens."""
    model.eval()
    windows = random_windows(ids, n_windows, length, torch.Generator().manual_seed(seed))
    return model.loss(**windows).ce_loss.item()


def unigram_entropy(ids: Tensor) -> float:
    """Entropy (nats) of the token frequencies: the loss of the best model that ignores context,
    the line a trained model must get below."""
    p = torch.bincount(ids).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())
