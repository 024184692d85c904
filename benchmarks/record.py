"""A benchmark run as JSON (each script's --json PATH): the command, the date, the machine and
every row measured, the file benchmarks/render.py draws the docs' tables from."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

# Environment variables that change what a run measures: the command shows those set.
SETTINGS = ("GLASSFORMER_KERNELS", "GLASSFORMER_PREFILL_MATMUL")


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return next(names, platform.processor())


def machine(threads: int, **more) -> dict:
    """What the figures depend on: the CPU, its cores, the threads used, the torch version."""
    import torch

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        **more,
    }


def write(path: Path, threads: int, fields: dict) -> None:
    """Write `fields` (the run's settings and rows) with the command, date and machine."""
    settings = [f"{name}={os.environ[name]}" for name in SETTINGS if name in os.environ]
    command = ["python", "benchmarks/" + Path(sys.argv[0]).name, *sys.argv[1:]]
    result = {
        "command": " ".join([*settings, *command]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(threads),
        **fields,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}")
