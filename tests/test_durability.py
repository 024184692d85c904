"""kill -9 in the middle of checkpointing, again and again (issue 12): after every kill `latest`
names a complete checkpoint that loads and resumes, and the run resumed after all the kills
ends bit-for-bit where an uninterrupted run ends. The same for the folders `convert`, `merge` and
`finetune` write (issue 30): the destination is always the complete old or the complete new
folder and every source is untouched; and Ctrl-C or SIGTERM at random moments stops a `train` or
a LoRA `finetune` run within seconds with its lock released and its newest checkpoint whole (the
fine-tune, resumed after every signal, ends bit for bit where an uninterrupted one ends).

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
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from processes import DEADLINE_S, default_sigint
from trees import tree

from glassformer.train.checkpoint import load, resolve_checkpoint
from glassformer.train.guards import read_resume_state

TRIALS = 20
MAX_STEPS = 60  # each trial advances one or two steps; the rest is trained after the last kill
KILL_WITHIN_S = 0.015  # about two saves of this model on a local disk


def start_cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "glassformer", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=default_sigint,
    )


def start_training(config: Path, *flags: str) -> subprocess.Popen:
    return start_cli("train", "--config", str(config), "--no-progress", *flags)


@contextlib.contextmanager
def reaped(procs: list[subprocess.Popen]):
    """Kill whatever is still running when the test fails half-way."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


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
    deadline = time.monotonic() + DEADLINE_S
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
        assert finish.wait(timeout=DEADLINE_S) == 0, finish.stdout.read()
        assert procs[0].wait(timeout=DEADLINE_S) == 0, procs[0].stdout.read()
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


# --- issue 30: kill -9 while convert, merge and finetune write, again and again ------------------

FOLDER_TRIALS = 20
FOLDER_KILL_WITHIN_S = 0.1  # a tiny model's folder write, fsyncs included, takes 15-80 ms here


def hidden_beside(dest: Path, stage: str = "") -> set[str]:
    """The hidden folders of a write to `dest` (files.write_folder): .DEST.gf-new-* while the new
    folder is built, .DEST.gf-del-* while the old one is deleted after the swap."""
    prefix = f".{dest.name}.gf-{stage}"
    return {name for name in os.listdir(dest.parent) if name.startswith(prefix)}


def kill_while_writing(proc: subprocess.Popen, dest: Path, stage: str, delay_s: float) -> bool:
    """SIGKILL `proc` `delay_s` after a hidden folder of `stage` appears beside `dest` ("new":
    the write began; "del": the swap is done and the old folder is being deleted); True if a
    hidden folder was still there when the kill landed."""
    deadline = time.monotonic() + DEADLINE_S
    while not hidden_beside(dest, stage):
        if proc.poll() is not None:
            return False  # it finished between two looks: a complete write
        assert time.monotonic() < deadline, "no folder write began in time"
        time.sleep(0.0002)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return bool(hidden_beside(dest))


def trial_folder_writes(args: list[str], dest: Path, old: Path, sources: list[Path]) -> str:
    """Kill `args` (which writes `dest`, holding a copy of `old`) FOLDER_TRIALS times while it
    writes; after every kill `dest` is the complete old or the complete new folder and every
    source is as it was. Returns a summary line."""
    reference = dest.parent / f"{dest.name}-reference"
    assert subprocess.run([sys.executable, "-m", "glassformer", *args[:-1], str(reference)],
                          capture_output=True).returncode == 0  # fmt: skip
    new = tree(reference)
    old_tree = tree(old)
    assert new != old_tree
    before = {source: tree(source) for source in sources}
    rng = random.Random(30)
    outcomes = {"old": 0, "new": 0}
    mid_write = 0
    for trial in range(FOLDER_TRIALS):
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(old, dest)
        proc = start_cli(*args, "--overwrite")
        try:
            # A third at once as the write begins, a third anywhere in the next 100 ms, a third
            # just after the swap, while the old folder is deleted.
            stage = "del" if trial % 3 == 2 else "new"
            delay_s = rng.uniform(0.0, FOLDER_KILL_WITHIN_S) if trial % 3 == 1 else 0.0
            mid_write += kill_while_writing(proc, dest, stage, delay_s)
        finally:
            if proc.poll() is None:
                proc.kill()
            output = proc.communicate()[0]
        now = tree(dest)
        assert now in (old_tree, new), f"trial {trial}: a mixed folder\n{output}"
        outcomes["old" if now == old_tree else "new"] += 1
        assert {source: tree(source) for source in sources} == before, f"trial {trial}"
    assert mid_write >= 1, "no kill landed while a folder was being written"
    assert outcomes["old"] >= 1 and outcomes["new"] >= 1, outcomes
    finish = subprocess.run(
        [sys.executable, "-m", "glassformer", *args, "--overwrite"], capture_output=True, text=True
    )
    assert finish.returncode == 0, finish.stderr
    assert tree(dest) == new and not hidden_beside(dest)  # leftovers of the kills are gone
    return (
        f"{FOLDER_TRIALS} kill -9 trials: {outcomes['old']} left the old folder,"
        f" {outcomes['new']} the new one, none a mix ({mid_write} mid-write); sources unchanged"
    )


