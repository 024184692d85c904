"""Files that survive a crash, and the one way a model, adapter or run folder is written
(docs/reliability.md, "Every folder is written one way").

A file is replaced whole or not at all (temporary file, fsync, rename, fsync of the folder). A
folder is built beside its destination under a hidden name, fsynced, and swapped in with one
exchange of names (renameat2's RENAME_EXCHANGE on Linux; two renames elsewhere), so a reader
sees the complete old folder or the complete new one, never a mix (a write killed between the
two renames leaves the old folder aside, and the next reader puts it back). Before anything is
written the destination is resolved with symlinks followed and refused when it is, holds or sits
inside a source, or is `/`, the home folder, the current folder or an empty path. Every folder
records what it is (model, adapter or run) in glassformer.json.

Three writers rename files into place themselves, none of them over a folder a user named: the
kernel library built on first use (kernels/build.py: a cache file, replaced whole), the lab's
trained char GPTs (lab/char_gpt.py: cache files, replaced whole), and a training run's
step-NNNNNN folders inside the run folder this module created (train/checkpoint.py: each built
under a hidden name and renamed into place, `latest` moved after it, with its own recovery from
a kill at any point, tested in tests/test_durability.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import safetensors

KIND_FILE = "glassformer.json"  # {"kind": "model" | "adapter" | "run", ...}
KINDS = ("model", "adapter", "run")

# The hidden names a folder write uses beside its destination NAME: .NAME.gf-new-PID-HEX (being
# built), .NAME.gf-old-PID-HEX (the old folder, moved aside where no exchange exists) and
# .NAME.gf-del-PID-HEX (the old folder, being deleted).
_STAGES = ("new", "old", "del")


class FolderError(ValueError):
    """A destination that would lose something, or a write that failed; the message names the
    folder and the fix."""


# --- files ------------------------------------------------------------------------------------


def fsync_dir(directory: Path) -> None:
    # A rename is only durable once the directory entry itself reaches the disk. Windows cannot
    # open a directory for fsync, and NTFS journals renames anyway.
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` so that a reader sees the old file or the new one, never half.
    A symlink at `path` is replaced by the file, never written through."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; checkpoints are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def share_tree(directory: Path) -> None:
    """Make files written private (safetensors and mkstemp write 0600) readable by all, as a
    model folder is meant to be shared; folders keep what they were made with."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            path = Path(root) / name
            if not path.stat().st_mode & 0o044:
                path.chmod(0o644)


