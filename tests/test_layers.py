"""DESIGN.md's layers, checked by machine: every import in glassformer/ points down (faces ->
jobs -> models -> nn -> shared ground), and no module imports one that imports it back, not
even from inside a function (the way a cycle hides instead of being fixed).

The modules are parsed with `ast`, never imported, so imports inside functions and under
`if TYPE_CHECKING:` count as much as those at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import glassformer

PACKAGE = Path(glassformer.__file__).parent

# Lowest first. A name is the first part after `glassformer.`; "" is the package itself
# (glassformer/__init__.py, the public API: it imports every layer, so it is a face).
LAYERS: list[tuple[str, set[str]]] = [
    (
        "shared ground",
        {
            "config",
            "tokenizers",
            "templates",  # chat templates and the tokens they write (end of turn, <think>)
            "detokenize",
            "data",
            "files",
            "json_input",
            "devices",
            "interrupts",  # Ctrl-C while the package's and the CLI's imports run
            "numpy_ref",  # the numpy reference forward: only the config is shared with torch
            "kernels",  # the C matvec loops that nn/quant.py and infer/ call
        },
    ),
    ("nn", {"nn"}),
    ("models", {"models"}),
    (
        "jobs",
        {
            "train",
            "infer",
            "inspect",
            "interop",
            "calc",  # counts from a config (builds models on the meta device)
            "memory",  # will it fit: calc's formulas as a guard for interop and train
            "tokenize",  # the token counter: vocabularies through interop
            "chat",  # a conversation on the engine: the CLI, the lab and the server use it
            "rag",  # retrieval on a vector database, then the engine answers (uses chat)
        },
    ),
    ("faces", {"cli", "server", "lab", "__main__", ""}),
]
LEVEL = {name: level for level, (_, names) in enumerate(LAYERS) for name in names}

# Cycles left on purpose, each (importer, imported) with the reason it is not fixed.
ALLOWED_CYCLES = {
    # A registry: architecture_for imports the archs package so that each architecture's name
    # table registers itself, and every table is built from hf.py's WeightRule and register.
    # Fixing it means moving WeightRule/Architecture/register out of hf.py (interop's own move).
    ("glassformer.interop.hf", "glassformer.interop.archs"),
}


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module under root (glassformer/) by dotted name (a package by its folder's name)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) of every glassformer module in `known` that module `name` imports,
    wherever the import sits."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's own package upwards
                base = name.split(".")[: name.count(".") + 1 - node.level + is_package]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from glassformer.data import parallel` imports the module glassformer.data.parallel
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # glassformer.x.y.Name -> glassformer.x.y
                target = target.rpartition(".")[0]
            if target.split(".")[0] == "glassformer":
                found.append((node.lineno, target))
    return found


def top_name(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(known: dict[str, Path]) -> list[str]:
    upward = []
    for name, path in known.items():
        here = LEVEL.get(top_name(name))
        for line, target in imports(name, path, known):
            there = LEVEL.get(top_name(target))
            if here is not None and there is not None and there > here:
                upward.append(
                    f"{name}:{line} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]})"
                )
    return list(dict.fromkeys(upward))  # one line per import, however many names it takes


def import_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules loading it runs: each one imported and the packages holding it
    (importing glassformer.a.b runs glassformer/a/__init__.py first). Left out: the module's
    own packages, which are already loading when it runs, and the root package, which imports
    every layer for the public API."""
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        own = {name.rsplit(".", i)[0] for i in range(name.count(".") + 1)}
        edges = set()
        for _, target in imports(name, path, known):
            parts = target.split(".")
            edges |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} - own
        graph[name] = edges
    return graph


def back_to(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A shortest import path start -> ... -> goal, or None."""
    came_from = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            if module == goal:
                return came_from[module]
            for target in sorted(graph.get(module, ())):
                if target not in came_from:
                    came_from[target] = [*came_from[module], target]
                    following.append(target)
        frontier = following
    return None


def import_cycles(known: dict[str, Path]) -> list[str]:
    graph = import_graph(known)
    for importer, imported in ALLOWED_CYCLES:
        graph.get(importer, set()).discard(imported)
    cycles = []
    for start, edges in graph.items():
        for first in sorted(edges):
            path = back_to(graph, first, start)
            if path is not None:
                cycles.append(" -> ".join([start, *path]))
    return cycles


def test_every_module_has_a_layer():
    unplaced = sorted({top_name(m) for m in modules()} - set(LEVEL))
    assert not unplaced, (
        f"{unplaced} under glassformer/ belong to no layer: add each to LAYERS in "
        "tests/test_layers.py (and DESIGN.md's layer picture)"
    )


def test_every_import_points_down():
    upward = upward_imports(modules())
    assert not upward, (
        "imports that point up a layer (DESIGN.md, 'Layers'): move what both sides need down "
        "to the lower layer\n" + "\n".join(upward)
    )


def test_no_module_imports_one_that_imports_it():
    cycles = import_cycles(modules())
    assert not cycles, (
        "import cycles (an import inside a function or under TYPE_CHECKING counts too): move "
        "the shared piece to a module both can import\n" + "\n".join(cycles)
    )


def test_the_checks_find_an_upward_import_and_a_cycle(tmp_path):
    """The checks on a toy package: an import up a layer hidden in a function, and a cycle
    hidden under TYPE_CHECKING, are both found; imports that point down pass."""
    files = {
        "data/__init__.py": "",
        "data/helper.py": "def f():\n    from glassformer.train.loop import run\n",
        "train/__init__.py": "",
        "train/loop.py": "from glassformer.data.helper import f\n",
        "server/__init__.py": "",
        "server/a.py": "from glassformer.server.b import B\n",
        "server/b.py": (
            "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .a import A\n"
        ),
    }
    for relative, source in files.items():
        path = tmp_path / "glassformer" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    toy = modules(tmp_path / "glassformer")
    assert upward_imports(toy) == [
        "glassformer.data.helper:2 (shared ground) imports glassformer.train.loop (jobs)"
    ]
    assert import_cycles(toy) == [
        "glassformer.data.helper -> glassformer.train.loop -> glassformer.data.helper",
        "glassformer.server.a -> glassformer.server.b -> glassformer.server.a",
        "glassformer.server.b -> glassformer.server.a -> glassformer.server.b",
        "glassformer.train.loop -> glassformer.data.helper -> glassformer.train.loop",
    ]