@pytest.fixture
def folder_setting(tiny_models, tmp_path: Path):
    """Two different complete models to write: `merged` (base_hf + the LoRA adapter) and the old
    content of the destination (base converted)."""
    from glassformer.cli import main

    old = tmp_path / "old"
    assert main(["convert", str(tiny_models.base), "--to", "hf", str(old)]) == 0
    return tiny_models, old


@pytest.mark.slow
def test_kill_9_during_convert_leaves_the_old_or_the_new_folder(folder_setting, tmp_path):
    tiny, old = folder_setting
    dest = tmp_path / "dest"
    args = ["convert", str(tiny.base / "step-000002"), "--to", "hf", str(dest)]
    print("\nconvert:", trial_folder_writes(args, dest, old, [tiny.base]))


@pytest.mark.slow
def test_kill_9_during_merge_leaves_the_old_or_the_new_folder(folder_setting, tmp_path):
    tiny, old = folder_setting
    dest = tmp_path / "dest"
    args = ["merge", "--model", str(tiny.base_hf), "--adapter", str(tiny.lora), "--out", str(dest)]
    print("\nmerge:", trial_folder_writes(args, dest, old, [tiny.base_hf, tiny.lora]))


FINETUNE_STEPS = 40


@pytest.mark.slow
def test_kill_9_during_finetune_saves_keeps_a_whole_checkpoint_and_adapter(
    tiny_models, tmp_path: Path
) -> None:
    base = tiny_models.base_hf
    base_before = tree(base)
    flags = [*tiny_models.finetune, "--model", str(base), "--steps", str(FINETUNE_STEPS)]
    flags += ["--checkpoint-interval", "1"]
    run, straight = tmp_path / "killed", tmp_path / "straight"
    reference = start_cli(*flags, "--out", str(straight))  # uninterrupted, on the other core
    rng = random.Random(31)
    seen: set[str] = set()  # the adapter weights of every step seen on disk
    mid_write = 0
    try:
        for trial in range(FOLDER_TRIALS):
            proc = start_cli(*flags, "--out", str(run), *(["--resume"] if trial else []))
            try:
                delay_s = 0.0 if trial % 2 == 0 else rng.uniform(0.0, KILL_WITHIN_S)
                mid_write += kill_during_a_save(proc, run, delay_s)
            finally:
                if proc.poll() is None:
                    proc.kill()
                output = proc.communicate()[0]
            step_dir = resolve_checkpoint(run)  # `latest` names a complete step
            state, _ = read_resume_state(step_dir)
            assert step_dir.name == f"step-{state['step']:06d}", output
            for step in run.glob("step-*"):
                seen.add(tree(step)["adapter_model.safetensors"])
            published = tree(run)
            # The folder peft reads holds a whole adapter of some saved step, never a mix.
            assert published["adapter_model.safetensors"] in seen, f"trial {trial}\n{output}"
            assert published["adapter_config.json"] == tree(step_dir)["adapter_config.json"]
            assert tree(base) == base_before
        assert mid_write >= 1, "no kill landed while a save was being written"
        finish = start_cli(*flags, "--out", str(run), "--resume")
        assert finish.wait(timeout=DEADLINE_S) == 0, finish.communicate()[0]
        assert reference.wait(timeout=DEADLINE_S) == 0, reference.communicate()[0]
    finally:
        for proc in (reference,):
            if proc.poll() is None:
                proc.kill()
    last, straight_last = tree(resolve_checkpoint(run)), tree(resolve_checkpoint(straight))
    assert last["adapter_model.safetensors"] == straight_last["adapter_model.safetensors"]
    assert tree(run)["adapter_model.safetensors"] == last["adapter_model.safetensors"]
    hidden = [p.name for p in run.iterdir() if p.name.startswith(".") and p.name != ".lock"]
    assert not hidden, hidden  # what the kills left was cleaned up
    print(
        f"\nfinetune: {FOLDER_TRIALS} kill -9 trials ({mid_write} mid-save): every one left a"
        " whole checkpoint and a whole adapter; resumed bit-exact; base unchanged"
    )


