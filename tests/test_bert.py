"""BERT (seed 000 §6.3) against Hugging Face transformers: random-init BertModel and
BertForMaskedLM built offline, saved, loaded by glassformer, same numbers on a padded batch with
token types; the reverse direction through save_hf_model; and all-MiniLM-L6-v2's real weights,
tokenizer and sentence embeddings. Plus the `embed` command."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoTokenizer, BertConfig, BertForMaskedLM, BertModel

from glassformer import cli
from glassformer.config import ModelConfig
from glassformer.infer.embed import embed
from glassformer.interop.hf import InteropError, load_hf_model, save_hf_model
from glassformer.interop.pretrained import from_pretrained, resolve
from glassformer.models import BERT, build_model

TOL = 1e-4
VOCAB = 101
LENGTHS = [11, 7, 3]  # right padding: rows 2 and 3 end in pads


def _hf_config(**overrides) -> BertConfig:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        hidden_act="gelu",
        max_position_embeddings=24,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
    )
    fields.update(overrides)
    return BertConfig(**fields)


def _randomize(model: torch.nn.Module) -> None:
    """transformers initializes biases to 0 and norms to 1: make every tensor distinctive, so a
    bias or norm mapped to the wrong place shows up."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("LayerNorm.weight", "norm.weight")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))


