"""Hostile adapters, logits and data (issue 30): every damaged input is one error naming the file,
the bad value and the fix, or it works; never a traceback, never garbage sampled with exit 0.

A tiny glassformer checkpoint gets a valid LoRA adapter from save_adapter; each test then damages
one adapter_config.json field (or the weights) and loads it with load_adapter and the CLI. The
generation safety net is driven through the fused C step and the torch step alike, and the
fine-tune data reader gets deeply nested lines and texts too long for any context.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import needs_kernels
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

import glassformer as gf
from glassformer import tokenizers
from glassformer.cli import main
from glassformer.config import ModelConfig
from glassformer.infer.engine import Engine
from glassformer.infer.fused import FusedStep
from glassformer.interop.checkpoint import read_checkpoint_json
from glassformer.interop.hf_files import read_json
from glassformer.interop.integrity import InteropError
from glassformer.interop.peft import _update_overflow, load_adapter, save_adapter
from glassformer.nn.lora import LoRALinear, apply_lora, lora_parameters
from glassformer.server.protocol import APIError, parse_json
from glassformer.tokenizers import BPETokenizer, CharTokenizer, PretrainedTokenizer, load_tokenizer
from glassformer.tokenizers.span import chars_per_token_cap, longest_token_chars
from glassformer.train.checkpoint import save_checkpoint
from glassformer.train.finetune import FinetuneDataError, encode_records, read_jsonl

ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.!?"
PROMPT = "to be or not"
DEEP = "[" * 100_000 + "]" * 100_000
TOO_DEEP = r"brackets nested (more than )?[\d,]+ levels deep"
FIX = "fix the value, or use the adapter_config.json saved with the adapter's weights"


def _cfg(vocab_size: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
        max_seq_len=48, position="rope", norm="rms", ffn="swiglu", init_std=0.2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A glassformer checkpoint of a tiny Llama-layout model with a character tokenizer."""
    tokenizer = CharTokenizer.from_text(ALPHABET)
    folder = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    cfg = _cfg(tokenizer.vocab_size)
    save_checkpoint(folder, 0, gf.build_model(cfg).eval(), cfg, tokenizer)
    return folder


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A valid q,v adapter (r=4, alpha=8, B moved off zero) and the logits it gives."""
    model, _ = gf.from_pretrained(base)
    apply_lora(model, "q,v", rank=4, alpha=8)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0.0, 0.2)
        logits = model(_ids())
    folder = tmp_path_factory.mktemp("adapters") / "good"
    save_adapter(model, folder)
    return folder, logits


def _ids() -> torch.Tensor:
    return torch.tensor([CharTokenizer.from_text(ALPHABET).encode(PROMPT)])


def _damaged(adapter_dir: Path, tmp_path: Path, raw: str | None = None, **changes: Any) -> Path:
    """A copy of the adapter with config fields changed (or the whole file replaced by raw).
    json.dumps writes float('inf') as Infinity and nan as NaN, as a hostile file may."""
    folder = tmp_path / "adapter"
    shutil.copytree(adapter_dir, folder)
    config_file = folder / "adapter_config.json"
    if raw is None:
        config = json.loads(config_file.read_text())
        raw = json.dumps({**config, **changes})
    config_file.write_text(raw)
    return folder


def _fresh(base: Path):
    model, _ = gf.from_pretrained(base)
    return model.eval()


def _refused(base: Path, folder: Path, message: str) -> str:
    model = _fresh(base)
    with pytest.raises(InteropError, match=message) as caught:
        load_adapter(model, folder)
    assert not any(isinstance(m, LoRALinear) for m in model.modules()), "the model changed"
    return str(caught.value)


# --- adapter_config.json, one field at a time -------------------------------------------------

BAD_FIELDS = [
    ("lora_alpha", math.inf, r"lora_alpha=inf \(float\) must be a finite number > 0"),
    ("lora_alpha", math.nan, r"lora_alpha=nan \(float\) must be a finite number > 0"),
    ("lora_alpha", 0, r"lora_alpha=0 \(int\) must be a finite number > 0"),
    ("lora_alpha", True, r"lora_alpha=True \(bool\) must be a finite number"),
    ("lora_alpha", 10**400, r"lora_alpha=1000.*\(int\) must be a finite number"),
    ("r", 2.5, r"r=2\.5 \(float\) must be a whole number in 1\.\.65,536"),
    ("r", 4.0, r"r=4\.0 \(float\) must be a whole number"),
    ("r", math.nan, r"r=nan \(float\) must be a whole number"),
    ("r", True, r"r=True \(bool\) must be a whole number"),
    ("r", 0, r"r=0 \(int\) must be a whole number in 1\.\."),
    ("r", 10**100, r"r=1000.*\(int\) must be a whole number in 1\.\.65,536"),
    ("r", None, r"r=None \(NoneType\) must be a whole number"),
    ("lora_dropout", 1.5, r"lora_dropout=1\.5 \(float\) must be a number in \[0, 1\)"),
    ("lora_dropout", "0.1", r"lora_dropout='0\.1' \(str\) must be a number in \[0, 1\)"),
    ("target_modules", 5, r"target_modules=5 \(int\) must be a module name pattern"),
    ("target_modules", {"q_proj": 1}, r"target_modules=\{'q_proj': 1\} \(dict\) must be"),
    ("target_modules", [1, 2], r"target_modules=\[1, 2\] \(list\) must be"),
    ("target_modules", None, r"target_modules=None \(NoneType\) must be"),
    ("target_modules", [], r"target_modules=\[\] \(list\) names nothing"),
    ("target_modules", "q_proj(", r"target_modules='q_proj\(' \(str\) is not a regular expr"),
    ("exclude_modules", 3, r"exclude_modules=3 \(int\) must be a module name pattern"),
    ("layers_to_transform", "0", r"layers_to_transform='0' \(str\) must be a layer index"),
    ("layers_to_transform", [0, -1], r"layers_to_transform=\[0, -1\] \(list\) must be"),
    ("layers_pattern", ["layers", "("], r"layers_pattern=\['layers', '\('\] .* not a regular"),
    ("fan_in_fan_out", "yes", r"fan_in_fan_out='yes' \(str\) must be true or false"),
    ("rank_pattern", "x", r"rank_pattern='x' \(str\) must be an object of module name"),
    ("alpha_pattern", "x", r"alpha_pattern='x' \(str\) must be an object of module name"),
    ("rank_pattern", {"q_proj": 2.5}, r"rank_pattern=.* maps 'q_proj' to 2\.5, which must be"),
    ("alpha_pattern", {"v_proj": math.inf}, r"alpha_pattern=.* maps 'v_proj' to inf, which"),
    ("rank_pattern", {"(": 4}, r"rank_pattern=.* has the key '\(', which is not a regular"),
]


@pytest.mark.parametrize(
    ("field", "value", "message"), BAD_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD_FIELDS]
)
def test_a_bad_config_value_names_the_file_the_field_and_the_fix(
    base, adapter, tmp_path, field, value, message
):
    folder = _damaged(adapter[0], tmp_path, **{field: value})
    text = _refused(base, folder, message)
    assert text.startswith(f"{folder / 'adapter_config.json'}: {field}=")
    assert text.endswith(FIX)


OTHER_VALUES = [
    ("peft_type", "IA3", r"peft_type='IA3'; glassformer reads LoRA adapters only .*'LORA'"),
    ("peft_type", None, r"peft_type=None; glassformer reads LoRA adapters only"),
    ("task_type", "SEQ_CLS", r"task_type='SEQ_CLS' is not one .* allowed are 'CAUSAL_LM' or null"),
    ("bias", "all", r"bias='all' is not supported by glassformer's LoRA \(supported: 'none'\)"),
    ("bias", "sometimes", r"bias='sometimes' \(str\) is not one of peft's values \(none, all, lo"),
    ("use_dora", True, r"use_dora=True is not supported .* merge it with peft"),
    ("use_qalora", True, r"use_qalora=True is not supported"),
    ("alora_invocation_tokens", [5, 6], r"alora_invocation_tokens=\[5, 6\] is not supported"),
]


@pytest.mark.parametrize(("field", "value", "message"), OTHER_VALUES)
def test_options_glassformer_does_not_compute_are_refused_with_the_allowed_values(
    base, adapter, tmp_path, field, value, message
):
    folder = _damaged(adapter[0], tmp_path, **{field: value})
    assert str(folder / "adapter_config.json") in _refused(base, folder, message)


def test_fan_in_fan_out_must_describe_the_models_layers(base, adapter, tmp_path):
    folder = _damaged(adapter[0], tmp_path, fan_in_fan_out=True)
    _refused(base, folder, r"fan_in_fan_out=True does not describe this llama model, whose "
             r"projections are nn.Linear, \(out, in\): set fan_in_fan_out to false")  # fmt: skip


def test_layers_past_the_model_are_named_with_its_depth(base, adapter, tmp_path):
    folder = _damaged(adapter[0], tmp_path, layers_to_transform=[99])
    _refused(base, folder, r"layers_to_transform=\[99\] names layer 99, but this llama model has "
             r"2 layers \(0\.\.1\)")  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "module"),
    [
        ({"target_modules": ["zz_proj"]}, "model.layers.0.self_attn.q_proj"),
        ({"target_modules": ["q_proj"]}, "model.layers.0.self_attn.v_proj"),
        ({"exclude_modules": ["q_proj"]}, "model.layers.0.self_attn.q_proj"),
        ({"layers_to_transform": [0]}, "model.layers.1.self_attn.q_proj"),
        ({"layers_to_transform": 1}, "model.layers.0.self_attn.q_proj"),
        ({"target_modules": r".*\.v_proj"}, "model.layers.0.self_attn.q_proj"),
    ],
)
def test_tensors_the_config_does_not_adapt_are_refused(base, adapter, tmp_path, changes, module):
    # peft would leave these tensors out: loading them would compute something else than peft.
    folder = _damaged(adapter[0], tmp_path, **changes)
    text = _refused(base, folder, rf"adapter_model\.safetensors holds an adapter for {module}, "
                    r"which adapter_config\.json's .* does not adapt")  # fmt: skip
    assert next(iter(changes)) in text


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"target_modules": "all-linear"},
        {"target_modules": r".*\.(q|v)_proj"},
        {"target_modules": [f"model.layers.{i}.self_attn.{m}_proj" for i in "01" for m in "qv"]},
        {"target_modules": ["q_proj", "v_proj", "no_such_proj"]},  # peft needs one to match
        {"layers_to_transform": [0, 1], "layers_pattern": "layers"},
        {"layers_to_transform": []},
        {"exclude_modules": ["k_proj"]},
        {"fan_in_fan_out": False, "task_type": None},
        {"lora_dropout": None, "rank_pattern": None},  # null: the default (peft trips on these)
        {"rank_pattern": {"q_proj": 4}, "alpha_pattern": {r"layers\.1\..*v_proj": 8}},
        {"some_future_peft_key": {"nested": [1, 2]}},
    ],
)
def test_configs_that_adapt_the_same_modules_load_with_the_same_logits(
    base, adapter, tmp_path, changes
):
    # peft 0.21 loads each of these (all but the nulls) with these logits too
    folder = _damaged(adapter[0], tmp_path, **changes)
    model = _fresh(base)
    load_adapter(model, folder)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()), adapter[1], atol=1e-5, rtol=0)


def test_alpha_pattern_changes_the_scaling_of_its_module_only(base, adapter, tmp_path):
    folder = _damaged(adapter[0], tmp_path, alpha_pattern={"layers.0.self_attn.q_proj": 16})
    model = _fresh(base)
    load_adapter(model, folder)
    qkv = [block.attn.qkv_proj for block in model.blocks]
    assert qkv[0].scalings == [4.0, 2.0] and qkv[1].scalings == [2.0, 2.0]  # alpha / r


# --- the weights --------------------------------------------------------------------------------


def _scaled_weights(folder: Path, factor: float) -> None:
    file = folder / "adapter_model.safetensors"
    tensors = load_file(file)
    save_file({name: t * factor for name, t in tensors.items()}, file)


def test_weights_whose_update_overflows_float32_are_refused(base, adapter, tmp_path):
    folder = _damaged(adapter[0], tmp_path)
    _scaled_weights(folder, 1e37)  # finite float32 values; B @ A is about 1e74
    _refused(base, folder, r"adapter_model\.safetensors: model\.layers\.0\.self_attn\.q_proj: "
             r"the update \(lora_alpha / r\) \* B @ A reaches [\d.]+e\+7\d, beyond float32's "
             r"3\.4e\+38: .* train or download it again")  # fmt: skip


def test_an_alpha_whose_scaling_overflows_float32_is_refused(base, adapter, tmp_path):
    folder = _damaged(adapter[0], tmp_path, lora_alpha=1e300)
    _refused(base, folder, r"lora_alpha / r = 1e\+300 / 4 does not fit in float32")


def test_update_check_is_exact_where_the_cheap_bound_is_not():
    A = torch.full((2, 3), 1e20)  # (r, K)
    B = torch.tensor([[1e19, -1e19], [1e19, 1e19]])  # (O, r): row 0 cancels, row 1 does not
    assert _update_overflow(A, B[:1], 1.0) is None  # bound 2e39, exact product 0
    assert _update_overflow(A, B, 1.0) == pytest.approx(2e39)  # (B @ A)[1] = 2e39 everywhere
    assert _update_overflow(A / 1e20, B / 1e19, 8.0) is None  # an ordinary adapter


# --- deeply nested JSON, wherever a user's JSON is read ---------------------------------------


def test_a_deeply_nested_adapter_config_is_one_error(base, adapter, tmp_path):
    folder = _damaged(adapter[0], tmp_path, raw=DEEP)
    _refused(base, folder, rf"adapter_config\.json is not valid JSON \({TOO_DEEP}.*line 1 column")


def test_a_5000_digit_rank_is_one_error_naming_the_file(base, adapter, tmp_path):
    text = (adapter[0] / "adapter_config.json").read_text().replace('"r": 4', '"r": ' + "9" * 5000)
    folder = _damaged(adapter[0], tmp_path, raw=text)
    _refused(base, folder, r"adapter_config\.json is not valid JSON \(an integer of 5,000 "
             r"digits, more than the 4,300 Python reads: line \d+ column \d+")  # fmt: skip


def _deep_checkpoint_config(tmp_path: Path, base: Path) -> Path:
    step = tmp_path / "step"
    shutil.copytree(next(base.glob("step-*")), step)
    (step / "config.json").write_text(DEEP)
    return step / "config.json"


def _deep_hf_config(tmp_path: Path, base: Path) -> Path:
    (tmp_path / "config.json").write_text(DEEP)
    return tmp_path / "config.json"


def _deep_tokenizer(tmp_path: Path, base: Path) -> Path:
    (tmp_path / "tokenizer.json").write_text(DEEP)
    return tmp_path / "tokenizer.json"


def _deep_tokenizer_config(tmp_path: Path, base: Path) -> Path:
    BPETokenizer.train(["to be or not to be"], 300).save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(DEEP)
    return tmp_path / "tokenizer_config.json"


def _from_pretrained(file: Path) -> Any:
    return gf.from_pretrained(file.parent)


def _tokenizer_folder(file: Path) -> Any:
    return PretrainedTokenizer.from_folder(file.parent)


# reader -> (how its deep file is made, what reads it)
DEEP_READERS = {
    "from_pretrained of a checkpoint": (_deep_checkpoint_config, _from_pretrained),
    "from_pretrained of a Hugging Face folder": (_deep_hf_config, _from_pretrained),
    "read_checkpoint_json": (_deep_checkpoint_config, read_checkpoint_json),
    "hf_files.read_json": (_deep_hf_config, read_json),
    "ModelConfig.from_json": (_deep_hf_config, ModelConfig.from_json),
    "load_tokenizer": (_deep_tokenizer, load_tokenizer),
    "PretrainedTokenizer.from_folder": (_deep_tokenizer_config, _tokenizer_folder),
}


@pytest.mark.parametrize("reader", DEEP_READERS)
def test_deeply_nested_json_is_one_error_in_every_reader(base, tmp_path, reader):
    make, read = DEEP_READERS[reader]
    file = make(tmp_path, base)
    with pytest.raises(ValueError, match=TOO_DEEP) as caught:
        read(file)
    assert str(file) in str(caught.value)


def test_a_deeply_nested_request_body_is_a_400():
    with pytest.raises(APIError, match=rf"the request body is not valid JSON \({TOO_DEEP}") as e:
        parse_json(DEEP.encode())
    assert e.value.status == 400


# --- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ({"lora_alpha": math.inf}, "lora_alpha=inf"),
        ({"raw": DEEP}, "brackets nested"),
        ({"target_modules": 5}, "target_modules=5"),
        ({"weights": 1e37}, "beyond float32"),
    ],
)
def test_generate_with_a_broken_adapter_exits_2_with_one_line(
    base, adapter, tmp_path, capsys, damage, message
):
    factor = damage.pop("weights", None)
    folder = _damaged(adapter[0], tmp_path, **damage)
    if factor is not None:
        _scaled_weights(folder, factor)
    capsys.readouterr()
    argv = ["generate", PROMPT, "--model", str(base), "--adapter", str(folder),
            "--max-new-tokens", "4", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert message in captured.err and str(folder) in captured.err
    assert captured.out == ""


# --- the logits safety net ----------------------------------------------------------------------


def _model_broken_at_step_2() -> tuple[torch.nn.Module, list[int]]:
    """A model whose logits are finite for the prompt but NaN once its first greedy token is fed
    back: that token's embedding row is NaN (the output layer is not tied to it)."""
    torch.manual_seed(0)
    model = gf.build_model(_cfg(32).replace(tie_embeddings=False)).eval()
    for start in range(32):
        prompt = [start, (start + 1) % 32, (start + 2) % 32]
        first = Engine(model, fast=False).generate(prompt, 1, temperature=0).token_ids[0]
        if first not in prompt:
            break
    with torch.no_grad():
        model.tok_emb.weight[first] = math.nan
    return model, prompt


