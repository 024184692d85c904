"""What a training run checks before it does any work (seed 000 §2.1's training, made safe):
that the model and one micro-batch fit in memory, that out_dir is a folder, and, on --resume,
that the checkpoint's trainer state is whole and the run's [data] and [model] are unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from glassformer.config import ConfigError, ModelConfig
from glassformer.interop.checkpoint import CheckpointError
from glassformer.memory import available_memory_bytes, check_fits_in_memory, estimated_parameters
from glassformer.train.checkpoint import TRAIN_STATE_FILE, read_train_state
from glassformer.train.config import DataConfig, RunConfig, TrainConfig

# What a resume reads from train_state.json; a state without one of them cannot resume.
RESUME_KEYS = ("step", "train_losses", "optimizer")
# [train] may change on --resume (a longer run, other intervals); [data] and [model] may not.
FROZEN_SECTIONS = ("data", "model")


# Activations kept for backward, per token and layer, in units of d_model floats: the residual
# stream, norms, q/k/v, attention output and the FFN's hidden layer. Deliberately loose.
ACTIVATION_FLOATS_PER_LAYER = 16
TRAIN_BYTES_PER_PARAM = 16  # fp32 weights + gradients + AdamW's two moments


def activation_bytes(model_cfg: ModelConfig, batch_size: int) -> int:
    """About the activation memory of one micro-batch: the logits plus every layer's tensors."""
    layers = model_cfg.n_layers
    if model_cfg.family == "seq2seq":
        layers += model_cfg.n_encoder_layers or model_cfg.n_layers
    per_token = model_cfg.vocab_size + ACTIVATION_FLOATS_PER_LAYER * layers * model_cfg.d_model
    return batch_size * model_cfg.max_seq_len * per_token * 4


def check_training_memory(model_cfg: ModelConfig, cfg: TrainConfig, activations: bool) -> None:
    """Refuse a run that cannot fit in memory before a byte of it is allocated: weights,
    gradients and AdamW moments, plus one micro-batch's activations when `activations`."""
    weights = TRAIN_BYTES_PER_PARAM * estimated_parameters(model_cfg)
    extra = activation_bytes(model_cfg, cfg.batch_size) if activations else 0
    what = (
        f"training a [model] with n_layers={model_cfg.n_layers}, d_model={model_cfg.d_model},"
        f" vocab_size={model_cfg.vocab_size}"
    )
    fix = "use a smaller [model] (n_layers, d_model, vocab_size)"
    if extra > weights:
        what = f"training with train.batch_size={cfg.batch_size}"
        available = available_memory_bytes() or 0
        fits = (available - weights) // activation_bytes(model_cfg, 1)
        at_most = f" to at most {fits:,}" if fits >= 1 else ""
        fix = (
            f"lower train.batch_size={cfg.batch_size}{at_most} and raise"
            f" train.grad_accum_steps={cfg.grad_accum_steps} to keep as many sequences per step,"
            f" or lower model.max_seq_len={model_cfg.max_seq_len}"
        )
    check_fits_in_memory(model_cfg, what, TRAIN_BYTES_PER_PARAM, extra_bytes=extra, fix=fix)


def make_out_dir(out_dir: Path) -> None:
    """Create out_dir, refusing one that is (or lies below) a file."""
    for path in (out_dir, *out_dir.parents):
        if path.exists() and not path.is_dir():
            raise ConfigError(
                f"train.out_dir={str(out_dir)!r} cannot be used: {path} is a file, not a folder;"
                " pick a folder for the checkpoints, e.g. out/run"
            )
        if path.exists():
            break
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create train.out_dir={str(out_dir)!r}: {err.strerror}") from None


def _model_fields(model: dict[str, Any]) -> dict[str, Any]:
    """[model] as the fields it resolves to, so a default written out is not a change."""
    try:
        return RunConfig(model=dict(model)).model_config(vocab_size=1).to_dict()
    except ConfigError:
        return dict(model)  # a config the current code no longer accepts: compare it as written


def _frozen_fields(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    data = {**dataclasses.asdict(DataConfig()), **run.get("data", {})}
    return {"data": data, "model": _model_fields(run.get("model", {}))}


def config_changes(saved: dict[str, Any], run: RunConfig) -> list[str]:
    """The [data] and [model] values that differ between a saved run config and `run`."""
    before, after = _frozen_fields(saved), _frozen_fields(run.to_dict())
    changes = []
    for section in FROZEN_SECTIONS:
        old, new = before[section], after[section]
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                changes.append(f"{section}.{key} ({old.get(key)!r} -> {new.get(key)!r})")
    return changes


def step_number(step_dir: Path) -> int:
    return int(re.search(r"step-(\d+)", step_dir.name).group(1))


def read_resume_state(step_dir: Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The trainer state of a step, checked for everything a resume reads."""
    state, tensors = read_train_state(step_dir)
    missing = [key for key in RESUME_KEYS if key not in state]
    if "rng.torch_cpu" not in tensors:
        missing.append("rng.torch_cpu (in train_state.safetensors)")
    if missing:
        raise CheckpointError(
            f"{step_dir / TRAIN_STATE_FILE} lacks {', '.join(missing)}: it was not written by this"
            " trainer or is damaged"
        )
    losses = state["train_losses"]
    if not isinstance(state["step"], int) or not isinstance(losses, list):
        raise CheckpointError(
            f"{step_dir / TRAIN_STATE_FILE} has step={state['step']!r} and train_losses of type"
            f" {type(losses).__name__}: the file is damaged"
        )
    return state, tensors


@dataclass
class ResumePoint:
    """Where a resume starts: a step folder and its checked trainer state."""

    step_dir: Path
    state: dict[str, Any]  # train_state.json
    tensors: dict[str, Tensor]  # optimizer moments and RNG state
