"""What every training step and evaluation uses: batches moved to the device, the mean
validation loss, and the progress bar."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glassformer.devices import autocast
from glassformer.train.tasks import Task


def to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    task: Task,
    batch_size: int,
    n_batches: int,
    half: torch.dtype | None = None,
) -> float:
    """Mean loss over the task's fixed validation batches, on the model's device."""
    model.eval()
    device = next(model.parameters()).device
    losses = []
    for batch in task.val_batches(batch_size, n_batches):
        with autocast(device, half):
            losses.append(model.loss(**to_device(batch, device)).ce_loss.item())
    model.train()
    return sum(losses) / len(losses)


def progress_bar(initial: int, total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(
        initial=initial,
        total=total,
        desc="train",
        unit="step",
        disable=not enabled,
        dynamic_ncols=True,
        mininterval=0.5,
    )
