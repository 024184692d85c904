"""The Folio -> modern translation task: batches, held-out plays, a tiny end-to-end training run
of the encoder–decoder, and the `translate` CLI on its checkpoint."""

from __future__ import annotations

import random

import pytest
import torch

from glassformer.cli import main
from glassformer.data.parallel import ParallelPair, play_pairs
from glassformer.train import translation
from glassformer.train.config import RunConfig
from glassformer.train.task_table import TASKS, make_task
from glassformer.train.trainer import Trainer

# modern -> Folio spellings, the letters the Folio prints differently
SPELLINGS = {
    "love": "loue",
    "have": "haue",
    "give": "giue",
    "upon": "vpon",
    "unto": "vnto",
    "live": "liue",
    "heaven": "heauen",
    "ever": "euer",
    "the": "the",
    "king": "King",
    "good": "good",
    "night": "night",
}
TOY_PLAYS = ("alpha", "beta", *translation.VALIDATION_PLAYS, *translation.TEST_PLAYS)


def toy_pairs(n: int = 400, seed: int = 0) -> tuple[ParallelPair, ...]:
    rng = random.Random(seed)
    pairs = []
    for k in range(n):
        words = rng.choices(sorted(SPELLINGS), k=rng.randint(2, 5))
        modern = " ".join(words).capitalize() + "."
        folio = " ".join(SPELLINGS[w] for w in words)
        folio = folio[0].upper() + folio[1:]
        pairs.append(ParallelPair(folio, modern, TOY_PLAYS[k % len(TOY_PLAYS)]))
    return tuple(pairs)


@pytest.fixture
def toy_corpus(monkeypatch):
    pairs = toy_pairs()
    monkeypatch.setattr(translation, "parallel_corpus", lambda *args: pairs)
    return pairs


def tiny_run(out_dir: str = "unused", max_steps: int = 60) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": dict(
                family="seq2seq", d_model=48, n_layers=1, n_encoder_layers=1, n_heads=2,
                max_seq_len=48, position="sinusoidal", norm_position="pre", ffn="relu",
                label_smoothing=0.0,
            ),
            "data": dict(task="translation", tokenizer="bpe", bpe_vocab_size=259),
            "train": dict(
                out_dir=out_dir, max_steps=max_steps, batch_size=16, learning_rate=3e-3,
                min_lr=3e-4, warmup_steps=5, weight_decay=0.0, eval_interval=max_steps,
                eval_batches=2, checkpoint_interval=max_steps, seed=7,
            ),
        }
    )  # fmt: skip


