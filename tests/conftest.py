"""Shared test setup: one CPU thread, fixed seeds, and Hugging Face kept offline."""

from __future__ import annotations

import os
import random

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
