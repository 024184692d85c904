"""Files that survive a crash: a write replaces a file whole or not at all (temporary file,
fsync, rename, fsync of the folder), so a reader never sees half a checkpoint or half a
`latest` (DESIGN.md, "Data flow": checkpoints written atomically).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


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
    """Replace `path` with `data` so that a reader sees the old file or the new one, never half."""
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


def fsync_tree(directory: Path) -> None:
    """fsync every file and folder below `directory`, before it is renamed into place."""
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(Path(root))