# --- issue 30: Ctrl-C and SIGTERM at random moments -----------------------------------------------


def test_ctrl_c_while_glassformer_imports_exits_130_without_a_traceback() -> None:
    """A Ctrl-C during `import glassformer` (torch's import, over a second here): our exit,
    130 and one line. Python's own handler raises KeyboardInterrupt wherever the import is: a
    traceback and a death by SIGINT, or inside a dataclass's __set_name__ a RuntimeError and
    exit status 1 (seen once in the signal trials below)."""
    code = "print('importing', flush=True); import glassformer; import time; time.sleep(60)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint,
    )  # fmt: skip
    with reaped([proc]):
        assert proc.stdout.readline() == "importing\n"
        time.sleep(0.2)  # inside glassformer's imports, which take over a second
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=STOPPED_WITHIN_S)
    assert proc.returncode == 130, (proc.returncode, err)
    assert err == "\ninterrupted (SIGINT)\n", err


SIGNAL_TRIALS = 16
STOPPED_WITHIN_S = 10.0


@pytest.mark.slow
def test_ctrl_c_or_sigterm_at_any_moment_stops_the_run_and_releases_the_lock(
    tmp_path: Path, tiny_run_config
) -> None:
    config = tiny_run_config("run", max_steps=100_000, keep_checkpoints=2)
    run = tmp_path / "run"
    rng = random.Random(32)
    stopped_in = []
    for trial in range(SIGNAL_TRIALS):
        signum = (signal.SIGINT, signal.SIGTERM)[trial % 2]
        # --resume once an earlier trial left the run folder: a signal after run_config.json
        # was written but before the first checkpoint leaves a run with nothing to resume,
        # which --resume starts afresh and a plain start refuses.
        proc = start_training(config, *(["--resume"] if run.exists() else []))
        with reaped([proc]):
            if trial % 4 == 3:  # any moment of the process: imports, building, training
                time.sleep(rng.uniform(0.0, 2.5))
            else:  # once the trainer holds the run: building, evaluating, training, saving
                deadline = time.monotonic() + DEADLINE_S
                while not (run / ".lock").exists() and proc.poll() is None:
                    assert time.monotonic() < deadline, "the trainer never took its lock"
                    time.sleep(0.001)
                time.sleep(rng.uniform(0.0, 1.5))
            sent = time.monotonic()
            proc.send_signal(signum)
            output = proc.communicate(timeout=STOPPED_WITHIN_S)[0]
            stopped_in.append(time.monotonic() - sent)
        # Our handler: 128 + signum; a signal during Python's own start-up: killed by it.
        assert proc.returncode in (128 + signum, -signum), (proc.returncode, output)
        if proc.returncode == 128 + signum:
            assert "Traceback" not in output, output
        assert not (run / ".lock").exists(), f"trial {trial}: the lock was left\n{output}"
        if (run / "latest").exists():
            load(run)  # the newest checkpoint is whole
    print(
        f"\nsignals: {SIGNAL_TRIALS} SIGINT/SIGTERM trials stopped in at most"
        f" {max(stopped_in):.2f} s (median {sorted(stopped_in)[len(stopped_in) // 2]:.2f} s);"
        " lock released and the newest checkpoint whole every time"
    )


FINETUNE_SIGNAL_STEPS = 200  # each trial advances a few steps; the rest is trained after the last
# (40 were too few: a quiet CI machine trained all of them within the start-up trial's 1.9 s)
# When each trial's signal lands: SIGINT (even trials) once the run holds its lock, since a
# Ctrl-C while Python still imports torch is Python's own KeyboardInterrupt traceback, before
# any glassformer code runs; SIGTERM (odd trials) from the very start too.
MOMENTS = ("building", "start-up", "saving", "saving", "training")


