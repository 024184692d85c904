"""The trainer's state as tensors and JSON: AdamW's moments and every RNG, split so that a
checkpoint stores them with safetensors and JSON only (nothing is pickled), and put back so
that a resumed run draws the same random numbers as an uninterrupted one.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor

from glassformer.interop.checkpoint import CheckpointError, few


def optimizer_state_to_tensors(
    optimizer: torch.optim.Optimizer, prefix: str = "optimizer"
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """Split `optimizer.state_dict()` into JSON-able metadata and flat named tensors.

    Tensor keys look like `optimizer.state.3.exp_avg` and `optimizer.param_groups.0.lr` (a
    tensor learning rate); everything else (betas, eps, param indices) goes to the metadata.
    """
    full = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}

    def split(values: dict[str, Any], where: str) -> dict[str, Any]:
        plain, tensor_names = {}, []
        for key, value in values.items():
            if isinstance(value, Tensor):
                tensors[f"{prefix}.{where}.{key}"] = value.detach()
                tensor_names.append(key)
            else:
                try:
                    json.dumps(value)
                except TypeError:
                    raise CheckpointError(
                        f"optimizer {where}.{key}={value!r} ({type(value).__name__}) is neither a"
                        " tensor nor JSON-able: store it as a number, string or list"
                    ) from None
                plain[key] = value
        return {"values": plain, "tensors": tensor_names}

    meta = {
        "prefix": prefix,
        "state": {str(index): split(s, f"state.{index}") for index, s in full["state"].items()},
        "param_groups": [split(g, f"param_groups.{i}") for i, g in enumerate(full["param_groups"])],
    }
    return meta, tensors


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, meta: dict[str, Any], tensors: dict[str, Tensor]
) -> None:
    """Inverse of `optimizer_state_to_tensors`: load the saved state into `optimizer`."""
    state_dict = optimizer_state_dict(optimizer, meta, tensors)
    try:
        optimizer.load_state_dict(state_dict)
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(
            f"the saved optimizer state does not fit this optimizer ({err}): build the model and"
            " optimizer from the checkpoint's config before resuming"
        ) from None


def optimizer_state_dict(
    optimizer: torch.optim.Optimizer, meta: dict[str, Any], tensors: dict[str, Tensor]
) -> dict[str, Any]:
    """The saved state as `optimizer.state_dict()` has it (state and param groups keyed by
    parameter index), with the optimizer's own types where JSON has none (tuples)."""
    prefix = meta.get("prefix", "optimizer")

    def join(entry: dict[str, Any], where: str) -> dict[str, Any]:
        values = dict(entry["values"])
        for key in entry["tensors"]:
            name = f"{prefix}.{where}.{key}"
            if name not in tensors:
                raise CheckpointError(
                    f"optimizer tensor {name} is missing from the trainer state: the checkpoint"
                    " was saved without it; resume with a fresh optimizer instead"
                )
            values[key] = tensors[name]
        return values

    current_groups = optimizer.param_groups
    if len(meta["param_groups"]) != len(current_groups):
        raise CheckpointError(
            f"the checkpoint has {len(meta['param_groups'])} optimizer param groups but the"
            f" optimizer has {len(current_groups)}: build the optimizer the same way as the run"
            " that saved it"
        )
    groups = []
    for i, (entry, current) in enumerate(zip(meta["param_groups"], current_groups, strict=True)):
        group = join(entry, f"param_groups.{i}")
        # JSON has no tuples; give back the optimizer's own types (AdamW's betas is a tuple).
        for key, value in group.items():
            if isinstance(value, list) and isinstance(current.get(key), tuple):
                group[key] = tuple(value)
        groups.append(group)
    state = {int(index): join(entry, f"state.{index}") for index, entry in meta["state"].items()}
    return {"state": state, "param_groups": groups}


def rng_state_tensors(generators: dict[str, torch.Generator] | None = None) -> dict[str, Tensor]:
    """The torch CPU RNG, every CUDA device's RNG and any named generators, as uint8 tensors."""
    tensors = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.torch_cuda.{index}"] = state
    for name, generator in (generators or {}).items():
        tensors[f"rng.generator.{name}"] = generator.get_state()
    return tensors


def restore_rng_state(
    tensors: dict[str, Tensor], generators: dict[str, torch.Generator] | None = None
) -> None:
    """Put back what `rng_state_tensors` saved, so the next random draws repeat exactly."""
    if "rng.torch_cpu" not in tensors:
        raise CheckpointError(
            "rng.torch_cpu is missing from the trainer tensors: the checkpoint was saved without"
            " RNG state, so the run can resume but not reproduce the same random draws"
        )
    torch.set_rng_state(tensors["rng.torch_cpu"])
    cuda = sorted(k for k in tensors if k.startswith("rng.torch_cuda."))
    if cuda and torch.cuda.is_available():
        for key in cuda:
            index = int(key.rsplit(".", 1)[1])
            if index < torch.cuda.device_count():  # fewer GPUs now: restore the ones we have
                torch.cuda.set_rng_state(tensors[key], index)
    for name, generator in (generators or {}).items():
        key = f"rng.generator.{name}"
        if key not in tensors:
            saved = sorted(k.removeprefix("rng.generator.") for k in tensors if "generator." in k)
            raise CheckpointError(
                f"{key} is missing from the trainer tensors: the saved generators are"
                f" {few(saved) or 'none'}; pass the same generator names that were saved"
            )
        generator.set_state(tensors[key])
