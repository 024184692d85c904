"""The small character-level Shakespeare GPT that the lab's head experiments study (seed 000
§4.2: head pruning, induction heads). Trained once per mode with fit.py and cached as
safetensors, keyed by a hash of everything that shapes the weights, so the second experiment
that asks for the same model loads it instead of retraining.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.lab.base import RunContext
from glassformer.lab.fit import Schedule, fit, shakespeare_chars, window_batches
from glassformer.models import build_model
from glassformer.tokenizers import CharTokenizer


@dataclass(frozen=True)
class CharGPTRecipe:
    """Everything that decides the trained weights (and so the cache key)."""

    n_layers: int
    n_heads: int
    d_model: int
    context: int  # training window length = max_seq_len
    batch_size: int
    schedule: Schedule
    seed: int = 0
    n_chars: int | None = None  # the first n_chars of the corpus, or all of it

    def config(self, vocab_size: int) -> ModelConfig:
        # RoPE: relative positions make a "previous token" head, half of an induction circuit,
        # easy to learn; the rest is the house default (pre-norm LayerNorm, GELU, tied embeddings).
        return ModelConfig(
            vocab_size=vocab_size,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            max_seq_len=self.context,
            position="rope",
        )

    @property
    def shape(self) -> str:
        """The model's size in words, for the experiments' notes."""
        return f"{self.n_layers} layers x {self.n_heads} heads, d_model {self.d_model}"


def recipe_for(ctx: RunContext, seed: int | None = None) -> CharGPTRecipe:
    """The model of each mode, trained from `seed` (default ctx.seed). quick: 2 layers x 8 heads
    of 8 dims (~0.1M parameters) on windows of 128 characters, about 20 s of training at one
    thread, so an experiment can train one per seed; full: 16-dim heads on windows of 256
    characters, trained three times longer."""
    steps = ctx.pick(1500, 300, 6)
    return CharGPTRecipe(
        n_layers=2,  # an induction circuit needs two: a previous-token head feeding a copier
        n_heads=ctx.pick(8, 8, 4),
        d_model=ctx.pick(128, 64, 32),
        context=ctx.pick(256, 128, 32),  # long windows: more repeated names to copy from
        batch_size=ctx.pick(16, 8, 4),
        schedule=Schedule(
            steps, learning_rate=ctx.pick(3e-3, 5e-3, 3e-3), warmup_steps=max(1, steps // 10)
        ),
        seed=ctx.seed if seed is None else seed,
        n_chars=ctx.pick(None, None, 200_000),
    )


@dataclass
class CharGPT:
    model: nn.Module  # eval mode
    tokenizer: CharTokenizer
    val_ids: Tensor  # (M,) held-out character ids
    recipe: CharGPTRecipe
    train_losses: list[float]
    cached: bool  # loaded from the cache rather than trained in this call
    seconds: float  # wall time of this call (training or loading)

    @property
    def origin(self) -> str:
        return "loaded from the cache" if self.cached else "trained in this run"


def cache_dir() -> Path:
    """$GLASSFORMER_CACHE/lab, else ~/.cache/glassformer/lab."""
    root = os.environ.get("GLASSFORMER_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "glassformer"
    return base / "lab"


def cache_key(recipe: CharGPTRecipe, cfg: ModelConfig) -> str:
    described = {
        "recipe": dataclasses.asdict(recipe),
        "config": dataclasses.asdict(cfg),
        "torch": torch.__version__,
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def char_gpt(ctx: RunContext, seed: int | None = None, use_cache: bool | None = None) -> CharGPT:
    """The trained model of ctx's mode and `seed` (default ctx.seed). use_cache None: every mode
    but tiny (tiny trains in well under a second, and tests should not write to the user's
    cache)."""
    use_cache = ctx.mode != "tiny" if use_cache is None else use_cache
    return trained(recipe_for(ctx, seed), use_cache=use_cache)


def trained(recipe: CharGPTRecipe, use_cache: bool = True) -> CharGPT:
    start = time.perf_counter()
    corpus = shakespeare_chars(recipe.n_chars)
    cfg = recipe.config(corpus.tokenizer.vocab_size)
    torch.manual_seed(recipe.seed)
    model = build_model(cfg)
    path = cache_dir() / f"char-gpt-{cache_key(recipe, cfg)}.safetensors"
    if use_cache and path.exists():
        losses = _load(model, path)
        cached = True
    else:
        batches = window_batches(corpus.train, recipe.batch_size, recipe.context, recipe.seed)
        losses = fit(model, batches, recipe.schedule)
        cached = False
        if use_cache:
            _save(model, path, losses)
    model.eval()
    seconds = time.perf_counter() - start
    return CharGPT(model, corpus.tokenizer, corpus.val, recipe, losses, cached, seconds)


def _save(model: nn.Module, path: Path, losses: list[float]) -> None:
    """Write to a temporary file in the same folder, then rename: a reader never sees half a
    file, and two runs racing both write a whole one."""
    from safetensors.torch import save_model

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_model(model, tmp, metadata={"train_losses": json.dumps(losses)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load(model: nn.Module, path: Path) -> list[float]:
    from safetensors import safe_open
    from safetensors.torch import load_model

    load_model(model, path)  # safetensors only: no pickle, nothing executed
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    return json.loads(metadata.get("train_losses", "[]"))
