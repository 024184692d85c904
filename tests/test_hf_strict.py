"""Strict Hugging Face loading: a missing, extra or misshapen tensor, an unsupported model_type or
option, or a pickled checkpoint stops with an InteropError that names it; nothing loads
half-way and nothing is ever unpickled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_llama_config
from safetensors.torch import load_file, save_file

import glassformer as gf
from glassformer.interop.hf import InteropError

VOCAB = 64


def _save(config: transformers.PretrainedConfig, folder: Path) -> Path:
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture
def llama_folder(tmp_path: Path) -> Path:
    return _save(tiny_llama_config(VOCAB), tmp_path / "llama")


@pytest.fixture
def gpt2_folder(tmp_path: Path) -> Path:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return _save(config, tmp_path / "gpt2")


def _edit_tensors(folder: Path, edit) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    file = folder / "config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


def test_missing_tensor_is_named(llama_folder: Path) -> None:
    _edit_tensors(llama_folder, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(InteropError, match=r"lacks .*model\.layers\.1\.mlp\.down_proj\.weight"):
        gf.from_pretrained(llama_folder)


def test_unexpected_tensor_is_named(llama_folder: Path) -> None:
    def add(tensors):
        tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)

    _edit_tensors(llama_folder, add)
    with pytest.raises(InteropError, match=r"does not use: model\.layers\.0\.self_attn\.q_norm"):
        gf.from_pretrained(llama_folder)


def test_wrong_shape_is_named_with_both_shapes(llama_folder: Path) -> None:
    def reshape(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(12, 32)

    _edit_tensors(llama_folder, reshape)
    with pytest.raises(InteropError, match=r"k_proj\.weight has shape \(12, 32\).*\(16, 32\)"):
        gf.from_pretrained(llama_folder)


def test_gpt2_mask_buffers_of_old_checkpoints_are_ignored(gpt2_folder: Path) -> None:
    """Older GPT-2 files carry attn.bias / attn.masked_bias (causal-mask buffers, no weights)."""

    def add(tensors):
        tensors["transformer.h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
        tensors["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)

    _edit_tensors(gpt2_folder, add)
    model, _ = gf.from_pretrained(gpt2_folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(gpt2_folder).eval()
    ids = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_unsupported_model_type_lists_the_supported_ones(llama_folder: Path) -> None:
    _edit_config(llama_folder, model_type="gpt_neox")
    with pytest.raises(InteropError, match="gpt_neox") as error:
        gf.from_pretrained(llama_folder)
    for model_type in ("gpt2", "llama", "mistral", "mixtral", "qwen2"):
        assert model_type in str(error.value)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"scale_attn_weights": False}, "scale_attn_weights"),
        ({"activation_function": "quick_gelu"}, "quick_gelu"),
        ({"add_cross_attention": True}, "add_cross_attention"),
    ],
)
def test_unsupported_gpt2_options_are_named(gpt2_folder: Path, changes, named: str) -> None:
    _edit_config(gpt2_folder, **changes)
    with pytest.raises(InteropError, match=named):
        gf.from_pretrained(gpt2_folder)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "gelu_pytorch_tanh"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
    ],
)
def test_unsupported_llama_options_are_named(llama_folder: Path, changes, named: str) -> None:
    _edit_config(llama_folder, **changes)
    with pytest.raises(InteropError, match=named):
        gf.from_pretrained(llama_folder)


def test_qwen2_window_in_only_some_layers_is_refused(tmp_path: Path) -> None:
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
        max_window_layers=1,
    )  # fmt: skip
    folder = _save(config, tmp_path / "qwen2")
    with pytest.raises(InteropError, match="sliding window in only some layers"):
        gf.from_pretrained(folder)


def _dummy_pickle(path: Path) -> None:
    # Not a real pickle: if anything tried to unpickle it, the error would not be InteropError.
    path.write_bytes(b"this is not a pickle; glassformer must never open it\n")


def test_pickled_checkpoint_folder_is_refused_with_conversion_hint(llama_folder: Path) -> None:
    (llama_folder / "model.safetensors").unlink()
    _dummy_pickle(llama_folder / "pytorch_model.bin")
    with pytest.raises(InteropError, match=r"pytorch_model\.bin.*never unpickles.*safetensors"):
        gf.from_pretrained(llama_folder)


def test_pickled_weights_without_config_are_refused_too(tmp_path: Path) -> None:
    _dummy_pickle(tmp_path / "pytorch_model.bin")
    with pytest.raises(InteropError, match=r"pytorch_model\.bin.*never unpickles"):
        gf.from_pretrained(tmp_path)
    with pytest.raises(InteropError, match=r"pickled checkpoint.*never unpickles"):
        gf.from_pretrained(tmp_path / "pytorch_model.bin")


def test_wrong_shape_of_a_transposed_gpt2_tensor_is_named(gpt2_folder: Path) -> None:
    def reshape(tensors):
        tensors["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(32, 100)

    _edit_tensors(gpt2_folder, reshape)
    with pytest.raises(InteropError, match=r"mlp\.c_fc\.weight has shape \(32, 100\).*\(32, 128\)"):
        gf.from_pretrained(gpt2_folder)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path):
    """save_pretrained with a small max_shard_size writes model.safetensors.index.json and
    several shards; glassformer reads them through the index, same logits as transformers."""
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(cfg).eval()
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model, _ = gf.from_pretrained(tmp_path)
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        assert torch.allclose(model(ids), hf_model(ids).logits, atol=1e-4)