def _batch(max_type: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (B, T), token types (segment B in the second half of each row), attention mask."""
    T = max(LENGTHS)
    ids = torch.randint(1, VOCAB, (len(LENGTHS), T))
    mask = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    types = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1
        types[row, n // 2 : n] = torch.randint(1, max_type + 1, (n - n // 2,))
    ids[mask == 0] = 0  # [PAD]
    return ids, types, mask


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b)[mask.bool()].abs().max().item()


# --- BertModel -------------------------------------------------------------------------------

ENCODER_CASES = {
    "gelu-4heads-pooler": dict(),
    "relu-2heads-nopooler": dict(num_attention_heads=2, hidden_act="relu", pooler=False),
    "gelu_new-8heads-3types": dict(
        hidden_size=48, num_attention_heads=8, intermediate_size=100, num_hidden_layers=3,
        hidden_act="gelu_new", type_vocab_size=3, layer_norm_eps=1e-5,
    ),
    "gelu-1head-wide": dict(num_attention_heads=1, hidden_size=24, intermediate_size=96),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ENCODER_CASES))
def test_bert_model_matches_transformers(tmp_path, case):
    overrides = dict(ENCODER_CASES[case])
    pooler = overrides.pop("pooler", True)
    hf_cfg = _hf_config(**overrides)
    ref = BertModel(hf_cfg, add_pooling_layer=pooler).eval()
    _randomize(ref)
    ref.save_pretrained(tmp_path)

    model, tokenizer = from_pretrained(tmp_path)
    assert isinstance(model, BERT) and tokenizer is None
    assert model.cfg.pooler == pooler and not model.cfg.mlm_head

    ids, types, mask = _batch(hf_cfg.type_vocab_size - 1)
    with torch.no_grad():
        expected = ref(input_ids=ids, token_type_ids=types, attention_mask=mask)
        hidden = model(ids, token_type_ids=types, padding_mask=mask.bool())
    assert hidden.shape == expected.last_hidden_state.shape
    assert _max_diff(hidden, expected.last_hidden_state, mask) <= TOL
    if pooler:
        assert (model.pooled(hidden) - expected.pooler_output).abs().max().item() <= TOL
    else:
        with pytest.raises(ValueError, match="no pooler"):
            model.pooled(hidden)


def test_bert_prefixed_keys_and_default_token_types(tmp_path):
    # Task models (BertForSequenceClassification, ...) store the encoder under `bert.`; here a
    # BertModel is saved that way by hand. No token_type_ids means segment 0, as in transformers.
    ref = BertModel(_hf_config()).eval()
    _randomize(ref)
    ref.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    save_file({f"bert.{k}": v for k, v in state.items()}, tmp_path / "model.safetensors")
    model, _ = load_hf_model(tmp_path)
    ids, _, mask = _batch()
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask)
        hidden = model(ids, padding_mask=mask)
    assert _max_diff(hidden, expected.last_hidden_state, mask) <= TOL
    assert (model.pooled(hidden) - expected.pooler_output).abs().max().item() <= TOL


# --- BertForMaskedLM -------------------------------------------------------------------------

MLM_CASES = {
    "gelu-tied": dict(),
    "relu-tied-6heads": dict(hidden_act="relu", num_attention_heads=6, hidden_size=36),
    "gelu_new-untied": dict(hidden_act="gelu_new", tie_word_embeddings=False),
}


@pytest.mark.parametrize("case", list(MLM_CASES))
def test_bert_mlm_matches_transformers(tmp_path, case):
    hf_cfg = _hf_config(**MLM_CASES[case])
    ref = BertForMaskedLM(hf_cfg).eval()
    _randomize(ref)
    ref.save_pretrained(tmp_path)

    model, _ = from_pretrained(tmp_path)
    assert model.cfg.mlm_head and not model.cfg.pooler
    assert model.cfg.tie_embeddings == hf_cfg.tie_word_embeddings

    ids, types, mask = _batch()
    labels = torch.full_like(ids, -100)
    labels[0, [1, 4, 9]] = torch.tensor([5, 17, 60])
    labels[2, 1] = 33
    with torch.no_grad():
        expected = ref(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=labels)
        logits = model.mlm_logits(model(ids, token_type_ids=types, padding_mask=mask))
        loss = model.loss(ids, labels, token_type_ids=types, padding_mask=mask)
    assert logits.shape == (*ids.shape, VOCAB)
    assert _max_diff(logits, expected.logits, mask) <= TOL
    assert abs(loss.loss.item() - expected.loss.item()) <= TOL
    assert loss.ce_loss.item() == loss.loss.item()  # dense FFN: no aux loss


# --- glassformer -> transformers --------------------------------------------------------------


@pytest.mark.parametrize("heads", ["encoder+pooler", "mlm"])
def test_save_hf_model_runs_in_transformers(tmp_path, heads):
    mlm = heads == "mlm"
    cfg = ModelConfig.preset(
        "bert-base", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, d_ff=64,
        max_seq_len=16, ffn="gelu_tanh" if mlm else "relu", pooler=not mlm, mlm_head=mlm,
    )  # fmt: skip
    model = build_model(cfg).eval()
    _randomize(model)
    save_hf_model(model, tmp_path)

    ref = (BertForMaskedLM if mlm else AutoModel).from_pretrained(tmp_path).eval()
    ids, types, mask = _batch()
    with torch.no_grad():
        expected = ref(input_ids=ids, token_type_ids=types, attention_mask=mask)
        hidden = model(ids, token_type_ids=types, padding_mask=mask)
        if mlm:
            assert _max_diff(model.mlm_logits(hidden), expected.logits, mask) <= TOL
        else:
            assert _max_diff(hidden, expected.last_hidden_state, mask) <= TOL
            assert (model.pooled(hidden) - expected.pooler_output).abs().max().item() <= TOL
    # and back: glassformer reads its own export with the same heads
    again, _ = load_hf_model(tmp_path)
    assert (again.cfg.pooler, again.cfg.mlm_head) == (cfg.pooler, cfg.mlm_head)


# --- errors -----------------------------------------------------------------------------------


def _saved_bert(tmp_path, **overrides):
    ref = BertModel(_hf_config(**overrides))
    ref.save_pretrained(tmp_path)
    return tmp_path


def _edit_config(folder, **changes):
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_bert_loading_errors_are_clear(tmp_path):
    folder = _saved_bert(tmp_path)
    _edit_config(folder, position_embedding_type="relative_key")
    with pytest.raises(InteropError, match="position_embedding_type='relative_key'"):
        load_hf_model(folder)
    _edit_config(folder, position_embedding_type="absolute", hidden_act="quick_gelu")
    with pytest.raises(InteropError, match=r"hidden_act='quick_gelu'.*supported are gelu"):
        load_hf_model(folder)
    _edit_config(folder, hidden_act="gelu")
    # a task head glassformer does not have (question answering) is refused, not dropped
    state = load_file(folder / "model.safetensors")
    state["qa_outputs.weight"] = torch.zeros(2, 32)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(InteropError, match=r"qa_outputs\.weight"):
        load_hf_model(folder)


def test_bert_input_errors_are_clear():
    cfg = ModelConfig.preset(
        "bert-base", vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=8
    )
    model = build_model(cfg)
    with pytest.raises(ValueError, match=f"token id {VOCAB} is outside"):
        model(torch.tensor([[1, VOCAB]]))
    with pytest.raises(ValueError, match="9 tokens is longer than max_seq_len=8"):
        model(torch.ones(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="token type id 2 is outside"):
        model(torch.ones(1, 3, dtype=torch.long), token_type_ids=torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="padding_mask has shape"):
        model(torch.ones(2, 3, dtype=torch.long), padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="no masked-LM head"):
        build_model(model.cfg.replace(mlm_head=False)).mlm_logits(torch.zeros(1, 2, 16))


def test_bert_base_preset_has_bert_base_uncased_parameter_count():
    # bert-base-uncased: 110,106,428 parameters with its NSP head (768*2 + 2 = 1,538).
    with torch.device("meta"):  # shapes only, no memory
        model = build_model(ModelConfig.preset("bert-base"))
    assert sum(p.numel() for p in model.parameters()) == 110_106_428 - 1_538


# --- all-MiniLM-L6-v2: real weights -------------------------------------------------------------

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome, and everyone in the theater loved it!",
    "Stock markets fell sharply on Monday.",
]


@pytest.fixture(scope="module")
def minilm():
    model, tokenizer = from_pretrained("minilm")
    folder = resolve("minilm")
    ref = AutoModel.from_pretrained(str(folder)).eval()
    return model, tokenizer, ref, AutoTokenizer.from_pretrained(str(folder)), folder


def _sentence_transformers_recipe(folder) -> None:
    """The folder's own pipeline is Transformer -> mean Pooling -> Normalize."""
    modules = json.loads((folder / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == [
        "Transformer", "Pooling", "Normalize",
    ]  # fmt: skip
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    modes = {k for k, v in pooling.items() if k.startswith("pooling_mode") and v}
    assert modes == {"pooling_mode_mean_tokens"}


def test_minilm_matches_transformers(minilm):
    model, tokenizer, ref, hf_tokenizer, folder = minilm
    assert model.cfg == ModelConfig.preset("minilm-l6")  # the preset is this checkpoint

    ids = [tokenizer.encode(s) for s in SENTENCES]
    hf_batch = hf_tokenizer(SENTENCES, padding=True, return_tensors="pt")
    rows = zip(hf_batch.input_ids, hf_batch.attention_mask, strict=True)
    hf_ids = [row[m.bool()].tolist() for row, m in rows]
    assert ids == hf_ids

    input_ids, mask = hf_batch.input_ids, hf_batch.attention_mask
    with torch.no_grad():
        expected = ref(input_ids=input_ids, attention_mask=mask)
        hidden = model(input_ids, padding_mask=mask)
    hidden_diff = _max_diff(hidden, expected.last_hidden_state, mask)
    pooled_diff = (model.pooled(hidden) - expected.pooler_output).abs().max().item()
    assert hidden_diff <= 1e-5, hidden_diff
    assert pooled_diff <= 1e-5, pooled_diff

    # sentence-transformers' recipe, computed here from transformers' hidden states
    _sentence_transformers_recipe(folder)
    weights = mask[..., None].float()
    reference = (expected.last_hidden_state * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    reference = F.normalize(reference, p=2, dim=1)
    vectors = embed(model, ids)
    assert vectors.shape == (len(SENTENCES), 384)
    assert (vectors - reference).abs().max().item() <= 1e-5


def test_embed_cli_prints_a_symmetric_similarity_matrix(capsys):
    code = cli.main(["embed", "--model", "minilm", *SENTENCES, "--similarity"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("-> 384 dims") == len(SENTENCES)
    table = out.split("cosine similarity:")[1].strip().splitlines()[1:]
    matrix = [[float(x) for x in line.split()[1:]] for line in table]
    assert len(matrix) == len(SENTENCES)
    for i, row in enumerate(matrix):
        assert row[i] == pytest.approx(1.0, abs=1e-4)
        for j, value in enumerate(row):
            assert value == pytest.approx(matrix[j][i], abs=1e-4)
    # the paraphrase pair (food / bread) is closer than any unrelated pair
    assert matrix[0][1] > 0.5
    assert matrix[0][1] > max(matrix[0][2], matrix[0][3], matrix[1][3], matrix[2][3])