@pytest.mark.parametrize(
    "fast",
    [
        pytest.param(True, marks=needs_kernels),
        False,
    ],
)
def test_nan_logits_stop_generation_with_the_step(monkeypatch, fast):
    model, prompt = _model_broken_at_step_2()
    engine = Engine(model, fast=fast)
    assert (engine.fused is not None) == fast
    fused_calls = []
    fused_step = FusedStep.__call__

    def counting(self, *args):
        fused_calls.append(args)
        return fused_step(self, *args)

    monkeypatch.setattr(FusedStep, "__call__", counting)
    with pytest.raises(ValueError, match=r"the model's logits at step 2 are NaN/inf \(32 of 32 "
                       r"values\): its weights or adapter are broken"):  # fmt: skip
        engine.generate(prompt, 4, temperature=0)
    assert len(fused_calls) == (1 if fast else 0)  # step 2 came from the fused C step


@pytest.mark.parametrize("temperature", ["0", "1"])
def test_generate_from_overflowing_weights_exits_2(tmp_path, capsys, temperature):
    # Finite weights of 1e30 pass every load check; the activations they make do not.
    tokenizer = CharTokenizer.from_text(ALPHABET)
    cfg = _cfg(tokenizer.vocab_size)
    model = gf.build_model(cfg).eval()
    with torch.no_grad():
        model.blocks[0].attn.qkv_proj.weight.mul_(1e30)
    save_checkpoint(tmp_path / "broken", 0, model, cfg, tokenizer)
    capsys.readouterr()
    argv = ["generate", PROMPT, "--model", str(tmp_path / "broken"), "--max-new-tokens", "4",
            "--temperature", temperature, "--device", "cpu"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: the model's logits at step 1 are NaN/inf .*\n", err), err


# --- fine-tune data -----------------------------------------------------------------------------


def test_a_deeply_nested_data_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "to be"}\n' + DEEP + "\n")
    with pytest.raises(
        FinetuneDataError, match=rf"data\.jsonl line 2: not valid JSON \({TOO_DEEP}"
    ):
        read_jsonl(path)


