"""`glassformer convert SRC --to hf OUT`: glassformer checkpoints and Hugging Face folders come out
as folders that transformers loads and runs with the same logits and the same tokenization;
configs no Hugging Face architecture can express stop with an error naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import glassformer as gf
from glassformer.cli import main
from glassformer.interop.hf import InteropError, save_hf_model
from glassformer.train.checkpoint import save_checkpoint

ATOL = 1e-4
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll: Speak, speak.\n"

# glassformer config -> the transformers class it must come out as
GLASSFORMER_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "learned-layer-gelu_tanh-bias": (
        dict(position="learned", norm="layer", ffn="gelu_tanh", bias=True),
        "GPT2LMHeadModel",
    ),
    # no biases anywhere: GPT-2 always has them, so they are written as zeros
    "learned-layer-relu-no-bias-untied": (
        dict(position="learned", norm="layer", ffn="relu", norm_bias=False, tie_embeddings=False),
        "GPT2LMHeadModel",
    ),
    "rope-rms-swiglu-gqa": (
        dict(position="rope", norm="rms", ffn="swiglu", n_kv_heads=2, tie_embeddings=False),
        "LlamaForCausalLM",
    ),
    # Qwen2's layout, written as Llama with a zero o_proj bias: transformers' AutoTokenizer
    # forces Qwen2's own tokenizer on qwen2 folders
    "rope-rms-geglu-qkv-bias": (
        dict(position="rope", norm="rms", ffn="geglu", qkv_bias=True, rope_theta=1e6),
        "LlamaForCausalLM",
    ),
    "rope-rms-swiglu-window-yarn": (
        dict(
            position="rope",
            norm="rms",
            ffn="swiglu",
            sliding_window=6,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_seq_len": 16},
        ),
        "MistralForCausalLM",
    ),
    "rope-rms-moe-dynamic": (
        dict(
            position="rope",
            norm="rms",
            ffn="moe",
            n_experts=4,
            n_experts_per_token=2,
            rope_scaling={"type": "dynamic", "factor": 2.0, "original_max_seq_len": 24},
        ),
        "MixtralForCausalLM",
    ),
}


def _glassformer_checkpoint(folder: Path, tokenizer, **fields: Any) -> torch.nn.Module:
    cfg = gf.ModelConfig(
        vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=4, max_seq_len=48,
        init_std=0.2, **fields,
    )  # fmt: skip
    model = gf.build_model(cfg).eval()
    save_checkpoint(folder, 10, model, cfg, tokenizer)
    return model


def _convert(src: Path, out: Path, *extra: str) -> None:
    assert main(["convert", str(src), "--to", "hf", str(out), *extra]) == 0


@pytest.mark.parametrize("case", list(GLASSFORMER_CASES))
def test_converted_glassformer_checkpoint_runs_in_transformers(case: str, tmp_path: Path) -> None:
    fields, hf_class = GLASSFORMER_CASES[case]
    tokenizer = gf.CharTokenizer.from_text(TEXT)
    model = _glassformer_checkpoint(tmp_path / "run", tokenizer, **fields)
    _convert(tmp_path / "run", tmp_path / "hf")

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == hf_class
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer.encode(TEXT[:40])
    assert hf_tokenizer(TEXT[:40])["input_ids"] == ids
    assert hf_tokenizer.decode(ids) == TEXT[:40]

    batch = torch.tensor([ids, tokenizer.encode(TEXT[-40:])])
    with torch.no_grad():
        expected = model(batch)
        got = hf(batch).logits
    assert (got - expected).abs().max().item() <= ATOL


def test_converted_bpe_tokenizer_encodes_the_same_in_transformers(tmp_path: Path) -> None:
    tokenizer = gf.BPETokenizer.train([TEXT * 4], vocab_size=300)
    _glassformer_checkpoint(tmp_path / "run", tokenizer, position="rope", norm="rms", ffn="swiglu")
    _convert(tmp_path / "run", tmp_path / "hf")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Speak, citizen! 你好 <|endoftext|>"
    ids = tokenizer.encode(text)
    assert hf_tokenizer(text)["input_ids"] == ids
    assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.eos_token_id == tokenizer.eos_token_id


def test_hf_llama_round_trip_keeps_logits_and_files(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
        initializer_range=0.2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
    )  # fmt: skip
    original = transformers.AutoModelForCausalLM.from_config(config).eval()
    original.save_pretrained(tmp_path / "src")
    char_tokenizer = gf.CharTokenizer.from_text(TEXT)
    from glassformer.interop.convert import char_tokenizer_to_hf

    char_tokenizer_to_hf(char_tokenizer).save(str(tmp_path / "src" / "tokenizer.json"))
    _convert(tmp_path / "src", tmp_path / "hf")

    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (
        tmp_path / "src" / "tokenizer.json"
    ).read_text()
    converted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 80, (2, 30))
    with torch.no_grad():
        difference = (converted(ids).logits - original(ids).logits).abs().max().item()
    assert difference <= ATOL


@pytest.mark.parametrize(
    "fields, model_type, named",
    [
        (dict(position="alibi"), None, "position='alibi'"),
        (dict(position="sinusoidal"), None, "position='sinusoidal'"),
        (dict(norm_position="post"), None, "norm_position='post'"),
        (dict(residual=False), None, "residual=False"),
        (dict(position="rope", norm="rms", ffn="swiglu", residual=False), None, "residual=False"),
        (dict(position="learned", norm="rms"), None, "position='learned'"),
        (dict(position="rope", norm="rms", ffn="relu"), None, "ffn='relu'"),
        (dict(position="rope", norm="layer", ffn="swiglu"), None, "norm='layer'"),
        (dict(ffn="moe"), None, "ffn='moe'"),
        (dict(n_kv_heads=2), None, "n_kv_heads=2"),
        (dict(sliding_window=8), None, "sliding_window=8"),
        (dict(position="rope", norm="rms", ffn="swiglu"), "gpt2", "position='rope'"),
        (dict(position="rope", norm="rms", ffn="swiglu", sliding_window=4), "llama", "sliding"),
        (dict(position="rope", norm="rms", ffn="swiglu", mlp_bias=True), "mistral", "mlp_bias"),
        (dict(position="rope", norm="rms", ffn="swiglu", bias=True), "qwen2", "attn_out_bias"),
        (dict(position="rope", norm="rms", ffn="swiglu", qk_norm=True), "llama", "qk_norm=True"),
        (dict(position="rope", norm="rms", ffn="swiglu"), "qwen3", "qk_norm=False"),
    ],
)
def test_configs_no_hf_architecture_expresses_are_refused(
    fields: dict[str, Any], model_type: str | None, named: str, tmp_path: Path
) -> None:
    cfg = gf.ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, **fields)
    with pytest.raises(InteropError, match=named.replace("(", r"\(")):
        save_hf_model(gf.build_model(cfg), tmp_path / "hf", model_type)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_convert_cli_reports_an_inexpressible_config(tmp_path: Path, capsys) -> None:
    tokenizer = gf.CharTokenizer.from_text(TEXT)
    _glassformer_checkpoint(tmp_path / "run", tokenizer, position="alibi")
    assert main(["convert", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "hf")]) == 2
    assert "position='alibi'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model_type, fields, hf_class",
    [
        # Llama's attention_bias covers q/k/v and o: o_proj's bias is written as zeros
        ("llama", dict(qkv_bias=True), "LlamaForCausalLM"),
        ("qwen2", dict(qkv_bias=True), "Qwen2ForCausalLM"),
        # Qwen2 always has q/k/v biases: written as zeros
        ("qwen2", dict(), "Qwen2ForCausalLM"),
        ("mistral", dict(n_kv_heads=1), "MistralForCausalLM"),
        ("qwen3", dict(qk_norm=True, n_kv_heads=2), "Qwen3ForCausalLM"),
        # Qwen3's attention_bias covers q/k/v and o, like Llama's
        ("qwen3", dict(qk_norm=True, qkv_bias=True), "Qwen3ForCausalLM"),
    ],
)
def test_convert_with_an_explicit_model_type(
    model_type: str, fields: dict[str, Any], hf_class: str, tmp_path: Path
) -> None:
    tokenizer = gf.CharTokenizer.from_text(TEXT)
    model = _glassformer_checkpoint(
        tmp_path / "run", tokenizer, position="rope", norm="rms", ffn="swiglu", **fields
    )
    _convert(tmp_path / "run", tmp_path / "hf", "--model-type", model_type)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == hf_class
    ids = torch.tensor([tokenizer.encode(TEXT[:30])])
    with torch.no_grad():
        assert (hf(ids).logits - model(ids)).abs().max().item() <= ATOL


_SIZES = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
)  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [
        transformers.LlamaConfig(**_SIZES, attention_bias=True, mlp_bias=True),
        transformers.Qwen2Config(
            **_SIZES, use_sliding_window=True, sliding_window=5, max_window_layers=0
        ),
        transformers.MistralConfig(**_SIZES, sliding_window=5),
        transformers.GPT2Config(
            vocab_size=64,
            n_embd=32,
            n_layer=2,
            n_head=4,
            initializer_range=0.2,
            activation_function="relu",
            bos_token_id=None,
            eos_token_id=None,
        ),
    ],
    ids=lambda config: config.model_type,
)
def test_save_hf_model_picks_an_architecture_that_keeps_the_logits(config, tmp_path) -> None:
    """A loaded model written back without naming a model_type comes out as an architecture
    transformers runs with the original logits (e.g. Llama's attention_bias, which also puts a
    bias on o_proj, must not come out as Qwen2, which has none)."""
    original = transformers.AutoModelForCausalLM.from_config(config).eval()
    original.save_pretrained(tmp_path / "src")
    model, _ = gf.from_pretrained(tmp_path / "src")
    save_hf_model(model, tmp_path / "out")
    written = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(written) is type(original)
    ids = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        assert (written(ids).logits - original(ids).logits).abs().max().item() <= ATOL
