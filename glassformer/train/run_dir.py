"""A run directory (out_dir): which files belong to a run, the lock that keeps a second trainer
out of it, what a new run may replace and where a resume starts, and the one-line message a
failed save (a full disk) gives.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from glassformer import json_input
from glassformer.config import ConfigError
from glassformer.files import check_destination, folder_kind, with_article
from glassformer.interop.checkpoint import (
    CONFIG_FILE,
    LATEST_FILE,
    STEP_DIR_RE,
    CheckpointError,
    list_checkpoints,
    resolve_checkpoint,
    step_dir_name,
    weights_to_save,
)
from glassformer.train.checkpoint import LOCK_FILE, RUN_CONFIG_FILE
from glassformer.train.guards import ResumePoint, make_out_dir, read_resume_state, step_number

_LOCK_WRITE_GRACE_S = 10.0  # a lock this young may be empty because its owner is writing it


def previous_run(out_dir: str | Path) -> list[str]:
    """The names in `out_dir` that belong to a training run (step directories, latest,
    run_config.json, leftovers of an interrupted save), sorted; empty for a new folder."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    return sorted(
        child.name
        for child in out_dir.iterdir()
        if STEP_DIR_RE.match(child.name)
        or child.name.startswith((".tmp-step-", ".old-step-", ".pruned-step-"))
        or child.name in (LATEST_FILE, RUN_CONFIG_FILE)
    )


def check_run_folder(out_dir: Path, sources: list[Path], flag: str) -> None:
    """Refuse a run folder that is, holds or sits inside something the run reads (its base model,
    init_from, corpus), that is `/`, home or the current folder (files.check_destination), or
    that holds a model or an adapter rather than a run; then create it."""
    check_destination(out_dir, sources, flag)
    kind = folder_kind(out_dir)
    if kind in ("model", "adapter"):
        raise ConfigError(
            f"{flag}={str(out_dir)!r} holds {with_article(kind)}, not a training run: a run's"
            f" checkpoints would be mixed into it; pick a new folder for the run (load the"
            f" {kind} with --model, or name it as finetune.model / train.init_from)"
        )
    make_out_dir(out_dir)


def remove_step_dirs(out_dir: str | Path, names: list[str], keep: str) -> None:
    """Delete the step directories (and save leftovers) among `names` except `keep`: how a
    run started with --overwrite clears the old run once it has a checkpoint of its own."""
    for name in names:
        path = Path(out_dir) / name
        if name != keep and path.is_dir():
            shutil.rmtree(path)


def newest_checkpoint(out_dir: str | Path) -> Path | None:
    """The step directory a resume would start from; None when the run has none yet."""
    try:
        return resolve_checkpoint(out_dir)
    except CheckpointError:
        return None