def test_a_huge_hostile_value_is_shown_cut_short(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": "x" * 1_000_000}) + "\n")
    with pytest.raises(FinetuneDataError, match=r"line 1: messages='xxx.*\.\.\. must be") as e:
        read_jsonl(path)
    assert len(str(e.value)) < 400


class _CountingChars(CharTokenizer):
    encoded = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        type(self).encoded += len(text)
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize(
    "record",
    [
        {"text": "to be " * 10_000},
        {"messages": [{"role": "user", "content": "to be " * 5_000},
                      {"role": "assistant", "content": "or not " * 4_000 + "!" * 2_000}]},
    ],
    ids=["text", "messages"],
)  # fmt: skip
def test_an_example_too_long_for_any_encoding_is_refused_before_tokenizing(record):
    _CountingChars.encoded = 0
    tokenizer = _CountingChars(list(ALPHABET))
    with pytest.raises(FinetuneDataError, match=r"x line 3 holds 60,000 characters, so at least "
                       r"60,000 tokens .* longer than 1 character\), more than finetune\."
                       r"max_seq_len=512: split or shorten"):  # fmt: skip
        encode_records(tokenizer, [(3, record)], 512, "x")
    assert _CountingChars.encoded == 0
    # exactly as long as the context: the bound lets it through to the tokenizer
    (example,) = encode_records(tokenizer, [(1, {"text": "a" * 512})], 512, "x")
    assert len(example.ids) == 512


def test_longest_token_chars_bounds_every_encoding():
    text = "To be, or not to be:   that is the question.\n\n" * 20
    bpe = BPETokenizer.train([text], 400)
    longest = longest_token_chars(bpe)
    assert longest == max(len(token) for token in bpe.hf.get_vocab()) > 4
    for sample in (text, " " * 5_000, "é€😀" * 300, text.upper()):
        assert len(bpe.encode(sample)) >= len(sample) / longest
    assert longest_token_chars(CharTokenizer.from_text(ALPHABET)) == 1


def test_tokenizers_that_can_drop_text_have_no_bound():
    # A whitespace pre-tokenizer drops spaces and WordPiece gives a whole unknown word one
    # [UNK]: 5,000 spaces are no tokens at all, so no length can be refused up front.
    hf = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece = PretrainedTokenizer(hf)
    assert wordpiece.encode(" " * 5_000, add_special_tokens=False) == []
    assert longest_token_chars(wordpiece) is None


WORDS = ["[UNK]", "[PAD]", "to", "be", "or", "not", "that", "is", "the", "question"]


def _wordpiece() -> PretrainedTokenizer:
    """A WordPiece tokenizer behind a whitespace pre-tokenizer, as BERT's: it drops spaces and
    gives a whole unknown word one [UNK], so no length bounds its encodings."""
    hf = HFTokenizer(models.WordPiece({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    return PretrainedTokenizer(hf, pad_token="[PAD]")


def test_a_tokenizer_that_drops_text_gets_a_cap_on_sparse_examples(monkeypatch):
    wordpiece = _wordpiece()
    assert longest_token_chars(wordpiece) is None
    # The cap: 100, WordPiece's own longest word (read from the Rust model), longer than any
    # token of this vocabulary.
    assert chars_per_token_cap(wordpiece) == wordpiece.hf.model.max_input_chars_per_word == 100
    long_vocab = HFTokenizer(models.WordPiece({"[UNK]": 0, "x" * 150: 1}, unk_token="[UNK]"))
    assert chars_per_token_cap(PretrainedTokenizer(long_vocab)) == 150
    given: list[int] = []
    real_encode = PretrainedTokenizer.encode

    def encode(self, text, *args, **kwargs):
        given.append(len(text))
        return real_encode(self, text, *args, **kwargs)

    monkeypatch.setattr(PretrainedTokenizer, "encode", encode)
    # 3,000 characters for 30 tokens: within the cap, so the tokenizer counts them (1,000).
    with pytest.raises(FinetuneDataError, match=r"x line 1 is 1000 tokens, more than finetune"):
        encode_records(wordpiece, [(1, {"text": "to " * 1_000})], 30, "x")
    assert given == [3_000]
    (example,) = encode_records(wordpiece, [(2, {"text": "to be " * 14 + "or"})], 30, "x")
    assert len(example.ids) == 29  # the tokenizer's own count: 14 x 2 + 1
    # The cap's price: 3,001 characters that are one token and 2,999 dropped spaces are refused.
    given.clear()
    refused = r"x line 3 holds 3,001 characters, more than 100 for each of finetune\.max_seq_len=30"
    with pytest.raises(FinetuneDataError, match=refused + " tokens: this tokenizer drops text"):
        encode_records(wordpiece, [(3, {"text": " " * 2_999 + "to"})], 30, "x")
    assert given == []


HUGE_CHARS = 50_000_000


@pytest.fixture(scope="module")
def huge_data(tmp_path_factory) -> Path:
    """data.jsonl whose line 2 is one example of 50,000,000 characters (a 50 MB line)."""
    path = tmp_path_factory.mktemp("huge") / "data.jsonl"
    huge = ("to be or not " * (HUGE_CHARS // 13 + 1))[:HUGE_CHARS]
    path.write_text(json.dumps({"text": "to be or not"}) + "\n" + json.dumps({"text": huge}) + "\n")
    assert path.stat().st_size > 50_000_000
    return path


@pytest.mark.parametrize("vocabulary", ["char", "wordpiece"])
def test_a_50_mb_data_line_is_refused_before_it_is_tokenized(
    vocabulary, huge_data, tmp_path, monkeypatch, capsys
):
    tokenizer = CharTokenizer.from_text(ALPHABET) if vocabulary == "char" else _wordpiece()
    torch.manual_seed(0)
    cfg = _cfg(tokenizer.vocab_size)
    save_checkpoint(tmp_path / "base", 0, gf.build_model(cfg).eval(), cfg, tokenizer)
    given: list[int] = []  # the length of every text any tokenizer is asked to encode
    real_char, real_hf = CharTokenizer.encode, tokenizers._hf_encode

    def char_encode(self, text, *args, **kwargs):
        given.append(len(text))
        return real_char(self, text, *args, **kwargs)

    def hf_encode(hf, text, *args, **kwargs):
        given.append(len(text))
        return real_hf(hf, text, *args, **kwargs)

    monkeypatch.setattr(CharTokenizer, "encode", char_encode)
    monkeypatch.setattr(tokenizers, "_hf_encode", hf_encode)
    argv = ["finetune", "--model", str(tmp_path / "base"), "--data", str(huge_data),
            "--out", str(tmp_path / "out"), "--steps", "1", "--max-seq-len", "32",
            "--no-progress", "--threads", "1"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err[:2000]
    assert err.startswith(f"error: {huge_data} line 2 holds 50,000,000 characters, ")
    assert "split or shorten the example, or raise --max-seq-len" in err
    assert given == [len("to be or not")]  # line 1 only: line 2 never reached the tokenizer
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("step-*"))


def test_a_character_checkpoint_fine_tunes_on_text_lines(tiny_run_config, tmp_path):
    assert main(["train", "--config", str(tiny_run_config(max_steps=2)), "--device", "cpu",
                 "--no-progress"]) == 0  # fmt: skip
    run = tmp_path / "run"
    corpus = (tmp_path / "hamlet.txt").read_text(encoding="utf-8")[:1200]
    lines = [corpus[i : i + 12] for i in range(0, len(corpus), 12)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    argv = ["finetune", "--model", str(run), "--data", str(data), "--out", str(tmp_path / "out"),
            "--method", "full", "--steps", "20", "--batch-size", "8", "--lr", "1e-2",
            "--warmup", "1", "--max-seq-len", "16", "--no-progress", "--threads", "1"]  # fmt: skip
    assert main(argv) == 0

    def loss(folder: Path) -> float:
        model, tokenizer = gf.from_pretrained(folder)
        ids = torch.tensor([tokenizer.encode(line) for line in lines if len(line) == 12])
        with torch.no_grad():
            logits = model.eval()(ids[:, :-1])
        return float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:]))

    assert loss(tmp_path / "out") < loss(run) - 0.3
