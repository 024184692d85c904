"""Run lab experiments: time each, print its table and verdict, write out_dir/NAME.json (beside
the figure Experiment.run saved as out_dir/NAME.png). The JSON is what `lab report` reads.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from glassformer.files import atomic_write_text
from glassformer.lab.base import Experiment, Result, RunContext, discover


def command_for(name: str, mode: str) -> str:
    return f"glassformer lab run {name} --{mode}"


# The lab's shared code: a change here can change any experiment's numbers.
SHARED_MODULES = ("base", "char_gpt", "fit", "runner")


def code_hash(exp: Experiment, ctx: RunContext) -> str:
    """What makes a result current: the program of the experiment's module, of the lab modules
    it imports from and of the lab's shared modules, with the mode and the seed. `lab run
    --resume` skips an experiment whose JSON has this hash. The program, not the text: a change
    of formatting, comments or docstrings leaves the numbers alone, so it leaves results current."""
    import importlib
    import inspect

    digest = hashlib.sha256(f"{ctx.mode} {ctx.seed}\n".encode())
    own = importlib.import_module(exp.fn.__module__)
    used = set()  # the lab modules it imports from (lab.serving, another experiment's helpers)
    for value in vars(own).values():
        name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
        if isinstance(name, str) and name.startswith("glassformer.lab."):
            used.add(name)
    modules = [own.__name__, *(f"glassformer.lab.{m}" for m in SHARED_MODULES)]
    modules += sorted(used - set(modules))
    for module in modules:
        digest.update(program(inspect.getsource(importlib.import_module(module))).encode())
    return digest.hexdigest()[:16]


def program(source: str) -> str:
    """The source as its syntax tree without docstrings: equal for two texts that differ only in
    layout, comments or docstrings."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def is_current(exp: Experiment, ctx: RunContext) -> bool:
    """True when out_dir/NAME.json was written by this code, mode and seed."""
    path = ctx.out_dir / f"{exp.name}.json"
    try:
        recorded = json.loads(path.read_text()).get("code_hash")
    except (OSError, ValueError):
        return False
    return recorded == code_hash(exp, ctx)


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def record(exp: Experiment, ctx: RunContext, result: Result, seconds: float, started: str) -> dict:
    """Everything the report needs about one run, JSON-ready."""
    figure = None
    if result.figure is not None:
        figure = os.path.relpath(Path(result.figure), ctx.out_dir)
    return {
        "name": exp.name,
        "number": exp.number,
        "title": exp.title,
        "claim": exp.claim,
        "source": exp.source,
        "command": command_for(exp.name, ctx.mode),
        "mode": ctx.mode,
        "seed": ctx.seed,
        "code_hash": code_hash(exp, ctx),
        "started": started,
        "seconds": round(seconds, 2),
        "machine": machine(),
        "verdict": result.verdict,
        "why": result.why,
        "rows": result.rows,
        "checks": [c.to_dict() for c in result.checks],
        "figure": figure,
        "notes": result.notes,
        "data": result.data,
        "zh": ctx.zh,
    }


def run_one(exp: Experiment, ctx: RunContext) -> dict:
    """Run one experiment, write NAME.json into ctx.out_dir and return its record."""
    ctx = dataclasses.replace(ctx, zh={})  # this experiment's Chinese words only
    if ctx.threads:
        torch.set_num_threads(ctx.threads)
    torch.manual_seed(ctx.seed)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC).astimezone().isoformat(timespec="seconds")
    t0 = time.perf_counter()
    result = exp.run(ctx)
    rec = record(exp, ctx, result, time.perf_counter() - t0, started)
    path = ctx.out_dir / f"{exp.name}.json"
    atomic_write_text(path, json.dumps(rec, ensure_ascii=False, indent=1, default=_jsonable) + "\n")
    return rec


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy / torch numbers and arrays
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to JSON: convert it in the experiment")


def run_many(
    names: list[str] | None, ctx: RunContext, echo: bool = True, resume: bool = False
) -> list[dict]:
    """Run the named experiments (None: all of them), printing each as it finishes. resume:
    skip those whose result in ctx.out_dir is current (is_current), so a long full run can be
    done in pieces."""
    experiments = discover()
    chosen = list(experiments) if names is None else names
    for name in chosen:
        if name not in experiments:
            raise ValueError(f"no experiment named {name!r}: pick one of {', '.join(experiments)}")
    records = []
    for name in chosen:
        if resume and is_current(experiments[name], ctx):
            if echo:
                print(f"== {name}: current ({ctx.out_dir / name}.json), skipped", flush=True)
            continue
        rec = run_one(experiments[name], ctx)
        records.append(rec)
        if echo:
            print(format_record(rec), flush=True)
    return records


# --- text output ------------------------------------------------------------------------------


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e6 else f"{value:.4e}"
    if isinstance(value, int) and abs(value) >= 10**6:
        return f"{value:,}"
    return str(value)


def text_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)"
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def format_record(rec: dict) -> str:
    lines = [
        f"== {rec['name']}: {rec['title']}  ({rec['source']}, {rec['mode']}, {rec['seconds']} s)",
        f"claim: {rec['claim']}",
        text_table(rec["rows"]),
        *(f"note: {n}" for n in rec["notes"]),
        "checks:",
        *(f"  [{'x' if c['passed'] else ' '}] {describe_check(c)}" for c in rec["checks"]),
        f"verdict: {rec['verdict']} - {rec['why']}",
    ]
    if rec["figure"]:
        lines.append(f"figure: {rec['figure']}")
    return "\n".join(lines) + "\n"


def describe_check(check: dict) -> str:
    op, target = check["op"], check["target"]
    want = f"{target:g} ± {check['tolerance']:g}" if op == "~" else f"{op} {target:g}"
    return f"{check['what']}: {check['measured']:.4g} (want {want})"