def fsync_tree(directory: Path) -> None:
    """fsync every file and folder below `directory`, before it is renamed into place."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(Path(root))


# --- what a folder is -------------------------------------------------------------------------


def write_kind(folder: Path, kind: str, **details: Any) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not one of {', '.join(KINDS)}")
    record = {"kind": kind, **details}
    atomic_write_text(folder / KIND_FILE, json.dumps(record, indent=2, sort_keys=True) + "\n")


def with_article(kind: str) -> str:
    """ "a model", "an adapter", "a run": a kind as the messages name it."""
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


def folder_kind(folder: Path) -> str | None:
    """What `folder` holds: "model", "adapter" or "run" (from glassformer.json, else from its
    files), "other" for a folder of other files, None when it is missing or empty."""
    if not folder.is_dir():
        return None
    try:
        record = json.loads((folder / KIND_FILE).read_text())
        if isinstance(record, dict) and record.get("kind") in KINDS:
            return record["kind"]
    except (OSError, ValueError, RecursionError):
        pass  # no record (a folder from elsewhere, or an older glassformer): look at its files
    names = {child.name for child in folder.iterdir()}
    if (
        "latest" in names
        or "run_config.json" in names
        or any(name.startswith("step-") for name in names)
    ):
        return "run"
    if "adapter_config.json" in names:
        return "adapter"
    if names & {"config.json", "model.safetensors", "model.safetensors.index.json"}:
        return "model"
    return "other" if names - {KIND_FILE} else None


# --- where a folder may be written ------------------------------------------------------------


def resolved(path: str | Path) -> Path:
    """`path` made absolute with every symlink followed (the folder a write would really touch)."""
    return Path(os.path.realpath(os.path.abspath(os.fspath(path))))


def check_destination(
    dest: str | Path, sources: Iterable[str | Path] = (), flag: str = "--out"
) -> Path:
    """The resolved destination of a folder write, refused (FolderError) when writing there
    could lose something: an empty path, `/`, the home or current folder or a folder holding
    them, a file, a symlink, or any source (model, adapter, run, tokenizer) that is the
    destination, lies inside it or holds it."""
    raw = os.fspath(dest)
    if not raw.strip():
        raise FolderError(
            f"{flag} is an empty path: name a new folder to write into, e.g. out/model"
        )
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:
        raise FolderError(
            f"{flag} {raw!r} is not valid UTF-8: give a folder name in UTF-8"
        ) from None
    target = resolved(dest)
    guarded = {Path("/"): "the root folder"}
    with contextlib.suppress(RuntimeError):  # no home folder: nothing to guard
        guarded.setdefault(resolved(Path.home()), "your home folder")
    guarded.setdefault(resolved(Path.cwd()), "the current folder")
    exact = [name for folder, name in guarded.items() if target == folder]
    holding = [
        f"a folder that holds {name} ({folder})"
        for folder, name in guarded.items()
        if target in folder.parents
    ]
    if exact or holding:
        raise FolderError(
            f"{flag} {raw} is {(exact or holding)[0]}: a folder write replaces its destination"
            " whole; name a new folder, e.g. out/model"
        )
    if Path(raw).is_symlink():
        raise FolderError(
            f"{flag} {raw} is a symlink to {target}: glassformer never writes through a link;"
            f" give the folder itself ({target}) or a new folder"
        )
    if target.exists() and not target.is_dir():
        raise FolderError(f"{flag} {raw} is a file, not a folder: give a folder to write into")
    for source in sources:
        if source is None or not os.fspath(source):
            continue
        origin = resolved(source)
        if origin == target or origin in target.parents:
            relation = "is" if origin == target else "is inside"
            elsewhere = origin.parent / f"{origin.stem}-out"
        elif target in origin.parents:
            relation, elsewhere = "holds", target.parent / f"{target.name}-out"
        else:
            continue
        raise FolderError(
            f"{flag} {raw} {relation} {origin}, which this command reads from: writing there"
            f" would replace or shadow it; write to a new folder outside it, e.g. {elsewhere}"
        )
    return target


# --- writing a folder -------------------------------------------------------------------------


def _hidden(target: Path, stage: str) -> Path:
    return target.parent / f".{target.name}.gf-{stage}-{os.getpid()}-{secrets.token_hex(4)}"


def _leftover_stage(target: Path, name: str) -> str | None:
    """The stage of a hidden folder a write to `target` left behind whose process is gone."""
    prefix = f".{target.name}.gf-"
    if not name.startswith(prefix):
        return None
    stage, _, rest = name[len(prefix) :].partition("-")
    pid = rest.partition("-")[0]
    if stage not in _STAGES or not pid.isdigit():
        return None
    if int(pid) != os.getpid():
        try:
            os.kill(int(pid), 0)
            return None  # its writer is still at work
        except ProcessLookupError:
            pass
        except PermissionError:
            return None
    return stage


def restore_aside(target: str | Path) -> bool:
    """Put back the old folder that a killed write left aside: where no exchange exists, a write
    that dies between its two renames leaves nothing at `target` and the complete old folder
    under .NAME.gf-old-PID-HEX. Readers call this for a path that is missing, so that a killed
    write never leaves a model missing; nothing else is touched. True if `target` is there now."""
    target = Path(target)
    if os.path.lexists(target):
        return True
    if not target.name or not target.parent.is_dir():
        return False
    for child in sorted(target.parent.iterdir()):
        if _leftover_stage(target, child.name) == "old":
            # Another reader may be first, and a reader may not own the folder: then the
            # folder stays aside and the reader reports the path as missing.
            with contextlib.suppress(OSError):
                os.rename(child, target)
                fsync_dir(target.parent)
            break
    return os.path.lexists(target)


def clean_leftovers(target: Path) -> list[str]:
    """Remove what killed writes to `target` left beside it; an old folder moved aside by a
    write that died before the new one went in is put back first. Returns the names removed."""
    if not target.parent.is_dir():
        return []
    restore_aside(target)
    removed = []
    for child in sorted(target.parent.iterdir()):
        if _leftover_stage(target, child.name) is None:
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child.name)
    return removed


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names a and b in one step (Linux renameat2); False where the system or the file
    system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def swap_in(new: Path, target: Path) -> None:
    """Put the complete folder `new` at `target`: at every instant `target` is the complete old
    folder or the complete new one. The old one is deleted only after the swap."""
    if not os.path.lexists(target):
        os.rename(new, target)
        fsync_dir(target.parent)
        return
    if _exchange(new, target):
        old = new  # the exchange left the old folder under the new one's hidden name
    else:
        # Two renames: a crash between them leaves the old folder aside under .gf-old-, which
        # the next reader (restore_aside) or writer (clean_leftovers) puts back.
        old = _hidden(target, "old")
        os.rename(target, old)
        try:
            os.rename(new, target)
        except BaseException:
            os.rename(old, target)  # a failed write changes nothing
            raise
    fsync_dir(target.parent)
    doomed = _hidden(target, "del")
    os.rename(old, doomed)
    # The new folder is in place: a deletion that fails (or is killed) leaves .NAME.gf-del-*,
    # which the next write to `target` removes; it must not report the write as failed.
    shutil.rmtree(doomed, ignore_errors=True)


@contextlib.contextmanager
def write_folder(
    dest: str | Path,
    kind: str,
    sources: Iterable[str | Path] = (),
    overwrite: bool = False,
    flag: str = "--out",
    **details: Any,
) -> Iterator[Path]:
    """Build a `kind` folder ("model", "adapter") for `dest` and swap it in whole:

        with write_folder(out, "model", sources=[src], overwrite=args.overwrite) as tmp:
            save_model_files(tmp, model, cfg, tokenizer)

    The body writes into `tmp`, a hidden folder beside `dest`. On success the folder records
    its kind, is fsynced and replaces `dest` in one swap; on any failure it is removed and
    `dest` is as it was. `dest` must be new, empty, or (with overwrite) a folder of the same
    kind; check_destination says which destinations are refused whatever the flags."""
    target = check_destination(dest, sources, flag)
    held = folder_kind(target)
    if held is not None:
        if held != kind:
            what = {"other": "files that are not a model"}.get(held, with_article(held))
            raise FolderError(
                f"{flag} {dest} holds {what}, not {with_article(kind)}: --overwrite replaces"
                f" {with_article(kind)} folder only; write to a new folder"
            )
        if not overwrite:
            raise FolderError(
                f"{flag} {dest} already holds {with_article(kind)}: pass --overwrite to replace"
                " it, or write to a new folder"
            )
    tmp = _hidden(target, "new")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        clean_leftovers(target)
        tmp.mkdir(mode=0o755)
        yield tmp
        write_kind(tmp, kind, **details)
        share_tree(tmp)
        fsync_tree(tmp)
        swap_in(tmp, target)
    except (OSError, safetensors.SafetensorError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FolderError(write_failed(dest, err)) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_failed(dest: str | Path, error: BaseException) -> str:
    """The one line for a folder write that failed (a full disk, a read-only folder)."""
    try:
        free = f"{shutil.disk_usage(resolved(dest).parent).free / 2**20:,.1f} MiB is free there"
    except OSError:
        free = "the free space there is unknown"
    return (
        f"could not write {dest} ({error}): nothing was changed, {dest} is as it was before and"
        f" no partial files were left; {free}: make room or write to another disk"
    )
