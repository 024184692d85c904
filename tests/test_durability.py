"""kill -9 in the middle of checkpointing, again and again (issue 12): after every kill `latest`
names a complete checkpoint that loads and resumes, and the run resumed after all the kills
ends bit-for-bit where an uninterrupted run ends.

Each trial starts `python -m glassformer train --resume` on a tiny model that saves after every
step, waits until a save has begun (a new `.tmp-step-*` directory appears) and sends SIGKILL at
once or a random few milliseconds later (up to two saves' length, so kills land while files are
written, between the renames, while `latest` is replaced, while old steps are pruned, or just
after).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from glassformer.train.checkpoint import load, resolve_checkpoint
from glassformer.train.guards import read_resume_state

TRIALS = 20
MAX_STEPS = 60  # each trial advances one or two steps; the rest is trained after the last kill
KILL_WITHIN_S = 0.015  # about two saves of this model on a local disk
TRIAL_TIMEOUT_S = 30.0


def start_training(config: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "glassformer", "train", "--config", str(config)]
    return subprocess.Popen(
        [*command, "--no-progress", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


@contextlib.contextmanager
def reaped(procs: list[subprocess.Popen]):
    """Kill whatever is still running when the test fails half-way."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def save_dirs(run: Path) -> set[str]:
    try:
        return {name for name in os.listdir(run) if name.startswith(".tmp-step-")}
    except FileNotFoundError:
        return set()


def kill_during_a_save(proc: subprocess.Popen, run: Path, delay_s: float) -> bool:
    """SIGKILL `proc` `delay_s` after it starts a save that follows a complete checkpoint.
    Returns whether the save's temporary directory was still there (killed before the rename
    that publishes it)."""
    before = save_dirs(run)
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    while True:
        started = save_dirs(run) - before if (run / "latest").exists() else set()
        if started:
            break
        assert proc.poll() is None, f"training ended before it was killed:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, "no save began in time"
        time.sleep(0.0005)  # a save of this model keeps its temporary directory for ~5 ms
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return bool(started & save_dirs(run))


def final_state(run: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    step_dir = resolve_checkpoint(run)
    assert step_dir.name == f"step-{MAX_STEPS:06d}"
    state, _ = read_resume_state(step_dir)
    return safetensors.torch.load_file(str(step_dir / "model.safetensors")), state["train_losses"]


@pytest.mark.slow
def test_kill_9_while_saving_always_leaves_a_loadable_checkpoint_and_exact_resume(
    tmp_path: Path, tiny_run_config
) -> None:
    configs = {
        name: tiny_run_config(name, max_steps=MAX_STEPS, warmup_steps=2)
        for name in ("killed", "straight")
    }
    run = tmp_path / "killed"
    started = time.monotonic()
    procs = [start_training(configs["straight"])]  # the reference, on the other core
    with reaped(procs):
        rng = random.Random(12)
        mid_write = 0
        resume_from = ""
        for trial in range(TRIALS):
            proc = start_training(configs["killed"], *(["--resume"] if trial else []))
            procs.append(proc)
            # Every other kill comes at once (mid-write), the rest anywhere in the next ~15 ms.
            delay_s = 0.0 if trial % 2 == 0 else rng.uniform(0.0, KILL_WITHIN_S)
            mid_write += kill_during_a_save(proc, run, delay_s)
            output = proc.stdout.read()
            assert resume_from in output and "cannot resume" not in output, output
            if trial:
                assert "taking over the stale lock" in output, output
            step_dir = resolve_checkpoint(run)  # through `latest` (or the aside copy of its step)
            state, _ = read_resume_state(step_dir)  # the newest trainer state is whole
            assert int(re.search(r"step-(\d+)", step_dir.name).group(1)) == state["step"]
            model, tokenizer = load(run)
            assert tokenizer is not None
            assert all(torch.isfinite(p).all() for p in model.parameters())
            resume_from = f"resumed from {step_dir} at step {state['step']}"

        assert mid_write >= 1, "no kill landed while a save was being written"
        finish = start_training(configs["killed"], "--resume")
        procs.append(finish)
        assert finish.wait(timeout=120) == 0, finish.stdout.read()
        assert procs[0].wait(timeout=120) == 0, procs[0].stdout.read()
    weights, losses = final_state(run)
    reference_weights, reference_losses = final_state(tmp_path / "straight")
    assert weights.keys() == reference_weights.keys()
    assert all(torch.equal(weights[k], reference_weights[k]) for k in weights)  # bit-for-bit
    assert losses == reference_losses
    print(
        f"\ndurability: {TRIALS}/{TRIALS} kill -9 trials left a loadable checkpoint"
        f" ({mid_write} while a save was being written, {TRIALS - mid_write} after it was renamed"
        f" into place); resume bit-exact ({time.monotonic() - started:.0f} s)"
    )
