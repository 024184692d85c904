"""Training checkpoints: one step folder per save, written atomically, holding the model files of
interop/checkpoint.py (safetensors weights, config JSON, tokenizer) plus the trainer's state
(train_state.json, train_state.safetensors), and a `latest` file naming the newest. Nothing here
unpickles: tensors go through safetensors, everything else through JSON. The format's names
are re-exported here for the callers that know them from here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.files import (
    KIND_FILE,
    atomic_write_bytes,
    atomic_write_text,
    fsync_dir,
    fsync_tree,
)
from glassformer.interop.checkpoint import (  # noqa: F401  (re-exported: the format's names)
    CONFIG_FILE,
    LATEST_FILE,
    MODEL_FILE,
    REQUIRED_FILES,
    STEP_DIR_RE,
    TOKENIZER_FILE,
    CheckpointError,
    few,
    list_checkpoints,
    load,
    load_model_weights,
    read_checkpoint_json,
    read_checkpoint_tensors,
    read_config,
    resolve_checkpoint,
    save_model_files,
    save_model_weights,
    step_dir_name,
    weights_to_save,
)

TRAIN_STATE_FILE = "train_state.json"
TRAIN_TENSORS_FILE = "train_state.safetensors"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")  # peft's, config last
RUN_CONFIG_FILE = "run_config.json"  # the trainer's whole TOML config, beside the step dirs
LOCK_FILE = ".lock"  # held by the one trainer writing into a run directory


# --- saving a step ----------------------------------------------------------------------------


def write_step_files(
    directory: Path,
    step: int,
    model_files: Callable[[Path], None],
    train_state: dict[str, Any] | None,
    train_tensors: dict[str, Tensor] | None,
) -> None:
    """A step's files: the model's (model_files(directory)), train_state.json and, if given,
    train_state.safetensors. Nothing is fsynced: commit_step_dir does that."""
    train_state_json = _train_state_json(step, train_state)
    model_files(directory)
    (directory / TRAIN_STATE_FILE).write_text(train_state_json + "\n")
    if train_tensors is not None:
        cpu = {name: t.detach().to("cpu").contiguous() for name, t in train_tensors.items()}
        safetensors.torch.save_file(cpu, str(directory / TRAIN_TENSORS_FILE))


def _train_state_json(step: int, train_state: dict[str, Any] | None) -> str:
    state = {"step": step, **(train_state or {})}
    if state["step"] != step:
        raise ValueError(
            f"train_state['step']={state['step']!r} differs from step={step}: pass the same step"
            " or leave it out of train_state"
        )
    try:
        return json.dumps(state, indent=2, sort_keys=True)
    except TypeError as err:
        raise ValueError(
            f"train_state is not JSON-able ({err}): put tensors in train_tensors and turn other"
            " values into numbers, strings, lists or dicts"
        ) from None


# The hidden files and folders an interrupted save leaves in a run folder: .tmp-step-* and
# .old-step-* folders (commit_step_dir), .NAME.*.tmp files (files.atomic_write_bytes) and
# .tmp-NAME-* files (the adapter copy of older versions).
_RUN_FILES = (LATEST_FILE, RUN_CONFIG_FILE, KIND_FILE, *ADAPTER_FILES)


def _leftover_file(name: str) -> bool:
    return any(
        (name.startswith(f".{known}.") and name.endswith(".tmp"))
        or name.startswith(f".tmp-{known}-")
        for known in _RUN_FILES
    )


def remove_leftovers(out_dir: Path) -> None:
    """Delete what interrupted saves left in `out_dir`: a save's temporary folder holds nothing
    `latest` can reach, and an old step moved aside is put back if its step is missing (a save
    died between its two renames) or deleted if the step is there."""
    for child in out_dir.iterdir():
        name = child.name
        if child.is_dir() and name.startswith((".tmp-step-", ".pruned-step-")):
            shutil.rmtree(child, ignore_errors=True)
        elif child.is_dir() and name.startswith(".old-step-"):
            step = out_dir / name.removeprefix(".old-").rsplit("-", 1)[0]
            if step.exists():
                shutil.rmtree(child, ignore_errors=True)
            else:
                os.replace(child, step)
        elif child.is_file() and _leftover_file(name):
            child.unlink(missing_ok=True)


def _prune(out_dir: Path, keep_last: int, just_written: Path) -> None:
    # Only steps below the one just written are pruned: directories with a higher step come
    # from an abandoned longer run, and deleting them silently would lose someone's work.
    written_step = int(STEP_DIR_RE.match(just_written.name).group(1))
    older = []
    for child in out_dir.iterdir():
        match = STEP_DIR_RE.match(child.name)
        if match and child.is_dir() and int(match.group(1)) < written_step:
            older.append((int(match.group(1)), child))
    older.sort()
    for _, path in older[: max(len(older) - (keep_last - 1), 0)]:
        # Renamed out of sight first: a kill during rmtree must not leave a half-deleted
        # step-NNNNNN that looks like a checkpoint. remove_leftovers finishes the job.
        doomed = out_dir / f".pruned-{path.name}-{secrets.token_hex(4)}"
        os.replace(path, doomed)
        shutil.rmtree(doomed)


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    config: ModelConfig,
    tokenizer: Any | None = None,
    train_state: dict[str, Any] | None = None,
    train_tensors: dict[str, Tensor] | None = None,
    keep_last: int | None = 2,
    model_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write `out_dir/step-NNNNNN/` and point `out_dir/latest` at it; returns the step directory.

    Everything is written to a hidden temporary directory and fsynced, then renamed into place,
    then `latest` is replaced atomically, so a crash at any moment leaves the previous
    checkpoint loadable through `resolve_checkpoint`. `keep_last` older steps survive (None
    keeps all). `tokenizer` is anything with `.save(directory)`. `model_files(directory)`, if
    given, writes the model's files instead (a LoRA run writes its adapters, not the frozen
    base); it must write config.json and model.safetensors, which mark a step complete.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an integer >= 0")
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(
            f"keep_last={keep_last!r} must be an integer >= 1 (the newest checkpoint is always"
            " kept), or None to keep every checkpoint"
        )
    _train_state_json(step, train_state)  # refuse a bad state before touching the disk
    tmp = begin_step_dir(out_dir, step)
    try:
        if model_files is None:
            model_files = functools.partial(
                save_model_files, model=model, config=config, tokenizer=tokenizer
            )
        write_step_files(tmp, step, model_files, train_state, train_tensors)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_step_dir(out_dir, step, tmp, keep_last)


def begin_step_dir(out_dir: str | Path, step: int) -> Path:
    """A new hidden temporary folder in out_dir to write step `step` into (then
    commit_step_dir). Several processes may write into it: the ranks of a sharded run."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{step_dir_name(step)}-", dir=out_dir))
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700 directories
    return tmp