def checkpoint_nbytes(model: torch.nn.Module, train_tensors: dict[str, Tensor]) -> int:
    """About how many bytes one checkpoint of `model` and the trainer tensors takes on disk."""
    tensors = [*weights_to_save(model)[0].values(), *train_tensors.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _size(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024:
            return f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024
    return f"{n_bytes:.1f} TiB"


def save_failed(
    out_dir: str | Path, step: int, error: BaseException, previous: Path | None, needed: int
) -> CheckpointError:
    """The one-line error for a save that failed (a full disk, a file size limit): the cause,
    that the previous checkpoint is intact, and what to do. save_checkpoint has already
    removed its temporary directory, so no partial files remain."""
    try:
        free = f"{_size(shutil.disk_usage(out_dir).free)} is free there"
    except OSError:
        free = "the free space there is unknown"
    if previous is not None:
        kept = f"the previous checkpoint {previous.name} is intact ({LATEST_FILE} names it)"
    else:
        kept = "there is no earlier checkpoint"
    return CheckpointError(
        f"could not save {step_dir_name(step)} in {out_dir} ({error}): no partial files were"
        f" left and {kept}; a checkpoint needs about {_size(needed)} and {free}: make room or"
        " set train.out_dir to another disk, then continue with --resume"
    )


class RunLock:
    """`out_dir/.lock`, created with O_CREAT | O_EXCL and holding the owner's pid and host, so
    that two trainers never write into one run. A lock whose process is gone from this host is
    stale and taken over with a note; release() removes the lock only while it is still ours.
    Use it as a context manager, or call acquire() and release()."""

    def __init__(self, out_dir: str | Path, enabled: bool = True) -> None:
        self.path = Path(out_dir) / LOCK_FILE
        self.owner = {"pid": os.getpid(), "host": socket.gethostname()}
        self.held = False
        self.enabled = enabled  # False on the ranks of a multi-process run other than rank 0

    def acquire(self) -> None:
        if self.held or not self.enabled:
            return
        for _attempt in range(3):  # a stale lock is removed, then taken like a missing one
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._remove_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.owner) + "\n")
            self.held = True
            return
        raise CheckpointError(
            f"could not take {self.path}: other trainers keep taking it; run one trainer per"
            " train.out_dir"
        )

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        with contextlib.suppress(FileNotFoundError):
            if _parse_lock(self.path.read_text()) == self.owner:
                os.unlink(self.path)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _remove_if_stale(self) -> None:
        try:
            owner = _parse_lock(self.path.read_text())
            age_s = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile: try again
        if owner is None and age_s < _LOCK_WRITE_GRACE_S:
            raise self._in_use("a trainer that is starting")
        if owner is not None and not _owner_is_gone(owner):
            raise self._in_use(f"pid {owner['pid']} on host {owner['host']}")
        why = f"pid {owner['pid']} is no longer running" if owner else "it is old and unreadable"
        print(f"note: taking over the stale lock {self.path}: {why}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _in_use(self, who: str) -> CheckpointError:
        return CheckpointError(
            f"{self.path.parent} is in use by another trainer ({who}): wait for it to finish,"
            f" stop it, or pick another train.out_dir; if no trainer is running there any more,"
            f" delete {self.path}"
        )


def _parse_lock(text: str) -> dict[str, Any] | None:
    try:
        owner = json_input.loads(text)
    except json.JSONDecodeError:
        return None
    ok = isinstance(owner, dict) and isinstance(owner.get("host"), str)
    pid = owner.get("pid") if ok else None
    return owner if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def _owner_is_gone(owner: dict[str, Any]) -> bool:
    # Only a process on this host can be checked; on Windows os.kill would terminate it.
    if owner["host"] != socket.gethostname() or os.name == "nt":
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, under another user
    return False


def old_run_to_replace(out_dir: Path, resume: bool, overwrite: bool) -> list[str]:
    """What a previous run left in out_dir, for --overwrite to delete once this run saves its
    first checkpoint; an error naming the choices when it holds a run and neither flag is set."""
    found = previous_run(out_dir)
    if resume or not found:
        return []
    shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
    if not overwrite:
        raise ConfigError(
            f"train.out_dir={str(out_dir)!r} already holds a run ({shown}): pass"
            " --resume to continue it or --overwrite to start over, or pick another"
            " train.out_dir"
        )
    print(
        f"note: --overwrite: the old run in {out_dir} ({shown}) is deleted once this"
        " run saves its first checkpoint"
    )
    return found


def resume_point(
    out_dir: Path, check: Callable[[Path, dict[str, Any]], None]
) -> ResumePoint | None:
    """The newest checkpoint of out_dir whose trainer state is intact, passed to check(step_dir,
    state) (the trainer's: max_steps, unchanged [data] and [model]); a damaged newest step falls
    back to the one before it, with a note naming it. None (and a note) when there is none."""
    if (out_dir / CONFIG_FILE).exists():
        raise CheckpointError(
            f"{out_dir} holds a model's config.json at its top, beside the run's steps,"
            " so the model would be mistaken for a checkpoint: move config.json out of the"
            " run folder, then resume"
        )
    newest = newest_checkpoint(out_dir)
    if newest is None:
        print(f"no checkpoint in {out_dir} to resume from: starting fresh")
        return None
    steps = list_checkpoints(out_dir)
    older = [s for s in reversed(steps) if step_number(s) < step_number(newest)]
    damaged: list[str] = []
    for step_dir in [newest, *older]:
        try:
            state, tensors = read_resume_state(step_dir)
        except CheckpointError as err:
            print(f"note: cannot resume from {step_dir.name}: {err}")
            damaged.append(step_dir.name)
            continue
        if damaged:
            print(f"note: resuming from {step_dir.name} instead of the damaged {damaged[0]}")
        check(step_dir, state)
        return ResumePoint(step_dir, state, tensors)
    raise CheckpointError(
        f"no checkpoint in {out_dir} can be resumed ({', '.join(damaged)} are damaged,"
        " see the notes above): start over with --overwrite"
    )


def saved_run_config(out_dir: Path) -> dict[str, Any] | None:
    """out_dir's run_config.json, or None when there is none to compare against (the
    checkpoint alone then decides)."""
    try:
        saved = json_input.loads((out_dir / RUN_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None
