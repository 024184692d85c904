"""The one folder writer (files.write_folder, issue 30): every way `finetune`, `merge` and `convert`
were found to destroy a model is refused with one line and leaves every source bit for bit as it
was; an overwrite swaps whole folders (a reader never sees a mix), never writes through a
symlink, and a failed or killed write leaves the old folder and no leftovers."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from trees import tree

from glassformer.cli import main
from glassformer.files import FolderError, clean_leftovers, folder_kind, swap_in, write_folder
from glassformer.interop.checkpoint import load
from glassformer.interop.integrity import InteropError
from glassformer.interop.peft import load_adapter, save_adapter
from glassformer.interop.pretrained import from_pretrained
from glassformer.nn.lora import apply_lora


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.fixture
def models(tiny_models, tmp_path):
    """A private copy of the tiny models (base run, base-hf, LoRA run) for a test to attack."""
    import shutil

    for name in ("base", "base-hf", "lora1"):
        shutil.copytree(tiny_models.root / name, tmp_path / name, symlinks=True)
    return tmp_path


def finetune(tiny_models, *flags: str) -> int:
    return main([*tiny_models.finetune, *flags])


# --- issue 30's data-loss cases ----------------------------------------------------------------


def test_finetuning_a_model_into_its_own_folder_is_refused_and_the_model_is_untouched(
    tiny_models, models: Path, capsys
) -> None:
    base, full = models / "base-hf", models / "full"
    assert finetune(tiny_models, "--method", "full", "--model", str(base), "--out", str(full)) == 0
    capsys.readouterr()
    before = {base: tree(base), full: tree(full)}
    assert finetune(tiny_models, "--model", str(full), "--out", str(full), "--overwrite") == 2
    assert f"--out {full} is {full}, which this command reads from" in one_error_line(capsys)
    assert finetune(tiny_models, "--model", str(base), "--out", str(base)) == 2
    assert f"--out {base} is {base}" in one_error_line(capsys)
    assert finetune(tiny_models, "--model", str(base), "--out", str(base / "sub")) == 2
    assert "is inside" in one_error_line(capsys)
    assert {folder: tree(folder) for folder in before} == before
    assert from_pretrained(full)[0] is not None and from_pretrained(base)[0] is not None


@pytest.mark.parametrize(
    ("adapter", "out", "named"),
    [
        ("lora1", "lora1", "is"),  # the run folder peft reads
        ("lora1/step-000004", "lora1", "holds"),  # the run around the adapter's step
        ("lora1", "lora1/step-000002", "is inside"),  # a checkpoint's trainer state
    ],
)
def test_merge_never_writes_into_the_adapters_run(
    models: Path, capsys, adapter: str, out: str, named: str
) -> None:
    before = tree(models)
    args = ["merge", "--model", str(models / "base-hf"), "--adapter", str(models / adapter)]
    assert main([*args, "--out", str(models / out), "--overwrite"]) == 2
    assert f"--out {models / out} {named} " in one_error_line(capsys)
    assert tree(models) == before


def test_merge_refuses_an_out_that_holds_its_base(models: Path, capsys) -> None:
    inner = models / "outer" / "base-hf"
    inner.parent.mkdir()
    os.rename(models / "base-hf", inner)
    before = tree(models)
    args = ["merge", "--model", str(inner), "--adapter", str(models / "lora1")]
    assert main([*args, "--out", str(inner.parent), "--overwrite"]) == 2
    assert f"holds {inner}" in one_error_line(capsys)
    assert tree(models) == before


def test_convert_overwrite_never_writes_through_the_links_of_a_folder(models: Path, capsys) -> None:
    # The Hugging Face cache's layout: a snapshot folder of links into another model's files.
    third, links = models / "third-model", models / "snapshot"
    assert main(["convert", str(models / "base"), "--to", "hf", str(third)]) == 0
    links.mkdir()
    for name in os.listdir(third):
        os.symlink(third / name, links / name)
    third_before = tree(third)
    assert main(["convert", str(models / "lora1"), "--to", "hf", str(links)]) == 2  # an adapter
    capsys.readouterr()
    merged = models / "merged"
    adapter = ["--adapter", str(models / "lora1")]
    assert main(["merge", "--model", str(models / "base-hf"), *adapter, "--out", str(merged)]) == 0
    assert main(["convert", str(merged), "--to", "hf", str(links), "--overwrite"]) == 0
    assert tree(third) == third_before
    assert not any(path.is_symlink() for path in links.iterdir())
    assert (links / "model.safetensors").read_bytes() != (third / "model.safetensors").read_bytes()
    assert json.loads((links / "glassformer.json").read_text())["kind"] == "model"


@pytest.mark.parametrize("out", ["", "/", "~", ".", ".."])
def test_empty_root_home_and_current_folders_are_never_a_destination(
    models: Path, monkeypatch, capsys, out: str
) -> None:
    home, work = models / "home", models / "elsewhere" / "work"
    work.mkdir(parents=True)
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    target = str(home) if out == "~" else out
    before = tree(models)
    assert main(["convert", str(models / "base"), "--to", "hf", target, "--overwrite"]) == 2
    err = one_error_line(capsys)
    expected = {
        "": "is an empty path",
        "/": "is the root folder",
        "~": "is your home folder",
        ".": "is the current folder",
        "..": "holds the current folder",
    }[out]
    assert expected in err
    assert tree(models) == before


def test_overwrite_replaces_only_a_folder_of_the_same_kind(models: Path, capsys) -> None:
    notes = models / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    before = tree(models)
    convert = ["convert", str(models / "base"), "--to", "hf"]
    for out, held in [("lora1", "a run"), ("notes", "files that are not a model")]:
        assert main([*convert, str(models / out), "--overwrite"]) == 2
        assert f"holds {held}, not a model" in one_error_line(capsys)
    assert main([*convert, str(models / "base-hf")]) == 2  # a model, but no --overwrite
    assert "already holds a model: pass --overwrite" in one_error_line(capsys)
    assert tree(models) == before


def test_train_into_a_model_folder_is_refused(models: Path, tiny_run_config, capsys) -> None:
    # Once an AttributeError in guards.step_number: a model folder is no run to resume.
    config = tiny_run_config("x")
    before = tree(models / "base-hf")
    flags = ["--set", f"train.out_dir={json.dumps(str(models / 'base-hf'))}", "--no-progress"]
    for extra in ([], ["--resume"], ["--overwrite"]):
        assert main(["train", "--config", str(config), *flags, *extra]) == 2
        assert "holds a model, not a training run" in one_error_line(capsys)
    assert tree(models / "base-hf") == before


def test_resuming_a_finished_lora_run_reports_it_and_succeeds(tiny_models, models, capsys):
    # Once a TypeError: no step ran, so there was no validation loss to print.
    before = tree(models / "lora1")
    base = ["--model", str(tiny_models.base_hf), "--out", str(models / "lora1")]  # its own base
    assert finetune(tiny_models, *base, "--resume") == 0
    out = capsys.readouterr().out
    assert "nothing to train: the run is already at step 4 of 4" in out
    assert "done: 4 steps | val loss" in out
    after = tree(models / "lora1")
    assert after.pop("run_config.json") and after == {
        k: v for k, v in before.items() if k != "run_config.json"
    }  # the checkpoints and the adapter as they were


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from glassformer.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("command", ["convert", "merge"])
def test_a_full_disk_during_convert_or_merge_is_one_line_and_changes_nothing(
    models: Path, command: str
) -> None:
    out = models / "out"
    lora = ["--adapter", str(models / "lora1")]
    first = {
        "convert": ["convert", str(models / "base"), "--to", "hf", str(out)],
        "merge": ["merge", "--model", str(models / "base-hf"), *lora, "--out", str(out)],
    }[command]
    assert main(first) == 0
    before = tree(models)
    # model.safetensors (~22 KB) cannot be written under a 16 KB file size limit.
    assert (out / "model.safetensors").stat().st_size > 16_384
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, "16384", *first, "--overwrite"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith(f"error: could not write {out}") and "Traceback" not in proc.stderr
    assert "nothing was changed" in err and "no partial files" in err
    assert tree(models) == before  # out is whole, nothing hidden is left beside it


# --- write_folder itself -----------------------------------------------------------------------


def test_a_reader_sees_the_whole_old_or_the_whole_new_folder_during_swaps(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    contents = [{f"f{i}.txt": f"{version}-{i}" for i in range(5)} for version in ("a", "b")]
    for name, text in contents[0].items():
        dest.mkdir(exist_ok=True)
        (dest / name).write_text(text)
    (dest / "glassformer.json").write_text('{"kind": "model"}')
    seen: list[dict[str, str]] = []
    done = threading.Event()

    def snapshot() -> dict[str, str] | None:
        # The folder at `dest`, its files read through the folder opened once (by path, a name
        # listed in one folder could be read from the next). None if it was swapped out before
        # the reading ended: what was read may be the old folder being deleted.
        try:
            folder = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return {"missing": ""}  # no folder at all at that instant
        try:
            files = {}
            for name in sorted(os.listdir(folder)):
                fd = os.open(name, os.O_RDONLY, dir_fd=folder)
                with os.fdopen(fd) as f:
                    files[name] = f.read()
        except FileNotFoundError:
            return None
        finally:
            still_there = os.fstat(folder).st_ino == os.stat(dest).st_ino
            os.close(folder)
        return files if still_there else None

    def read() -> None:
        while not done.is_set():
            found = snapshot()
            if found is not None:
                seen.append(found)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for swap in range(200):
            with write_folder(dest, "model", overwrite=True) as tmp:
                for name, text in contents[(swap + 1) % 2].items():
                    (tmp / name).write_text(text)
    finally:
        done.set()
        reader.join()
    wholes = [{**c, "glassformer.json": ""} for c in contents]
    mixed = [
        s
        for s in seen
        if {k: (v if k != "glassformer.json" else "") for k, v in s.items()} not in wholes
    ]
    assert len(seen) > 200 and not mixed, mixed[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no hidden folders left


def test_a_write_that_fails_leaves_the_old_folder_and_no_leftovers(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    with write_folder(dest, "model") as tmp:
        (tmp / "config.json").write_text("{}")
    before = tree(dest)
    failing = pytest.raises(FolderError, match="nothing was changed")
    with failing, write_folder(dest, "model", overwrite=True) as tmp:
        (tmp / "config.json").write_text('{"new": 1}')
        raise OSError(28, "No space left on device")
    with pytest.raises(KeyError), write_folder(dest, "model", overwrite=True):
        raise KeyError("a bug")
    assert tree(dest) == before and folder_kind(dest) == "model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_killed_writes_are_cleaned_and_an_old_folder_aside_is_put_back(
    tmp_path: Path,
) -> None:
    dest, pid = tmp_path / "model", _dead_pid()
    old = tmp_path / f".model.gf-old-{pid}-0a0b0c0d"  # died between the two renames
    old.mkdir()
    (old / "config.json").write_text("old")
    for stage in ("new", "del"):
        (tmp_path / f".model.gf-{stage}-{pid}-01020304").mkdir()
    alive = tmp_path / f".model.gf-new-{os.getppid()}-05060708"  # a writer still at work
    alive.mkdir()
    clean_leftovers(dest)
    assert (dest / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name, "model"]


def test_swap_in_puts_a_new_folder_where_there_was_none(tmp_path: Path) -> None:
    new, dest = tmp_path / "new", tmp_path / "dest"
    new.mkdir()
    (new / "a").write_text("1")
    swap_in(new, dest)
    assert tree(dest) == {"a": hashlib.sha256(b"1").hexdigest()} and not new.exists()


def test_a_killed_runs_temporary_files_are_removed_when_it_resumes(
    tiny_models, models: Path
) -> None:
    run = models / "lora1"
    junk = [".latest.k2j3h4.tmp", ".tmp-adapter_model.safetensors-x1y2", ".run_config.json.a.tmp"]
    for name in junk:
        (run / name).write_text("half")
    (run / ".tmp-step-000006-abcd").mkdir()
    (run / ".pruned-step-000001-abcd").mkdir()  # killed while deleting a pruned step
    (run / ".pruned-step-000001-abcd" / "config.json").write_text("{}")
    step4 = run / "step-000004"
    os.rename(step4, run / ".old-step-000004-1234abcd")  # died between a save's two renames
    before = tree(run)
    base = ["--model", str(tiny_models.base_hf), "--out", str(run)]  # the run's own base
    assert finetune(tiny_models, *base, "--resume") == 0
    names = sorted(p.name for p in run.iterdir())
    assert not [name for name in names if name.startswith(".") and name != ".lock"], names
    assert tree(step4) == {
        k.split("/", 1)[1]: v for k, v in before.items() if k.startswith(".old-step-000004")
    }


def test_without_an_atomic_exchange_two_renames_swap_the_folder(tmp_path: Path, monkeypatch):
    # Where renameat2 is missing (macOS, old kernels): the old folder aside, the new one in.
    import glassformer.files

    monkeypatch.setattr(glassformer.files, "_exchange", lambda a, b: False)
    dest = tmp_path / "model"
    for text in ("old", "new"):
        with write_folder(dest, "model", overwrite=True) as tmp:
            (tmp / "config.json").write_text(text)
    assert (dest / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_resume_of_a_run_with_a_config_json_at_its_top_is_one_line(
    tiny_run_config, tmp_path: Path, capsys
) -> None:
    # Once an AttributeError in guards.step_number: the folder itself looked like a checkpoint.
    config = tiny_run_config("run", max_steps=2)
    assert main(["train", "--config", str(config), "--no-progress"]) == 0
    (tmp_path / "run" / "config.json").write_text("{}")
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--no-progress", "--resume"]) == 2
    assert "holds a model's config.json at its top" in one_error_line(capsys)


def test_a_kill_while_pruning_an_old_step_never_leaves_a_half_deleted_step(
    tmp_path: Path, monkeypatch
) -> None:
    # The CI failure of 2026-12-03: a kill -9 inside rmtree of a pruned step left step-NNNNNN
    # with some files gone. An old step leaves sight with one rename before it is deleted.
    import shutil

    from glassformer.train import checkpoint

    def save(step: int) -> None:
        tmp = checkpoint.begin_step_dir(tmp_path, step)
        for name in ("config.json", "model.safetensors", "adapter_model.safetensors"):
            (tmp / name).write_text(f"{name} {step}")
        checkpoint.commit_step_dir(tmp_path, step, tmp, keep_last=2)

    save(1)
    save(2)
    real_rmtree = shutil.rmtree

    def killed_halfway(path, *args, **kwargs):  # deletes one file, then the process "dies"
        next(p for p in Path(path).iterdir() if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        save(3)  # prunes step 1
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    for step in tmp_path.glob("step-*"):  # whatever a reader sees is a whole step
        assert sorted(p.name for p in step.iterdir()) == [
            "adapter_model.safetensors", "config.json", "model.safetensors"
        ], step  # fmt: skip
    checkpoint.remove_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002", "step-000003"]


# --- destinations refused whatever the flags (files.check_destination) ---------------------------


def test_a_destination_that_is_a_symlink_is_refused_and_nothing_behind_it_changes(
    models: Path, capsys
) -> None:
    link, dangling = models / "link", models / "dangling"
    os.symlink(models / "base-hf", link)  # a link to a model of the same kind
    os.symlink(models / "nowhere", dangling)  # a link to nothing yet
    before = tree(models)
    for out, target in [(link, models / "base-hf"), (dangling, models / "nowhere")]:
        assert main(["convert", str(models / "base"), "--to", "hf", str(out), "--overwrite"]) == 2
        assert f"{out} is a symlink to {target}: glassformer never writes through a link" in (
            one_error_line(capsys)
        )
    assert tree(models) == before and link.is_symlink() and not (models / "nowhere").exists()


def test_an_out_path_that_is_not_utf8_is_one_line_and_creates_nothing(models: Path, capsys):
    out = os.fsdecode(bytes(models / "out") + b"-\xff")  # how Python reads such bytes in argv
    before = tree(models)
    assert main(["convert", str(models / "base"), "--to", "hf", out]) == 2
    assert "-\\udcff' is not valid UTF-8: give a folder name in UTF-8" in one_error_line(capsys)
    assert tree(models) == before and sorted(os.listdir(models)) == ["base", "base-hf", "lora1"]


@pytest.mark.parametrize("command", ["convert", "merge", "finetune"])
def test_an_empty_out_is_refused_without_overwrite_too(
    tiny_models, models: Path, monkeypatch, capsys, command: str
) -> None:
    work = models / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = {
        "convert": ["convert", str(models / "base"), "--to", "hf", ""],
        "merge": ["merge", "--model", str(models / "base-hf"), "--adapter",
                  str(models / "lora1"), "--out", ""],
        "finetune": [*tiny_models.finetune, "--model", str(models / "base-hf"), "--out", ""],
    }[command]  # fmt: skip
    before = tree(models)
    assert main(argv) == 2
    expected = "is empty: give a path" if command == "finetune" else "is an empty path: name a"
    assert expected in one_error_line(capsys)  # finetune's config check comes first
    assert tree(models) == before and not os.listdir(work)


# --- every folder records what it is (glassformer.json) ----------------------------------------


def _record(folder: Path) -> dict:
    return json.loads((folder / "glassformer.json").read_text())


@pytest.fixture
def adapter_folder(models: Path) -> Path:
    """An adapter folder as save_adapter writes it (a LoRA on the tiny base-hf model)."""
    model, _ = from_pretrained(models / "base-hf")
    apply_lora(model, "q,v", rank=2)
    return save_adapter(model, models / "adapter", base_model=str(models / "base-hf"))


def test_adapter_run_and_model_folders_record_their_kind(models: Path, adapter_folder: Path):
    assert _record(adapter_folder) == {"kind": "adapter", "written_by": "glassformer"}
    assert _record(models / "lora1") == {
        "kind": "run",
        "holds": "adapter",
    }  # finetune --method lora
    assert _record(models / "base") == {"kind": "run", "holds": "model"}  # train
    assert _record(models / "base-hf")["kind"] == "model"  # convert
    for name in ("adapter", "lora1", "base", "base-hf"):
        assert folder_kind(models / name) == _record(models / name)["kind"]


def test_commands_never_take_an_adapter_a_run_or_a_model_for_another(
    tiny_models, models: Path, adapter_folder: Path, tiny_run_config, capsys
) -> None:
    out_dir = f"train.out_dir={json.dumps(str(adapter_folder))}"
    train = ["train", "--config", str(tiny_run_config("x")), "--set", out_dir, "--no-progress"]
    before = tree(models)
    base = ["--model", str(models / "base-hf")]
    for argv in (
        [*train, "--resume"],
        [*train, "--overwrite"],
        [*tiny_models.finetune, *base, "--out", str(adapter_folder), "--resume"],
    ):
        assert main(argv) == 2
        assert "holds an adapter, not a training run" in one_error_line(capsys)
    merge = ["merge", *base, "--adapter", str(models / "lora1"), "--out"]
    for argv in (
        ["convert", str(models / "base"), "--to", "hf", str(adapter_folder), "--overwrite"],
        [*merge, str(adapter_folder), "--overwrite"],
    ):
        assert main(argv) == 2
        assert "holds an adapter, not a model: --overwrite replaces a model" in (
            one_error_line(capsys)
        )
    model, _ = from_pretrained(models / "base-hf")
    apply_lora(model, "q,v", rank=2)
    for folder, held in [("lora1", "a run"), ("base", "a run"), ("base-hf", "a model")]:
        with pytest.raises(FolderError, match=f"holds {held}, not an adapter"):
            save_adapter(model, models / folder, overwrite=True)
    with pytest.raises(InteropError, match="holds a LoRA adapter, not a model"):
        from_pretrained(adapter_folder)
    assert tree(models) == before


# --- what a killed write leaves: never a missing folder -----------------------------------------

KILLED_BETWEEN_THE_RENAMES = """
import os, signal, sys
import glassformer.files as files
files._exchange = lambda a, b: False  # a system without renameat2 (macOS, old kernels)
rename = os.rename
def rename_then_die(src, dst):
    rename(src, dst)
    if ".gf-old-" in os.fspath(dst):  # the old folder is aside, the new one not yet in
        os.kill(os.getpid(), signal.SIGKILL)
