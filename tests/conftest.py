"""Shared test setup: one CPU thread, fixed seeds, Hugging Face kept offline; the one tiny
model factory (`tiny_model`), tiny training configs, and the C kernels' skip mark and SIMD
widths."""

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

import glassformer as gf
from glassformer import kernels


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


def tiny_model(*, seed: int = 0, scale: float = 8.0, **fields) -> torch.nn.Module:
    """A tiny Llama-style GPT in eval mode: vocab 37, 2 layers of width 32, 4 query heads
    sharing 2 key/value heads, RoPE, RMSNorm, SwiGLU, 48 positions; `fields` override any
    ModelConfig field (family and components too). Built after torch.manual_seed(seed), then
    every weight times `scale`: the default 8 gives peaked distributions, so greedy choices are
    not near-ties; scale=1 keeps the initialization."""
    config = dict(
        vocab_size=37, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48,
        position="rope", norm="rms", ffn="swiglu",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = gf.build_model(gf.ModelConfig(**(config | fields)))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model.eval()


def tiny_llama_config(vocab_size: int, **fields):
    """A tiny Hugging Face LlamaConfig, the reference side of parity tests: width 32, 2 layers,
    4 query heads sharing 2 key/value heads, 64 positions; `fields` override any field."""
    import transformers

    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaConfig(vocab_size=vocab_size, **(sizes | fields))


# GPT-2's components, for tiny_model(**GPT2, ...): learned positions, LayerNorm, GELU, MHA.
GPT2 = dict(position="learned", norm="layer", ffn="gelu", n_kv_heads=None)


def left_padded(
    prompts: list[torch.Tensor], width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in a (B, width) batch, as batched generation pads them: the ids
    (0 in the pads), the padding mask (True on real tokens) and the position ids, counted from
    each row's first real token."""
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    padding_mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = p
        padding_mask[b, width - len(p) :] = True
    position_ids = (padding_mask.cumsum(-1) - 1).clamp(min=0)
    return ids, padding_mask, position_ids


def finish_gguf(writer) -> None:
    """Write a gguf.GGUFWriter's file in the order llama.cpp lays it out (header, metadata,
    tensors), and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --- the C kernels ----------------------------------------------------------------------------

# What keeps the kernels off here (GLASSFORMER_KERNELS=off, a CPU without AVX2/FMA, no C
# compiler), or None. Tests that need them skip for such a reason only: where the platform can
# build them, they run, and a failed build fails them instead of hiding behind a skip.
KERNELS_MISSING = kernels.missing()
needs_kernels = pytest.mark.skipif(
    KERNELS_MISSING is not None, reason=f"needs the C kernels: {KERNELS_MISSING}"
)


def _width(name: str):
    """The SIMD width `name` (or "amx": AVX-512 with the tile unit) as a parameter, skipped
    with the reason where it cannot run."""
    missing = KERNELS_MISSING
    if missing is None and name == "amx" and not kernels.build.has_amx():
        missing = "the CPU has no AMX tile unit with byte products"
    elif missing is None and name != "amx" and name not in kernels.simd_widths():
        missing = f"the CPU has no {name.upper()}"
    reason = f"needs the {name.upper()} kernels: {missing}"
    return pytest.param(name, marks=pytest.mark.skipif(missing is not None, reason=reason))


# GLASSFORMER_KERNELS's setting for each of the simd fixture's widths
SWITCH_FOR = {"avx2": "avx2", "avx512": "avx512", "amx": "on"}


@pytest.fixture(params=[_width("avx2"), _width("avx512"), _width("amx")])
def simd(request, monkeypatch) -> str:
    """The kernels of each width in turn, for one test: AVX2 (forced on an AVX-512 CPU too, as
    GLASSFORMER_KERNELS=avx2 does), AVX-512 without the tile unit (=avx512) and, on a CPU with
    AMX, AVX-512 with int4's products on the tile unit (the default there: amx.h)."""
    monkeypatch.setattr(kernels, "SWITCH", SWITCH_FOR[request.param])
    width = "avx2" if request.param == "avx2" else "avx512"
    assert kernels.simd() == width, "the kernels failed to build: see the warning"
    if request.param == "amx":
        state = kernels.library().glassformer_amx()
        if state == -1:
            pytest.skip("Linux refuses this process the AMX tile registers (kernel before 5.16)")
        assert state == 1, "the kernels were built without the tile unit: see the warning"
    else:
        assert not kernels.amx()
    return request.param


def rounded_product(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A w8a8 or w4a8 module's function in float64, the reference every kernel that computes it
    is held to: x rounded to int8 in groups of 32 as llama.cpp's Q8_0 rounds it (d = max|x| /
    127 in float32, q = round(x / d): test_quant checks round_to_int8 against gguf-py), times
    the module's dequantized weight, plus its bias."""
    groups = x.float().unflatten(-1, (-1, 32))
    d = groups.abs().amax(-1, keepdim=True) / 127
    q = torch.round(groups * torch.where(d != 0, 1.0 / d, torch.zeros_like(d)))
    y = (q.double() * d.double()).flatten(-2) @ module.dequantize().double().T
    return y if module.bias is None else y + module.bias.double()


# --- tiny training runs -----------------------------------------------------------------------


def hamlet_corpus(folder: Path) -> Path:
    """The first 20,000 characters of Hamlet, as folder/hamlet.txt."""
    from glassformer.data import shakespeare_plays

    corpus = folder / "hamlet.txt"
    if not corpus.exists():
        plays = shakespeare_plays("modern")
        corpus.write_text(plays[next(k for k in plays if "hamlet" in k)][:20_000], "utf-8")
    return corpus


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> str:
    """Two plays' worth of text in a folder: the real corpus, small enough for fast tests."""
    from glassformer.data import shakespeare_plays

    folder = tmp_path_factory.mktemp("corpus")
    plays = shakespeare_plays("modern")
    for name in ("hamlet", "macbeth"):
        key = next(k for k in plays if name in k)
        (folder / f"{name}.txt").write_text(plays[key][:60_000], encoding="utf-8")
    return str(folder)


def char_run(out_dir, corpus: str, model: dict, **train):
    """The RunConfig of a 20-step character-level run of `model` on `corpus` (e.g.
    small_corpus), evaluated and saved every 10 steps; `train` values override [train]'s."""
    from glassformer.train.config import RunConfig

    return RunConfig.from_dict(
        {
            "model": model,
            "data": {"corpus": corpus, "tokenizer": "char"},
            "train": {
                "out_dir": str(out_dir), "max_steps": 20, "batch_size": 8, "warmup_steps": 4,
                "learning_rate": 3e-3, "eval_interval": 10, "eval_batches": 2,
                "checkpoint_interval": 10, **train,
            },
        }
    )  # fmt: skip


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
