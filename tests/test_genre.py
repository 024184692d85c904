"""BERT fine-tuning on a real task (seed 000 §6.3): the First Folio genre of a speech. The genre
table against the Folio's catalogue, the split by whole plays, and a tiny end-to-end run:
pretrain (mlm) -> fine-tune from it (init_from) -> evaluate through the CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from glassformer.cli import main
from glassformer.data import shakespeare_plays
from glassformer.data.genre import FOLIO_GENRES, GENRES, TEST_PLAYS, genre_split, speeches
from glassformer.train.checkpoint import load
from glassformer.train.config import load_run_config
from glassformer.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def test_genre_table_follows_the_folio_catalogue():
    # The catalogue: 14 comedies, 10 histories, 11 tragedies (Troilus and Cressida is not in
    # it); every folio play of the installed package has a genre.
    assert len(FOLIO_GENRES) == 35
    counts = {g: sum(1 for v in FOLIO_GENRES.values() if v == g) for g in GENRES}
    assert counts == {"comedy": 14, "history": 10, "tragedy": 11}
    assert set(FOLIO_GENRES) == set(shakespeare_plays("folio"))
    assert FOLIO_GENRES["cymbeline"] == "tragedy" and FOLIO_GENRES["winters_tale"] == "comedy"


def test_split_holds_out_whole_plays_stratified():
    train, test = genre_split()
    train_plays = {play for _, _, play in train}
    test_plays = {play for _, _, play in test}
    assert not train_plays & test_plays
    assert test_plays == set(TEST_PLAYS) and len(train_plays) == 35 - len(TEST_PLAYS)
    held_out = [FOLIO_GENRES[p] for p in TEST_PLAYS]
    assert all(held_out.count(g) == 3 for g in GENRES)
    assert len(train) > 15_000 and len(test) > 4_000
    # Labels follow the play; speaker labels are stripped.
    assert all(GENRES[label] == FOLIO_GENRES[play] for _, label, play in train + test)


def test_speeches_drop_headings_and_speaker_labels():
    text = (
        "The Tragedie of Macbeth\n\nActus Primus. Scoena Prima.\n\n"
        "Thunder and Lightning. Enter three Witches.\n\n"
        "  1. When shall we three meet againe?\nIn Thunder, Lightning, or in Raine?\n\n"
        "   Macb. So foule and faire a day I haue not seene\n\n   3. Haile"
    )
    assert speeches(text) == [
        "When shall we three meet againe?\nIn Thunder, Lightning, or in Raine?",
        "So foule and faire a day I haue not seene",
    ]


@pytest.mark.slow
def test_pretrain_then_fine_tune_then_evaluate(tmp_path, capsys):
    torch.set_num_threads(1)
    corpus = tmp_path / "corpus.txt"
    plays = shakespeare_plays("folio")
    corpus.write_text(plays["macbeth"][:20_000], encoding="utf-8")
    pretrained = tmp_path / "pre"
    pre = load_run_config(
        REPO / "configs" / "bert-shakespeare.toml",
        [
            f'data.corpus="{corpus}"', f'train.out_dir="{pretrained}"', "train.max_steps=2",
            "data.bpe_vocab_size=300", "model.d_model=32", "model.n_layers=1",
            "model.n_heads=2", "model.max_seq_len=32", "train.batch_size=4",
            "train.threads=1", "train.eval_batches=1",
        ],
    )  # fmt: skip
    Trainer(pre, progress=False).fit()
    pre_model, _ = load(pretrained)

    out = tmp_path / "genre"
    run = load_run_config(
        REPO / "configs" / "bert-genre.toml",
        [
            f'train.init_from="{pretrained}"', f'train.out_dir="{out}"', "train.max_steps=3",
            "train.batch_size=8", "train.threads=1", "train.eval_batches=1",
        ],
    )  # fmt: skip
    trainer = Trainer(run, progress=False)
    # The encoder starts from the pretrained weights; the classifier is new.
    torch.testing.assert_close(trainer.model.tok_emb.weight, pre_model.tok_emb.weight)
    assert trainer.model.cfg.n_classes == 3 and not trainer.model.cfg.mlm_head
    assert trainer.task.tokenizer.vocab_size == 300  # the pretrained checkpoint's tokenizer
    result = trainer.fit()
    assert result.val_loss is not None and len(result.train_losses) == 3

    assert main(["evaluate", "--model", str(out)]) == 0
    text = capsys.readouterr().out
    match = re.search(r"held-out accuracy ([\d.]+) on (\d+) examples vs ([\d.]+)", text)
    assert match is not None, text
    accuracy, n_test, majority = float(match[1]), int(match[2]), float(match[3])
    _, test = genre_split()
    assert n_test == len(test) and 0.0 <= accuracy <= 1.0
    # The majority class of the training plays is comedy (14 of 35 plays).
    comedy = sum(1 for _, label, _ in test if GENRES[label] == "comedy") / len(test)
    assert majority == pytest.approx(comedy, abs=1e-4) and "(comedy)" in text
