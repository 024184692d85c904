"""Where the tensors live: `--device auto|cpu|cuda|mps` for training, generation and inspection.

auto picks a CUDA GPU, then Apple's MPS, then the CPU. Mixed precision follows the device:
bf16 autocast where the device supports it, else fp16 with a gradient scaler (older GPUs).
Timing on an accelerator waits for its queued work first (`synchronize`), or the clock would
measure only how fast Python queues kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DEVICES = ("auto", "cpu", "cuda", "mps")


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def resolve_device(name: str = "auto") -> torch.device:
    """The torch.device that `name` means on this machine; a device it lacks is a ValueError."""
    if name not in DEVICES:
        raise ValueError(f"device={name!r} is not known: pick one of {', '.join(DEVICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if _mps_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' but torch sees no CUDA GPU (torch.cuda.is_available() is False; a "
            "CPU-only torch wheel, or no driver): use --device cpu, or auto"
        )
    if name == "mps" and not _mps_available():
        raise ValueError("device='mps' but torch sees no Apple GPU: use --device cpu, or auto")
    return torch.device(name)


def half_dtype(device: torch.device, dtype: str) -> torch.dtype | None:
    """The autocast dtype for train.dtype on `device`: None for fp32; bf16 becomes fp16 on a
    CUDA GPU without bf16 (before Ampere), which then needs a gradient scaler."""
    if dtype == "fp32":
        return None
    if dtype == "fp16":
        return torch.float16
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """Mixed precision on `device` (nothing when dtype is None: plain fp32)."""
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def grad_scaler(device: torch.device, dtype: torch.dtype | None) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
    if dtype != torch.float16:
        return None
    return torch.amp.GradScaler(device.type)


def synchronize(device: torch.device) -> None:
    """Wait until `device` has finished its queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
