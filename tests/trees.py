"""What a folder holds, to compare before and after an attack (tests of issue 30): every file by
its content, links by their target (never followed)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path


def digest(path: Path) -> str:
    """sha256 of a file; of a safetensors file, of its tensors and its metadata as a dict (the
    library writes the metadata's keys in no fixed order)."""
    data = path.read_bytes()
    if path.suffix == ".safetensors" and len(data) >= 8:
        size = struct.unpack("<Q", data[:8])[0]
        try:
            header = json.loads(data[8 : 8 + size])
        except ValueError:
            pass  # a damaged file: its raw bytes
        else:
            canonical = json.dumps(header, sort_keys=True).encode()
            data = canonical + data[8 + size :]
    return hashlib.sha256(data).hexdigest()


def tree(folder: Path) -> dict[str, str]:
    """Every entry below `folder`: a file's digest, a link's target."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in [*files, *(d for d in dirs if (Path(root) / d).is_symlink())]:
            path = Path(root) / name
            rel = str(path.relative_to(folder))
            found[rel] = "link -> " + os.readlink(path) if path.is_symlink() else digest(path)
    return found