os.rename = rename_then_die
from glassformer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_write_killed_between_its_two_renames_leaves_no_model_missing(models: Path):
    dest = models / "base-hf"
    old = tree(dest)
    argv = ["convert", str(models / "base"), "--to", "hf", str(dest), "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_BETWEEN_THE_RENAMES, *argv], capture_output=True, env=env
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    (aside,) = [p for p in models.iterdir() if p.name.startswith(".base-hf.gf-old-")]
    assert not dest.exists() and tree(aside) == old  # what the crash left
    model, tokenizer = from_pretrained(dest)  # a reader puts the old folder back
    assert tree(dest) == old and model is not None and tokenizer is not None
    (hidden,) = [p.name for p in models.iterdir() if p.name.startswith(".")]
    assert hidden.startswith(".base-hf.gf-new-")  # the dead write's new folder, never swapped in
    assert main(argv) == 0  # the next write removes it
    assert not [p.name for p in models.iterdir() if p.name.startswith(".")]


def _aside(folder: Path, pid: int) -> Path:
    """Move `folder` aside as a write that died between its two renames leaves it."""
    aside = folder.parent / f".{folder.name}.gf-old-{pid}-0a0b0c0d"
    os.rename(folder, aside)
    return aside


@pytest.mark.parametrize("kind", ["model", "run", "adapter"])
def test_every_reader_puts_back_a_folder_a_killed_write_left_aside(
    tiny_models, models: Path, kind: str
) -> None:
    name = {"model": "base-hf", "run": "base", "adapter": "lora1"}[kind]
    folder = models / name
    before = tree(folder)
    _aside(folder, _dead_pid())
    if kind == "model":
        from_pretrained(folder)
    elif kind == "run":
        load(folder)
    else:
        model, _ = from_pretrained(tiny_models.base_hf)
        assert load_adapter(model, folder)
    assert tree(folder) == before
    assert not [p.name for p in models.iterdir() if p.name.startswith(".")]


def test_a_reader_leaves_the_aside_folder_of_a_writer_still_at_work(models: Path) -> None:
    folder = models / "base-hf"
    aside = _aside(folder, os.getppid())  # its writer is alive: about to put the new one in
    with pytest.raises(InteropError, match="is neither a path nor a known alias"):
        from_pretrained(folder)
    assert aside.is_dir() and not folder.exists()


def test_a_second_rename_that_fails_puts_the_old_folder_back(tmp_path: Path, monkeypatch):
    import glassformer.files

    dest = tmp_path / "model"
    with write_folder(dest, "model") as tmp:
        (tmp / "config.json").write_text("old")
    before = tree(dest)
    real_rename = os.rename

    def refuse_the_new_folder(src, dst):
        if ".gf-new-" in os.fspath(src):
            raise OSError(5, "Input/output error", os.fspath(src))
        real_rename(src, dst)

    monkeypatch.setattr(glassformer.files, "_exchange", lambda a, b: False)
    monkeypatch.setattr(glassformer.files.os, "rename", refuse_the_new_folder)
    failing = pytest.raises(FolderError, match="nothing was changed")
    with failing, write_folder(dest, "model", overwrite=True) as tmp:
        (tmp / "config.json").write_text("new")
    monkeypatch.undo()
    assert tree(dest) == before and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
