"""BERT pretraining (seed 000 §6.3): masking statistics 15% / 80-10-10, loss only on the selected
positions, the encoder seeing both directions (and GPT never), the mlm task and its trainer run,
and fill-mask through the CLI on a trained checkpoint and on a Hugging Face BertForMaskedLM."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM

from glassformer.cli import main
from glassformer.config import ModelConfig
from glassformer.data import batch_indices, shakespeare_plays
from glassformer.data.mlm import mask_tokens, mlm_generator
from glassformer.models import build_model
from glassformer.tokenizers import load_tokenizer
from glassformer.train.bert_tasks import BERT_SPECIAL_TOKENS, MaskedLanguageModelingTask
from glassformer.train.config import load_run_config
from glassformer.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
PAD, CLS, SEP, MASK = 0, 1, 2, 3
SPECIAL = [PAD, CLS, SEP, MASK]
VOCAB = 50


def _rows(n_rows: int = 400, length: int = 64) -> torch.Tensor:
    """[CLS] real tokens [SEP] then padding, with a different number of pads per row."""
    ids = torch.randint(4, VOCAB, (n_rows, length))
    ids[:, 0] = CLS
    for row in range(n_rows):
        end = length - 1 - row % 17
        ids[row, end] = SEP
        ids[row, end + 1 :] = PAD
    return ids


def _mask(ids: torch.Tensor, seed: int = 0, step: int = 0):
    return mask_tokens(
        ids,
        mask_token_id=MASK,
        special_ids=SPECIAL,
        vocab_size=VOCAB,
        generator=mlm_generator(seed, step),
    )


# --- masking ------------------------------------------------------------------------------------


def test_masking_statistics_15_percent_then_80_10_10():
    ids = _rows()
    corrupted, targets = _mask(ids)
    real = ~torch.isin(ids, torch.tensor(SPECIAL))
    selected = targets != -100
    n_real, n_sel = int(real.sum()), int(selected.sum())
    # ~21k real tokens: the binomial standard deviation of the selected share is ~0.25%.
    assert abs(n_sel / n_real - 0.15) < 0.01
    masked = selected & (corrupted == MASK)
    kept = selected & (corrupted == ids)
    # A random replacement can draw the original token (1 in 46): it counts as "kept" here.
    replaced = selected & (corrupted != MASK) & (corrupted != ids)
    assert abs(masked.sum() / n_sel - 0.8) < 0.03
    assert abs(replaced.sum() / n_sel - 0.1 * 45 / 46) < 0.02
    assert abs(kept.sum() / n_sel - (0.1 + 0.1 / 46)) < 0.02
    # Unselected tokens are untouched; random replacements are ordinary tokens.
    assert torch.equal(corrupted[~selected], ids[~selected])
    assert bool((corrupted[replaced] >= 4).all())


def test_special_tokens_and_padding_are_never_selected():
    ids = _rows()
    for step in range(5):
        corrupted, targets = _mask(ids, step=step)
        special = torch.isin(ids, torch.tensor(SPECIAL))
        assert bool((targets[special] == -100).all())
        assert torch.equal(corrupted[special], ids[special])
        assert torch.equal(targets[targets != -100], ids[targets != -100])


def test_masking_is_a_pure_function_of_seed_and_step():
    ids = _rows(50)
    a, b = _mask(ids, seed=7, step=3), _mask(ids, seed=7, step=3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = _mask(ids, seed=7, step=4)
    d = _mask(ids, seed=8, step=3)
    assert not torch.equal(a[1], c[1]) and not torch.equal(a[1], d[1])


# --- the model ----------------------------------------------------------------------------------


def _tiny_bert(**overrides) -> torch.nn.Module:
    cfg = ModelConfig.preset(
        "bert-base", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, d_ff=64,
        max_seq_len=64, **overrides,
    )  # fmt: skip
    return build_model(cfg).eval()


def test_mlm_loss_is_cross_entropy_over_the_selected_positions_only():
    model = _tiny_bert()
    ids = _rows(6, 24)
    corrupted, targets = _mask(ids, seed=1)
    padding_mask = ids != PAD
    with torch.no_grad():
        out = model.loss(corrupted, targets, padding_mask=padding_mask)
        logits = model.mlm_logits(model(corrupted, padding_mask=padding_mask))  # (B, T, V)
    # By hand: -log p(original) at the selected positions, averaged over them alone.
    log_probs = logits.log_softmax(-1)
    rows, cols = (targets != -100).nonzero(as_tuple=True)
    expected = -log_probs[rows, cols, targets[rows, cols]].mean()
    assert len(rows) > 0
    torch.testing.assert_close(out.ce_loss, expected, rtol=1e-5, atol=1e-5)
    # Changing the target of an unselected position (there is none) cannot matter; moving a
    # selection changes the loss.
    moved = targets.clone()
    moved[rows[0], cols[0]] = -100
    with torch.no_grad():
        assert not torch.isclose(
            model.loss(corrupted, moved, padding_mask=padding_mask).ce_loss, expected
        )


def test_encoder_sees_both_directions_and_the_decoder_never_looks_ahead():
    ids = torch.randint(4, VOCAB, (1, 12))
    later = ids.clone()
    later[0, 9] = (ids[0, 9] + 1 - 4) % (VOCAB - 4) + 4  # a different token at position 9
    bert = _tiny_bert()
    gpt = build_model(
        ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
    ).eval()
    with torch.no_grad():
        b1, b2 = bert(ids), bert(later)
        g1, g2 = gpt(ids), gpt(later)
    # BERT: every earlier position's hidden state changes; GPT: none of them does.
    assert bool(((b1[0, :9] - b2[0, :9]).abs().amax(-1) > 1e-4).all())
    assert torch.equal(g1[0, :9], g2[0, :9])
    assert not torch.equal(g1[0, 9:], g2[0, 9:])


def test_classification_and_nsp_heads_add_their_losses():
    model = _tiny_bert(pooler=True, n_classes=3, nsp_head=True)
    ids = _rows(4, 16)
    labels = torch.tensor([0, 2, 1, 2])
    with torch.no_grad():
        out = model.loss(ids, labels=labels, padding_mask=ids != PAD)
        hidden = model(ids, padding_mask=ids != PAD)
        pooled = torch.tanh(model.pooler.dense(hidden[:, 0]))
        expected = F.cross_entropy(
            pooled @ model.classifier.weight.T + model.classifier.bias, labels
        )
    torch.testing.assert_close(out.ce_loss, expected)
    corrupted, targets = _mask(ids)
    nsp = torch.tensor([0, 1, 1, 0])
    with torch.no_grad():
        mlm_only = model.loss(corrupted, targets)
        both = model.loss(corrupted, targets, nsp_labels=nsp)
        nsp_ce = F.cross_entropy(model.nsp_logits(model(corrupted)), nsp)
    torch.testing.assert_close(both.ce_loss, mlm_only.ce_loss)
    torch.testing.assert_close(both.loss, mlm_only.loss + nsp_ce)
    with pytest.raises(ValueError, match="exactly one"):
        model.loss(ids)


# --- the task, the trainer and fill-mask ------------------------------------------------------


def _mlm_run(tmp: Path, out: Path, steps: int, **extra):
    corpus = tmp / "macbeth.txt"
    corpus.write_text(shakespeare_plays("modern")["macbeth"][:40_000], encoding="utf-8")
    overrides = [
        f'data.corpus="{corpus}"', f'train.out_dir="{out}"', f"train.max_steps={steps}",
        "data.bpe_vocab_size=300", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
        "model.max_seq_len=32", "train.batch_size=16", "train.warmup_steps=10",
        "train.learning_rate=3e-3", f"train.eval_interval={steps}", "train.eval_batches=4",
        f"train.checkpoint_interval={steps}", "train.threads=1", "data.val_fraction=0.2",
    ]  # fmt: skip
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return load_run_config(REPO / "configs" / "bert-shakespeare.toml", overrides)


def test_mlm_task_rows_and_reproducible_batches(tmp_path):
    run = _mlm_run(tmp_path, tmp_path / "run", steps=1)
    task = MaskedLanguageModelingTask(run)
    tok = task.tokenizer
    assert [tok.token_to_id(t) for t in BERT_SPECIAL_TOKENS] == [PAD, CLS, SEP, MASK]
    assert bool((task.train_rows[:, 0] == CLS).all())
    ends = task.train_pad.sum(1) - 1  # [SEP] closes the real tokens of every row
    assert bool((task.train_rows[torch.arange(len(ends)), ends] == SEP).all())
    a, b = task.train_batch(5, 8, seed=3), task.train_batch(5, 8, seed=3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["targets"], task.train_batch(6, 8, seed=3)["targets"])
    # A tokenizer saved with a checkpoint loads back with the same special ids.
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("to [MASK]")[-1] == MASK and loaded.token_to_id("[CLS]") == CLS
    assert MaskedLanguageModelingTask(run, tokenizer=loaded).baseline_loss == task.baseline_loss


@pytest.fixture(scope="module")
def trained_mlm(tmp_path_factory) -> tuple[Path, object]:
    tmp = tmp_path_factory.mktemp("mlm")
    out = tmp / "run"
    torch.set_num_threads(1)
    result = Trainer(_mlm_run(tmp, out, steps=120), progress=False).fit()
    return out, result


@pytest.mark.slow
def test_mlm_training_lowers_the_loss_well_under_ln_v(trained_mlm):
    _, result = trained_mlm
    # 120 steps of a 0.13M-parameter encoder learn the token frequencies (the unigram
    # baseline, ~3.9 nats) and start on context; a uniform guess scores ln V = 5.7.
    first = sum(result.train_losses[:5]) / 5
    assert first > math.log(300) - 0.3  # it starts as a uniform guess
    assert result.val_loss < math.log(300) - 1.5, result.val_loss
    assert result.val_loss < result.baseline_loss + 0.2, (result.val_loss, result.baseline_loss)


@pytest.mark.slow
def test_fill_mask_cli_on_a_trained_checkpoint(trained_mlm, capsys):
    out, _ = trained_mlm
    assert main(["fill-mask", "--model", str(out), "Fair is [MASK], and foul is [MASK]"]) == 0
    text = capsys.readouterr().out
    blocks = text.split("[MASK] ")[1:]
    assert len(blocks) == 2  # one list of candidates per [MASK]
    for block in blocks:
        probs = [float(p) for p in re.findall(r"^\s+([01]\.\d{4})\s", block, flags=re.M)]
        assert len(probs) == 5 and probs == sorted(probs, reverse=True)
        assert 0 < sum(probs) <= 1 + 1e-4
    assert text.splitlines()[-1].startswith("top-1: Fair is")


@pytest.mark.slow
def test_mlm_resume_repeats_the_uninterrupted_run(tmp_path):
    straight = Trainer(_mlm_run(tmp_path, tmp_path / "a", steps=4), progress=False).fit()
    first = Trainer(_mlm_run(tmp_path, tmp_path / "b", steps=4), progress=False)
    first.fit(max_steps=2)
    first.save()
    resumed = Trainer(_mlm_run(tmp_path, tmp_path / "b", steps=4), resume=True, progress=False)
    result = resumed.fit()
    assert result.train_losses == pytest.approx(straight.train_losses, abs=1e-6)


def test_fill_mask_on_a_hugging_face_bert_for_masked_lm(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "to", "be", "or", "not"]
    hf_tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    hf_tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf_tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    hf_tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    hf_tok.save(str(tmp_path / "tokenizer.json"))
    cfg = BertConfig(
        vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    ref = BertForMaskedLM(cfg).eval()
    ref.save_pretrained(tmp_path)
    ids = torch.tensor([[2, 5, 6, 7, 8, 5, 4, 3]])  # [CLS] to be or not to [MASK] [SEP]
    with torch.no_grad():
        expected = ref(input_ids=ids).logits[0, 6].softmax(-1).topk(3)
    assert (
        main(["fill-mask", "--model", str(tmp_path), "to be or not to [MASK]", "--top-k", "3"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    shown = [(float(line.split()[0]), line.split()[1].strip("'")) for line in lines[1:4]]
    assert [w for _, w in shown] == [words[i] for i in expected.indices.tolist()]
    assert [p for p, _ in shown] == pytest.approx(expected.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("kind", ["sequence-classification", "pretraining"])
def test_hf_task_heads_load_with_the_same_logits(tmp_path, kind):
    from transformers import BertForPreTraining, BertForSequenceClassification

    from glassformer.interop.hf import save_hf_model
    from glassformer.interop.pretrained import from_pretrained

    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=48, max_position_embeddings=24, num_labels=3,
    )  # fmt: skip
    cls = BertForSequenceClassification if kind == "sequence-classification" else BertForPreTraining
    ref = cls(cfg).eval()
    with torch.no_grad():  # transformers zeroes biases: make every tensor distinctive
        for param in ref.parameters():
            param.add_(0.05 * torch.randn_like(param))
    ref.save_pretrained(tmp_path / "hf")
    model, _ = from_pretrained(tmp_path / "hf")
    ids = torch.randint(4, VOCAB, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask)
        hidden = model(ids, padding_mask=mask.bool())
        if kind == "sequence-classification":
            assert model.cfg.n_classes == 3 and not model.cfg.mlm_head
            torch.testing.assert_close(model.classify(hidden), expected.logits, atol=1e-4, rtol=0)
        else:
            assert model.cfg.nsp_head and model.cfg.mlm_head
            torch.testing.assert_close(
                model.nsp_logits(hidden), expected.seq_relationship_logits, atol=1e-4, rtol=0
            )
            real = mask.bool()
            torch.testing.assert_close(
                model.mlm_logits(hidden)[real], expected.prediction_logits[real], atol=1e-4, rtol=0
            )
    # ... and back: transformers loads glassformer's export with the same logits.
    save_hf_model(model, tmp_path / "back")
    again = cls.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        out = again(input_ids=ids, attention_mask=mask)
    key = "logits" if kind == "sequence-classification" else "seq_relationship_logits"
    torch.testing.assert_close(getattr(out, key), getattr(expected, key), atol=1e-4, rtol=0)


def test_nsp_pairs_half_real_half_random(tmp_path):
    run = _mlm_run(tmp_path, tmp_path / "run", steps=1, **{"data.nsp": "true"})
    task = MaskedLanguageModelingTask(run)
    assert task.model_config(run).nsp_head
    labels, width = [], task.block_size - 3
    for step in range(20):
        batch = task.train_batch(step, 16, seed=0)
        picks = batch_indices(task.n_train, 16, step, 0)
        # Undo the masking: the original ids are the targets where selected.
        originals = torch.where(batch["targets"] != -100, batch["targets"], batch["input_ids"])
        for row, types, label, i in zip(
            originals, batch["token_type_ids"], batch["nsp_labels"], picks, strict=True
        ):
            seps = (row == SEP).nonzero().squeeze(1).tolist()
            assert row[0] == CLS and len(seps) == 2
            # Segment A ([CLS] A [SEP]) is type 0, segment B (B [SEP]) type 1.
            assert types[: seps[0] + 1].eq(0).all() and types[seps[0] + 1 : seps[1] + 1].eq(1).all()
            piece = task.train_pieces[int(i)][:width]
            half = len(piece) // 2
            assert row[1 : seps[0]].tolist() == piece[:half]
            continues = row[seps[0] + 1 : seps[1]].tolist() == piece[half:]
            assert continues == (label == 0)  # IsNext exactly when B is A's own continuation
            labels.append(int(label))
    assert abs(sum(labels) / len(labels) - 0.5) < 0.1
    out = build_model(task.model_config(run)).loss(**task.train_batch(0, 8, seed=0))
    assert out.loss > out.ce_loss  # the next-sentence loss is added to the masked-LM loss