def newest_step(run: Path) -> int:
    """The step `latest` names (0 before the first checkpoint)."""
    try:
        return int((run / "latest").read_text().strip().rsplit("-", 1)[-1])
    except (FileNotFoundError, ValueError):
        return 0


def wait_for(condition, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}:\n{proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"{what} did not come in time"
        time.sleep(0.0005)


def signal_at(proc: subprocess.Popen, run: Path, moment: str, signum: int, rng: random.Random):
    """Send `signum` at `moment` of a fine-tune resumed into `run`."""
    if moment == "start-up":  # anywhere: imports, reading the flags, building, training
        time.sleep(rng.uniform(0.0, 3.0))
    else:
        wait_for(lambda: (run / ".lock").exists(), proc, "the run took its lock")
        start = newest_step(run)
        if moment == "building":  # loading the base, tokenizing the data, the baseline loss
            time.sleep(rng.uniform(0.0, 0.5))
        elif moment == "saving":  # a checkpoint being written: it is finished first
            before = save_dirs(run)
            wait_for(lambda: save_dirs(run) - before, proc, "a save")
            time.sleep(rng.uniform(0.0, KILL_WITHIN_S))
        else:  # a step or two after the last checkpoint, anywhere in the next step
            target = start + rng.randint(1, 2)
            wait_for(lambda: newest_step(run) >= target, proc, f"step {target}")
            time.sleep(rng.uniform(0.0, 0.05))
    proc.send_signal(signum)


@pytest.mark.slow
def test_ctrl_c_or_sigterm_at_any_moment_of_a_lora_finetune_loses_nothing(
    tiny_models, tmp_path: Path
) -> None:
    flags = [*tiny_models.finetune, "--model", str(tiny_models.base_hf)]
    flags += ["--steps", str(FINETUNE_SIGNAL_STEPS), "--checkpoint-interval", "1"]
    run, straight = tmp_path / "signalled", tmp_path / "straight"
    reference = start_cli(*flags, "--out", str(straight))  # uninterrupted
    rng = random.Random(33)
    stopped_in, outcomes, newest = [], [], 0
    try:
        for trial, moment in enumerate(MOMENTS):
            signum = (signal.SIGINT, signal.SIGTERM)[trial % 2]
            proc = start_cli(*flags, "--out", str(run), "--resume")
            with reaped([proc]):
                signal_at(proc, run, moment, signum, rng)
                sent = time.monotonic()
                output = proc.communicate(timeout=STOPPED_WITHIN_S)[0]
                stopped_in.append(time.monotonic() - sent)
            # Our handler: 128 + signum; SIGTERM before the handler is set: killed by it.
            assert proc.returncode in (128 + signum, -signum), (trial, proc.returncode, output)
            assert "Traceback" not in output, output
            assert not (run / ".lock").exists(), f"trial {trial}: the lock was left\n{output}"
            assert not save_dirs(run), f"trial {trial}: a save was cut short\n{output}"
            name = signal.Signals(signum).name
            outcomes.append(f"{moment} {name}: {proc.returncode} in {stopped_in[-1]:.2f} s")
            if not (run / "latest").exists():
                continue
            step_dir = resolve_checkpoint(run)
            state, _ = read_resume_state(step_dir)
            assert step_dir.name == f"step-{state['step']:06d}", output
            assert state["step"] >= newest, f"trial {trial}: a saved step was lost\n{output}"
            newest = state["step"]
            published = tree(run)  # the adapter peft reads is the newest checkpoint's
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                assert published[name] == tree(step_dir)[name], f"trial {trial}: {name}"
        assert 0 < newest < FINETUNE_SIGNAL_STEPS, newest
        finish = start_cli(*flags, "--out", str(run), "--resume")
        assert finish.wait(timeout=DEADLINE_S) == 0, finish.communicate()[0]
        assert reference.wait(timeout=DEADLINE_S) == 0, reference.communicate()[0]
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.communicate()
    last, straight_last = tree(resolve_checkpoint(run)), tree(resolve_checkpoint(straight))
    assert last["adapter_model.safetensors"] == straight_last["adapter_model.safetensors"]
    print(
        f"\nfinetune signals: {len(MOMENTS)} SIGINT/SIGTERM trials ({'; '.join(outcomes)})"
        "; lock released, no save cut short, the"
        f" newest checkpoint whole and published; resumed to step {FINETUNE_SIGNAL_STEPS}"
        " bit-exact"
    )