def test_collate_places_bos_eos_and_padding():
    ids = translation.SpecialIds(pad=0, bos=1, eos=2)
    batch = translation.collate([([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11])], ids)
    assert batch["src_ids"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert batch["src_padding_mask"].tolist() == [[True, True, True], [True, False, False]]
    assert batch["tgt_ids"].tolist() == [[1, 8, 9, 0, 0], [1, 8, 9, 10, 11]]
    assert batch["targets"].tolist() == [[8, 9, 2, -100, -100], [8, 9, 10, 11, 2]]


def test_task_batches(toy_corpus):
    task = make_task(tiny_run())
    assert isinstance(task, TASKS["translation"])
    ids = task.ids
    assert (ids.pad, ids.bos, ids.eos) == (0, 1, 2)
    assert task.tokenizer.vocab_size == 259
    batch = task.train_batch(step=3, batch_size=8, seed=11)
    assert set(batch) == {"src_ids", "tgt_ids", "targets", "src_padding_mask"}
    B, T = batch["tgt_ids"].shape
    assert B == 8 and batch["targets"].shape == (B, T)
    assert (batch["tgt_ids"][:, 0] == ids.bos).all()
    for row in range(B):
        real = batch["targets"][row] != -100
        n = int(real.sum())
        assert real[:n].all() and not real[n:].any()  # -100 only after the end
        assert batch["targets"][row, n - 1] == ids.eos
        # teacher forcing: the decoder input is the target shifted right by one
        assert torch.equal(batch["tgt_ids"][row, 1:n], batch["targets"][row, : n - 1])
        assert (batch["tgt_ids"][row, n:] == ids.pad).all()
        n_src = int(batch["src_padding_mask"][row].sum())
        assert (batch["src_ids"][row, n_src:] == ids.pad).all()
        text = task.tokenizer.decode(batch["src_ids"][row, :n_src])
        reference = task.tokenizer.decode(batch["targets"][row, : n - 1])
        assert ParallelPair(text, reference, "") in {
            ParallelPair(p.folio, p.modern, "") for p in toy_corpus
        }
    again = task.train_batch(step=3, batch_size=8, seed=11)
    assert all(torch.equal(batch[k], again[k]) for k in batch)  # pure in (step, seed)
    other = task.train_batch(step=4, batch_size=8, seed=11)
    assert not torch.equal(batch["src_ids"][:, :4], other["src_ids"][:, :4])
    # validation batches come from the validation plays only, the same every time
    val = [p for p in toy_corpus if p.play in translation.VALIDATION_PLAYS]
    first = list(task.val_batches(batch_size=8, n_batches=2))
    assert len(first) == 2
    second = list(task.val_batches(batch_size=8, n_batches=2))
    assert all(torch.equal(a["src_ids"], b["src_ids"]) for a, b in zip(first, second, strict=True))
    assert task.tokenizer.decode(first[0]["src_ids"][0][first[0]["src_padding_mask"][0]]) == (
        val[0].folio
    )
    assert task.tokens_in(batch) == int(batch["src_padding_mask"].sum()) + int(
        (batch["targets"] != -100).sum()
    )


def test_held_out_plays_are_whole_and_disjoint():
    held_out = set(translation.VALIDATION_PLAYS) | set(translation.TEST_PLAYS)
    assert not set(translation.VALIDATION_PLAYS) & set(translation.TEST_PLAYS)
    modern_names = {modern for _, modern in play_pairs()}
    assert held_out <= modern_names  # every held-out name is a real paired play
    splits = {translation.split_of(name) for name in modern_names}
    assert splits == {"train", "validation", "test"}
    for name in modern_names:
        assert (translation.split_of(name) == "train") == (name not in held_out)


def test_copy_baseline_scores_with_sacrebleu():
    chrf, bleu = translation.score(["Long live the king!"], ["Long live the king!"])
    assert chrf == pytest.approx(100.0) and bleu == pytest.approx(100.0)
    chrf, bleu = translation.score(["Long liue the King"], ["Long live the king!"])
    assert 0 < chrf < 100 and 0 <= bleu < 100


@pytest.mark.slow
def test_tiny_training_lowers_loss_and_the_cli_translates(toy_corpus, tmp_path, capsys):
    out_dir = tmp_path / "run"
    trainer = Trainer(tiny_run(str(out_dir), max_steps=60), progress=False)
    assert trainer.model_cfg.bos_token_id == trainer.task.ids.bos
    result = trainer.fit()
    first, last = sum(result.train_losses[:5]) / 5, sum(result.train_losses[-5:]) / 5
    assert first > 4.0  # about ln(259) = 5.56 at the start
    assert last < 0.6 * first
    assert result.val_loss is not None and result.val_loss < result.baseline_loss

    capsys.readouterr()
    assert main(["translate", "--model", str(out_dir), "Loue the King", "Haue good night"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(isinstance(line, str) for line in lines)

    assert main(["translate", "--model", str(out_dir), "--beam-size", "2", "Loue"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1

    assert main(["translate", "--model", str(out_dir), "--eval", "--limit", "20"]) == 0
    out = capsys.readouterr().out
    assert "20 held-out pairs (test: macbeth)" in out
    assert "copy the input" in out and "chrF" in out and "BLEU" in out


def test_translate_cli_refuses_a_non_seq2seq_checkpoint(tmp_path, capsys):
    from glassformer.config import ModelConfig
    from glassformer.models import build_model
    from glassformer.train.checkpoint import save_checkpoint

    cfg = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    save_checkpoint(tmp_path, 0, build_model(cfg), cfg)
    assert main(["translate", "--model", str(tmp_path), "Loue"]) == 2
    assert "seq2seq" in capsys.readouterr().err


def test_word_chunks_regroup_words_under_the_limit():
    text = "Nay answer me: Stand & vnfold your selfe, and speake"
    pieces = translation.word_chunks(text, 20)
    assert " ".join(pieces) == text
    assert all(len(p) <= 20 for p in pieces) and len(pieces) == 3
    assert translation.word_chunks("", 20) == [""]
    assert translation.word_chunks("Honorificabilitudinitatibus", 10) == [
        "Honorificabilitudinitatibus"
    ]
