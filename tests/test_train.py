"""Training: the loss falls below the unigram baseline, resume equals an uninterrupted run, the
schedule and optimizer groups are what they claim (seed 000 §2.1-2.2)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import char_run

from glassformer.train.checkpoint import list_checkpoints
from glassformer.train.config import RunConfig, TrainConfig, load_run_config, parse_override
from glassformer.train.tasks import unigram_entropy
from glassformer.train.trainer import Trainer, learning_rate, make_optimizer

TINY_MODEL = dict(
    d_model=48, n_layers=2, n_heads=4, max_seq_len=32, position="rope", norm="rms", ffn="swiglu"
)


def tiny_run(out_dir, corpus: str, **train) -> RunConfig:
    return char_run(out_dir, corpus, dict(TINY_MODEL), **train)


def test_resume_equals_uninterrupted(tmp_path, small_corpus):
    # Dropout and gradient accumulation make the RNG state and data position matter.
    extra = {"grad_accum_steps": 2}
    straight = tiny_run(tmp_path / "straight", small_corpus, **extra)
    straight.model["dropout"] = 0.1
    full = Trainer(straight, progress=False).fit()

    split = tiny_run(tmp_path / "split", small_corpus, **extra)
    split.model["dropout"] = 0.1
    Trainer(split, progress=False).fit(max_steps=13)  # "interrupted" after step 13
    resumed = Trainer(split, resume=True, progress=False).fit()

    assert resumed.steps == full.steps == 20
    assert resumed.train_losses == full.train_losses  # exact, not approximate
    assert resumed.val_loss == full.val_loss


def test_checkpoints_are_kept_and_pruned(tmp_path, small_corpus):
    run = tiny_run(tmp_path / "run", small_corpus, checkpoint_interval=5, keep_checkpoints=2)
    Trainer(run, progress=False).fit()
    names = [p.name for p in list_checkpoints(tmp_path / "run")]
    assert names == ["step-000015", "step-000020"]
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-000020"


def test_unigram_entropy_closed_form():
    # Two tokens with frequencies 3/4 and 1/4.
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert unigram_entropy([[0, 0, 1], [0]]) == pytest.approx(expected)


def test_learning_rate_schedule():
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert learning_rate(0, cfg) == pytest.approx(0.1)  # (0 + 1) / 10 of the peak
    assert learning_rate(9, cfg) == pytest.approx(1.0)
    assert learning_rate(10, cfg) == pytest.approx(1.0)  # cosine starts at the peak
    assert learning_rate(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: cos = 0
    assert learning_rate(110, cfg) == pytest.approx(0.1)
    assert learning_rate(500, cfg) == pytest.approx(0.1)


def test_weight_decay_only_on_matrices():
    from glassformer import ModelConfig, build_model

    model = build_model(ModelConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2, bias=True))
    optimizer = make_optimizer(model, TrainConfig(weight_decay=0.1))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    n_params = sum(1 for _ in model.parameters())
    assert len(decay["params"]) + len(no_decay["params"]) == n_params


def test_overrides_parse_as_toml_values():
    assert parse_override("train.max_steps=100") == ("train", "max_steps", 100)
    assert parse_override("model.position=alibi") == ("model", "position", "alibi")
    assert parse_override("train.learning_rate=3e-4") == ("train", "learning_rate", 3e-4)
    run = load_run_config(None, ["train.dtype=bf16", "model.n_layers=3"])
    assert run.train.dtype == "bf16" and run.model["n_layers"] == 3


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("train.max_step=3", "unknown \\[train\\] key"),
        ("trian.max_steps=3", "section.key=value"),
        ("data.chunking=chop", "chunking='chop' is not known"),
        ("train.dtype=fp8", "dtype='fp8' is not known"),
    ],
)
def test_bad_config_values_are_named(override, match):
    with pytest.raises(ValueError, match=match):
        load_run_config(None, [override])


@pytest.mark.slow
def test_tiny_model_learns_the_installed_corpus(tmp_path):
    """A few hundred steps on all 37 plays take the loss well below the unigram entropy."""
    run = RunConfig.from_dict(
        {
            "model": dict(TINY_MODEL, d_model=64, max_seq_len=64),
            "data": {"corpus": "shakespeare", "tokenizer": "char"},
            "train": {
                "out_dir": str(tmp_path / "run"), "max_steps": 300, "batch_size": 16,
                "warmup_steps": 20, "learning_rate": 3e-3, "eval_interval": 300,
                "eval_batches": 8, "checkpoint_interval": 300,
            },
        }
    )  # fmt: skip
    torch.manual_seed(0)
    result = Trainer(run, progress=False).fit()
    assert result.baseline_loss == pytest.approx(3.3, abs=0.1)  # ~83 characters
    assert result.val_loss < 2.3, result.val_loss


def test_packed_bpe_run_starts_at_log_vocab_and_learns(tmp_path, small_corpus):
    """Packing paragraphs with a trained byte-level BPE: at initialization the loss is about
    ln(V) (near-uniform predictions), and it falls from there."""
    run = RunConfig.from_dict(
        {
            "model": dict(TINY_MODEL, max_seq_len=64),
            "data": {
                "corpus": small_corpus, "tokenizer": "bpe", "bpe_vocab_size": 300,
                "documents": "paragraph", "chunking": "pack",
            },
            "train": {
                "out_dir": str(tmp_path / "run"), "max_steps": 40, "batch_size": 8,
                "warmup_steps": 5, "learning_rate": 3e-3, "eval_interval": 40,
                "eval_batches": 2, "checkpoint_interval": 40,
            },
        }
    )  # fmt: skip
    trainer = Trainer(run, progress=False)
    assert trainer.task.train_examples.document_ids is not None  # packed, with document masks
    result = trainer.fit()
    vocab = trainer.tokenizer.vocab_size
    assert result.train_losses[0] == pytest.approx(math.log(vocab), abs=0.15)
    assert result.train_losses[-1] < result.train_losses[0] - 1.0
