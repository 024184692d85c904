"""What every loader checks before it trusts a weights file (glassformer checkpoints, Hugging
Face folders, GGUF files): the size a config claims against the tensors the file really holds,
read from headers before anything is allocated; whether the model fits in memory; and, once the
values are read, that none is NaN or infinite. Each check returns a message ("" if all is well)
that the loader raises as its own error type (InteropError, CheckpointError)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from glassformer.config import ConfigError, ModelConfig
from glassformer.memory import check_fits_in_memory, estimated_parameters
from glassformer.models.common import all_finite


class InteropError(ValueError):
    """A checkpoint cannot be loaded or written; the message says which file/tensor and why."""


# What safetensors raises for a damaged file: SafetensorError for a bad header (truncated,
# flipped bytes, a header length past the end), OSError for a file it cannot map (a directory).
UNREADABLE_SAFETENSORS = (SafetensorError, OSError)

# A config may claim a little more than a file holds where a format stores a tensor implicitly;
# a config that belongs to other weights claims several times more (or billions more).
CLAIM_SLACK = 1.5

FP32_BYTES = 4


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header, without reading any values. safetensors
    checks every shape against the data offsets, so the shapes are bounded by the file size."""
    with safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def count_values(shapes: Iterable[Sequence[int]]) -> int:
    return sum(math.prod(shape) for shape in shapes)


def clip(value: object, width: int = 60) -> str:
    """repr(value), cut to `width` characters: a hostile value may be a million-item list."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def short_count(n: int) -> str:
    """177B, 0.8M, 3,072: a parameter count short enough to read in an error message."""
    if n >= 10**9:
        return f"{n / 10**9:,.1f}B"
    if n >= 10**5:
        return f"{n / 10**6:,.1f}M"
    return f"{n:,}"


def oversized_claim(cfg: ModelConfig, held: int, config_source: str, weights_source: str) -> str:
    """A message if `cfg` claims far more parameters than the file holds (`held` values in its
    tensors), else "". The closed-form count allocates nothing, so a config.json that claims
    100,000 layers is refused before a byte of them exists."""
    claimed = estimated_parameters(cfg)
    if claimed <= CLAIM_SLACK * held:
        return ""
    return (
        f"{config_source} claims {cfg.n_layers:,} layers of d_model={cfg.d_model:,} and a "
        f"vocabulary of {cfg.vocab_size:,} ({short_count(claimed)} parameters) but "
        f"{weights_source} holds {short_count(held)} parameters: the config does not belong to "
        "these weights, or the file is damaged; refusing to allocate the model"
    )


def memory_problem(cfg: ModelConfig, what: str, extra_bytes: int = 0) -> str:
    """A message if the float32 model (plus `extra_bytes` read alongside it) would not fit in
    the memory available now, else ""."""
    try:
        check_fits_in_memory(
            cfg,
            what,
            FP32_BYTES,
            extra_bytes,
            fix="free memory, or load a smaller model (a quantized GGUF file still dequantizes "
            "to float32 weights)",
        )
    except ConfigError as err:
        return str(err)
    return ""


def non_finite(name: str, tensor: Tensor) -> str:
    """A message if any value of a float tensor is NaN or infinite ("tensor X has 3 NaN/Inf
    value(s) (of 4,096)"), else ""."""
    if not tensor.is_floating_point() or all_finite(tensor):
        return ""
    bad = tensor.numel() - int(torch.isfinite(tensor).sum())
    return f"tensor {name} has {bad:,} NaN/Inf value(s) (of {tensor.numel():,})"
