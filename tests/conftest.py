"""Shared test setup: one CPU thread, fixed seeds, and Hugging Face kept offline."""

from __future__ import annotations

import json
import os
import random
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


@pytest.fixture
def tiny_run_config(tmp_path):
    """write(name, **train) -> the path of a TOML config for a tiny GPT trained on the first
    20,000 characters of Hamlet, out_dir tmp_path/name; `train` values override [train]'s."""
    from glassformer.data import shakespeare_plays

    plays = shakespeare_plays("modern")
    corpus = tmp_path / "hamlet.txt"
    corpus.write_text(plays[next(k for k in plays if "hamlet" in k)][:20_000], encoding="utf-8")

    def write(name: str = "run", **train) -> Path:
        values = {
            "out_dir": str(tmp_path / name), "max_steps": 4, "batch_size": 4, "warmup_steps": 1,
            "eval_interval": 1000, "eval_batches": 1, "checkpoint_interval": 1,
            "keep_checkpoints": 2, "threads": 1, **train,
        }  # fmt: skip
        lines = [f"{key} = {json.dumps(value)}" for key, value in values.items()]
        path = tmp_path / f"{name}.toml"
        path.write_text(
            "[model]\nd_model = 16\nn_layers = 1\nn_heads = 2\nmax_seq_len = 16\n\n"
            f"[data]\ncorpus = {json.dumps(str(corpus))}\n\n[train]\n" + "\n".join(lines) + "\n"
        )
        return path

    return write
