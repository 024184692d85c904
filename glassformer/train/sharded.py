"""Sharded checkpoints of an FSDP run (train/distributed.py's "fsdp" strategy): every rank writes
its shard of the weights and AdamW moments through torch.distributed.checkpoint, one safetensors
file per rank under step-N/shards/ (nothing pickled), beside the whole weights that generate and
from_pretrained read; a resume reads them back sharded over any number of ranks, or whole in one
process. Names are fully qualified (model.<fqn>, optim.<fqn>.<exp_avg|exp_avg_sq|step>), so any
world size can read them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from glassformer.config import ConfigError

SHARDS_DIR = "shards"  # in a step folder of an FSDP run: one safetensors file per rank


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer):
    """(model, optimizer) state dicts keyed by parameter name, each rank's shards as DTensors
    under FSDP (whole tensors otherwise); AdamW's state is allocated if it is not yet."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer)


def _flat(model_state: dict[str, Any], optim_state: dict[str, Any]) -> dict[str, Tensor]:
    """One flat name -> tensor dict (what the safetensors storage holds): model.<fqn> and
    optim.<fqn>.<exp_avg|exp_avg_sq|step>. The names are fully qualified, so any world size can
    read them back. Tensors are the state dicts' own, so loading into them loads the state."""
    tensors, seen = {}, set()
    for name, tensor in model_state.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.numel() and local.data_ptr() in seen:
            continue  # a tied weight (lm_head = embedding): stored, and loaded, once
        seen.add(local.data_ptr())
        tensors[f"model.{name}"] = tensor
    for name, state in optim_state["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"optim.{name}.{key}"] = value
    return tensors


def _groups_json(optim_state: dict[str, Any]) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters per group (JSON: lr, betas, ...; params by name)."""
    groups = []
    for group in optim_state["param_groups"]:
        plain = {}
        for key, value in group.items():
            if isinstance(value, Tensor):
                value = value.item()
            with contextlib.suppress(TypeError):
                json.dumps(value)
                plain[key] = value
        groups.append(plain)
    return groups


def save_sharded(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> list[dict[str, Any]]:
    """Every rank writes its shard of the weights and AdamW moments to directory/shards/ through
    torch.distributed.checkpoint (one safetensors file per rank; nothing pickled). Returns the
    optimizer's param groups for train_state.json. Collective: every rank calls it."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter, save

    model_state, optim_state = _state_dicts(model, optimizer)
    writer = HuggingFaceStorageWriter(str(directory / SHARDS_DIR), save_distributed=True)
    save(_flat(model_state, optim_state), storage_writer=writer)
    return _groups_json(optim_state)


def full_weights(model: nn.Module) -> dict[str, Tensor]:
    """The whole model's weights gathered on rank 0 (on CPU; empty on the other ranks), for the
    step folder's model.safetensors that generate and from_pretrained read. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def load_sharded(
    directory: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
) -> None:
    """Read directory/shards/ into the model and optimizer as they are now: sharded over any
    number of ranks, or whole in one process (torch.distributed.checkpoint reshards)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model_state, optim_state = _state_dicts(model, optimizer)
    with _quiet_when_alone():
        load(
            _flat(model_state, optim_state),
            storage_reader=HuggingFaceStorageReader(str(directory / SHARDS_DIR)),
        )
    _put_groups(optim_state, groups)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def load_full_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Put a single-process checkpoint's optimizer state (torch's state_dict, keyed by parameter
    index) into the optimizer of a sharded model: each rank keeps its shard of the moments."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    index_to_name = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    by_name = {
        "state": {index_to_name[int(i)]: s for i, s in state_dict["state"].items()},
        "param_groups": [
            {**group, "params": [index_to_name[int(i)] for i in group["params"]]}
            for group in state_dict["param_groups"]
        ],
    }
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, by_name, options=options)


def _put_groups(optim_state: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    current = optim_state["param_groups"]
    if len(groups) != len(current):
        raise ConfigError(
            f"the checkpoint has {len(groups)} optimizer param groups but the optimizer has"
            f" {len(current)}: build the optimizer the same way as the run that saved it"
        )
    for saved, group in zip(groups, current, strict=True):
        for key, value in saved.items():
            if key != "params" and key in group:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value


@contextlib.contextmanager
def _quiet_when_alone() -> Iterator[None]:
    """torch.distributed.checkpoint warns that it loads in a single process when no process
    group exists: that is what a 1-process resume of a sharded checkpoint means to do."""
    import warnings

    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load")
        yield


def sharded_step(step_dir: Path) -> bool:
    """A step written by an FSDP run: weights and moments in per-rank shards."""
    return (step_dir / SHARDS_DIR).is_dir()


def local_part(tensor: Tensor) -> Tensor:
    """This rank's part of a sharded (DTensor) parameter; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