def commit_step_dir(out_dir: str | Path, step: int, tmp: Path, keep_last: int | None = 2) -> Path:
    """Make the complete folder `tmp` step `step` of the run: fsync it, rename it into place,
    then point `latest` at it (each an atomic step, so a crash at any moment leaves `latest`
    naming a complete step), and prune older steps to keep_last. On failure tmp is removed."""
    out_dir = Path(out_dir)
    final = out_dir / step_dir_name(step)
    aside: Path | None = None
    try:
        fsync_tree(tmp)
        if final.exists():
            # A directory cannot be renamed over a non-empty one: move the old one aside first.
            # If we die between the two renames, resolve_checkpoint finds it under .old-*.
            aside = out_dir / f".old-{final.name}-{secrets.token_hex(4)}"
            os.replace(final, aside)
        os.replace(tmp, final)
        fsync_dir(out_dir)
        atomic_write_text(out_dir / LATEST_FILE, final.name + "\n")
    except BaseException:
        if aside is not None and not final.exists():
            # Put the old checkpoint back where `latest` may point; if even that fails,
            # resolve_checkpoint still finds it under .old-*.
            with contextlib.suppress(OSError):
                os.replace(aside, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if aside is not None:
        shutil.rmtree(aside)
    remove_leftovers(out_dir)
    if keep_last is not None:
        _prune(out_dir, keep_last, final)
    return final


def publish_adapter(step_dir: Path, out_dir: Path) -> None:
    """Copy the step's adapter to the run folder, where peft looks for it. Each file is replaced
    atomically; a config that changes (a run started over with another rank) is removed first,
    so a reader never pairs the new weights with the old config: it finds the old adapter, no
    adapter, or the new one."""
    weights, config = ((step_dir / name).read_bytes() for name in ADAPTER_FILES)
    published = out_dir / ADAPTER_FILES[1]
    if published.is_file() and published.read_bytes() != config:
        published.unlink()
        fsync_dir(out_dir)
    atomic_write_bytes(out_dir / ADAPTER_FILES[0], weights)
    if not published.is_file():
        atomic_write_bytes(published, config)


# --- reading the trainer's state --------------------------------------------------------------


def read_train_state(step_dir: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The JSON trainer state and the trainer tensors (empty if none were saved)."""
    step_dir = resolve_checkpoint(step_dir)
    state_file = step_dir / TRAIN_STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(
            f"{step_dir} has no {TRAIN_STATE_FILE}: it holds weights only, so it can be loaded"
            " for generation but training cannot resume from it; start a new run from it instead"
        )
    state = read_checkpoint_json(state_file)
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{state_file} holds {type(state).__name__}, not a trainer state: the file is damaged;"
            " resume from another step"
        )
    tensor_file = step_dir / TRAIN_TENSORS_FILE
    tensors = read_checkpoint_tensors(tensor_file) if tensor_file.exists() else {}
    return state, tensors


def init_matching_weights(model: nn.Module, step_dir: Path) -> None:
    """Copy the checkpoint's tensors that the model has (same name and shape): fine-tuning
    keeps the pretrained encoder, new heads start fresh and unused heads are dropped."""
    from safetensors.torch import load_file

    on_disk = load_file(str(step_dir / "model.safetensors"))
    state = model.state_dict()
    shared = {k: v for k, v in on_disk.items() if k in state and v.shape == state[k].shape}
    if not shared:
        raise ValueError(f"train.init_from={str(step_dir)!r} shares no weights with this model")
    model.load_state_dict(shared, strict=False)
    fresh = sorted(k for k in state if k not in shared)
    unused = sorted(k for k in on_disk if k not in shared)
    print(
        f"initialized {len(shared)} tensors from {step_dir}; new: {', '.join(fresh) or 'none'}; "
        f"not used: {', '.join(unused) or 'none'}"
    )
