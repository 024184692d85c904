"""LoRA (glassformer/nn/lora.py) and peft's adapter format (glassformer/interop/peft.py): the
layer against its closed form, merge equal to unmerged, the int8 base, clear errors, and both
directions against peft on small random transformers models (logits within 1e-4)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
from conftest import tiny_model

import glassformer as gf
from glassformer.files import FolderError
from glassformer.interop.hf import load_hf_model
from glassformer.interop.integrity import InteropError
from glassformer.interop.peft import load_adapter, save_adapter
from glassformer.nn.lora import (
    LoRALinear,
    apply_lora,
    lora_modules,
    lora_parameters,
    merge_lora,
    trainable_fraction,
)
from glassformer.nn.quant import parameter_count, quantize_int8

ATOL = 1e-4
VOCAB = 96
IDS = torch.tensor([[3, 17, 42, 8, 91, 5, 23, 60, 11, 2], [7, 7, 30, 64, 1, 0, 88, 45, 19, 33]])


def _llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip


def _gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip


def _hf_and_glassformer(hf_class, hf_config, folder: Path):
    """A random transformers model and the glassformer model loaded from its saved folder."""
    hf_model = hf_class(hf_config).eval()
    hf_model.save_pretrained(folder)
    model, _ = load_hf_model(folder)
    return hf_model, model.eval()


def _randomize(params) -> None:
    # B starts at zero (the adapter is a no-op); training would move it: do that by hand.
    with torch.no_grad():
        for p in params:
            p.normal_(0.0, 0.2)


MODEL = dict(vocab_size=VOCAB, d_ff=48, max_seq_len=32, init_std=0.1, seed=1, scale=1)


# --- the layer --------------------------------------------------------------------------------


def test_lora_linear_is_its_closed_form_on_each_slice():
    base = torch.nn.Linear(12, 10, bias=True)
    layer = LoRALinear(base, slices=[(0, 4), (7, 3)], rank=2, alpha=6.0)
    _randomize(lora_parameters_of(layer))
    x = torch.randn(3, 5, 12)
    W, b = base.weight.detach(), base.bias.detach()
    expected = x @ W.T + b
    for (start, size), A, B in zip(layer.slices, layer.lora_A, layer.lora_B, strict=True):
        expected[..., start : start + size] += 3.0 * (x @ A.detach().T @ B.detach().T)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=0)


def lora_parameters_of(layer: LoRALinear) -> list[torch.nn.Parameter]:
    return list(layer.lora_A) + list(layer.lora_B)


def test_fresh_adapter_changes_nothing_and_merge_equals_unmerged():
    model = tiny_model(**MODEL)
    reference = model(IDS)
    names = apply_lora(model, "q,v", rank=4, alpha=8)
    assert names == [f"blocks.{i}.attn.qkv_proj.{p}" for i in range(2) for p in "qv"]
    torch.testing.assert_close(model(IDS), reference, atol=0, rtol=0)  # B = 0
    _randomize(lora_parameters(model))
    adapted = model(IDS)
    assert (adapted - reference).abs().max() > 1e-2
    wrapper = model.blocks[0].attn.qkv_proj
    wrapper.merge()
    torch.testing.assert_close(model(IDS), adapted, atol=1e-5, rtol=0)
    wrapper.unmerge()
    torch.testing.assert_close(model(IDS), adapted, atol=1e-5, rtol=0)
    assert merge_lora(model) == ["blocks.0.attn.qkv_proj", "blocks.1.attn.qkv_proj"]
    assert type(model.blocks[0].attn.qkv_proj) is torch.nn.Linear
    torch.testing.assert_close(model(IDS), adapted, atol=1e-5, rtol=0)


def test_apply_lora_freezes_the_base_and_counts_the_fraction():
    model = tiny_model(**MODEL)
    total = sum(p.numel() for p in model.parameters())
    apply_lora(model, "all-linear", rank=2, alpha=4)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in lora_parameters(model)}
    # per layer: q k v o gate up down, each r (K + S)
    per_layer = 2 * ((32 + 32) + (32 + 16) * 2 + (32 + 32) + (32 + 48) * 2 + (48 + 32))
    assert sum(p.numel() for p in trainable) == 2 * per_layer
    assert trainable_fraction(model) == pytest.approx(2 * per_layer / (total + 2 * per_layer))


def test_lora_on_an_int8_base_trains_the_adapters_only_and_refuses_to_merge():
    model = quantize_int8(tiny_model(**MODEL), group_size=16)
    apply_lora(model, "q,v", rank=4, alpha=8)
    _randomize(lora_parameters(model))
    model.train()
    loss = model(IDS).float().pow(2).mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_parameters(model))
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert model.blocks[0].attn.qkv_proj.lora_A[0].dtype == torch.float32
    with pytest.raises(ValueError, match="cannot merge LoRA into an int8 base"):
        merge_lora(model)


@pytest.mark.parametrize("tied", [True, False])
def test_an_int8_base_counts_the_parameters_of_its_float_model(tied):
    # int8 weights are buffers, and a tied head gets its own int8 copy of the embedding table:
    # neither may change the share of parameters LoRA trains.
    float_model = tiny_model(**MODEL)
    float_model.cfg = dataclasses.replace(float_model.cfg, tie_embeddings=tied)
    if not tied:
        float_model.lm_head.weight = torch.nn.Parameter(float_model.lm_head.weight.clone())
    total = sum(p.numel() for p in float_model.parameters())
    int8_model = quantize_int8(copy.deepcopy(float_model), group_size=16)
    assert parameter_count(int8_model) == parameter_count(float_model) == total
    apply_lora(float_model, "q,v", rank=4, alpha=8)
    apply_lora(int8_model, "q,v", rank=4, alpha=8)
    assert trainable_fraction(int8_model) == trainable_fraction(float_model)


def test_adapter_trained_on_an_int8_base_saves_and_loads_into_the_float_base(tmp_path):
    float_model = tiny_model(**MODEL)
    model = quantize_int8(tiny_model(**MODEL), group_size=16)  # same seed: the same weights
    names = apply_lora(model, "q,v,down", rank=4, alpha=8)
    _randomize(lora_parameters(model))
    save_adapter(model, tmp_path / "adapter")
    assert load_adapter(float_model, tmp_path / "adapter") == names
    for (_, ours), (_, theirs) in zip(lora_modules(model), lora_modules(float_model), strict=True):
        for a, b in zip(lora_parameters_of(ours), lora_parameters_of(theirs), strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert [n for n, _ in lora_modules(float_model)] == [n for n, _ in lora_modules(model)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(targets="q,nope"), r"'nope' matches no module.*q, qkv, up, v"),
        (dict(targets="lm_head"), r"'lm_head' matches no module"),
        (dict(rank=0), r"rank=0 must be a whole number >= 1"),
        (dict(alpha=0), r"alpha=0 must be a number > 0"),
        (dict(dropout=1.0), r"dropout=1.0 must be in \[0, 1\)"),
        (dict(targets="qkv,q"), r"overlap"),
    ],
)
def test_bad_lora_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_lora(tiny_model(**MODEL), **kwargs)


def test_explicit_module_names_pick_single_layers():
    model = tiny_model(**MODEL)
    names = apply_lora(model, ["blocks.1.attn.qkv_proj", "0.ffn.down"], rank=2)
    assert names == ["blocks.0.ffn.down", "blocks.1.attn.qkv_proj"]


# --- peft's format, both directions -----------------------------------------------------------


def _peft_logits(hf_model, adapter_dir: Path) -> torch.Tensor:
    peft_model = peft.PeftModel.from_pretrained(hf_model, str(adapter_dir)).eval()
    with torch.no_grad():
        return peft_model(IDS).logits


@pytest.mark.parametrize("targets", ["q,v", "all-linear", "qkv,down"])
def test_glassformer_adapter_runs_in_peft_with_the_same_logits(tmp_path, targets):
    hf_model, model = _hf_and_glassformer(
        transformers.LlamaForCausalLM, _llama_config(), tmp_path / "base"
    )
    apply_lora(model, targets, rank=4, alpha=8)
    _randomize(lora_parameters(model))
    save_adapter(model, tmp_path / "adapter", base_model="tiny-llama")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    if targets == "q,v":
        assert config["target_modules"] == ["q_proj", "v_proj"]
        assert (config["r"], config["lora_alpha"]) == (4, 8)
    with torch.no_grad():
        ours = model(IDS)
        plain = hf_model(IDS).logits
    assert (ours - plain).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(
        _peft_logits(hf_model, tmp_path / "adapter"), ours, atol=ATOL, rtol=0
    )


def test_peft_adapter_loads_into_glassformer_with_the_same_logits(tmp_path):
    hf_model, model = _hf_and_glassformer(
        transformers.LlamaForCausalLM, _llama_config(), tmp_path / "base"
    )
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=12,
        target_modules=["q_proj", "k_proj", "o_proj", "up_proj"],
        rank_pattern={"k_proj": 2},
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )  # fmt: skip  (init_lora_weights=False: B random, as after training)
    peft_model = peft.get_peft_model(hf_model, lora).eval()
    with torch.no_grad():
        expected = peft_model(IDS).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    names = load_adapter(model, tmp_path / "adapter")
    assert "blocks.0.attn.qkv_proj.k" in names and "blocks.1.ffn.gate_up.up" in names
    assert model.blocks[0].attn.qkv_proj.ranks == [4, 2]
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), expected, atol=ATOL, rtol=0)


def test_gpt2_adapters_both_ways(tmp_path):
    hf_model, model = _hf_and_glassformer(
        transformers.GPT2LMHeadModel, _gpt2_config(), tmp_path / "base"
    )
    # q and v of the fused c_attn: written as one c_attn adapter of rank 2r
    apply_lora(model, "q,v,fc_in", rank=3, alpha=6)
    _randomize(lora_parameters(model))
    save_adapter(model, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True
    assert config["rank_pattern"] == {f"transformer.h.{i}.attn.c_attn": 6 for i in range(2)}
    with torch.no_grad():
        ours = model(IDS)
    torch.testing.assert_close(_peft_logits(hf_model, tmp_path / "ours"), ours, atol=ATOL, rtol=0)

    fresh, _ = load_hf_model(tmp_path / "base")
    hf_fresh = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base").eval()
    lora = peft.LoraConfig(
        r=2, lora_alpha=5, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
        task_type="CAUSAL_LM", init_lora_weights=False,
    )  # fmt: skip
    peft_model = peft.get_peft_model(hf_fresh, lora).eval()
    with torch.no_grad():
        expected = peft_model(IDS).logits
    peft_model.save_pretrained(tmp_path / "theirs")
    load_adapter(fresh.eval(), tmp_path / "theirs")
    with torch.no_grad():
        torch.testing.assert_close(fresh(IDS), expected, atol=ATOL, rtol=0)


def test_adapter_for_another_model_size_is_refused_before_anything_changes(tmp_path):
    _, small = _hf_and_glassformer(
        transformers.LlamaForCausalLM, _llama_config(), tmp_path / "small"
    )
    apply_lora(small, "q,v", rank=4)
    save_adapter(small, tmp_path / "adapter")
    wider = _llama_config()
    wider.hidden_size, wider.intermediate_size = 48, 64
    _, other = _hf_and_glassformer(transformers.LlamaForCausalLM, wider, tmp_path / "wide")
    with pytest.raises(InteropError, match=r"q_proj.lora_A.weight has shape \(4, 32\).*\(4, 48\)"):
        load_adapter(other, tmp_path / "adapter")
    assert not any(isinstance(m, LoRALinear) for m in other.modules())


def test_unsupported_adapter_options_are_refused(tmp_path):
    _, model = _hf_and_glassformer(
        transformers.LlamaForCausalLM, _llama_config(), tmp_path / "base"
    )
    apply_lora(model, "q", rank=2)
    save_adapter(model, tmp_path / "adapter")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["use_dora"] = True
    config_file.write_text(json.dumps(config))
    _, fresh = _hf_and_glassformer(
        transformers.LlamaForCausalLM, _llama_config(), tmp_path / "base2"
    )
    with pytest.raises(InteropError, match="use_dora=True is not supported"):
        load_adapter(fresh, tmp_path / "adapter")
    with pytest.raises(InteropError, match=f"{tmp_path} has no adapter_config.json"):
        load_adapter(fresh, tmp_path)
    config["use_dora"] = False
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="already has LoRA adapters: merge_lora"):
        load_adapter(model, tmp_path / "adapter")


# --- the command line: --adapter and merge ----------------------------------------------------

PROMPT = "to be or not"


def _run_merge(*argv: str) -> None:
    import argparse

    from glassformer.cli import merge

    parser = argparse.ArgumentParser()
    merge.add_parser(parser.add_subparsers())
    args = parser.parse_args(["merge", *argv])
    args.func(args)


def _greedy(model, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding the long way: the whole sequence through the model at every step."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids


def test_generate_with_adapter_equals_merged_model_and_transformers_runs_it(tmp_path, capsys):
    from glassformer.cli import main
    from glassformer.interop.convert import convert_to_hf
    from glassformer.tokenizers import CharTokenizer
    from glassformer.train.checkpoint import save_checkpoint

    tokenizer = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ,.!?")
    cfg = gf.ModelConfig(
        vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        d_ff=48, max_seq_len=48, position="rope", norm="rms", ffn="swiglu", init_std=0.2,
    )  # fmt: skip
    save_checkpoint(tmp_path / "base", 0, gf.build_model(cfg).eval(), cfg, tokenizer)
    model, _ = gf.from_pretrained(tmp_path / "base")
    base_tokens = _greedy(model, tokenizer.encode(PROMPT), 12)
    apply_lora(model, "all-linear", rank=4, alpha=8)
    _randomize(lora_parameters(model))
    save_adapter(model, tmp_path / "adapter")
    tokens = _greedy(model, tokenizer.encode(PROMPT), 12)
    assert tokens != base_tokens  # the adapter changes what is generated
    expected = tokenizer.decode(tokens) + "\n"

    flags = ["--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]
    assert main(["generate", PROMPT, "--model", str(tmp_path / "base"), "--adapter",
                 str(tmp_path / "adapter"), *flags]) == 0  # fmt: skip
    assert capsys.readouterr().out == expected
    _run_merge("--model", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"),
               "--out", str(tmp_path / "merged"))  # fmt: skip
    capsys.readouterr()
    assert main(["generate", PROMPT, "--model", str(tmp_path / "merged"), *flags]) == 0
    assert capsys.readouterr().out == expected

    # --quantize int8 rounds the merged weights: the same as quantizing the merged model
    int8 = [*flags, "--quantize", "int8"]
    assert main(["generate", PROMPT, "--model", str(tmp_path / "merged"), *int8]) == 0
    quantized_merged = capsys.readouterr().out
    assert main(["generate", PROMPT, "--model", str(tmp_path / "base"), "--adapter",
                 str(tmp_path / "adapter"), *int8]) == 0  # fmt: skip
    assert capsys.readouterr().out == quantized_merged

    merged, _ = gf.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        ours = model(IDS % tokenizer.vocab_size)
        torch.testing.assert_close(merged(IDS % tokenizer.vocab_size), ours, atol=1e-5, rtol=0)
    convert_to_hf(tmp_path / "merged", tmp_path / "merged-hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged-hf").eval()
    with torch.no_grad():
        theirs = hf_model(IDS % tokenizer.vocab_size).logits
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)


def test_merge_refuses_to_overwrite_a_model(tmp_path):
    hf_model, model = _hf_and_glassformer(
        transformers.LlamaForCausalLM, _llama_config(), tmp_path / "base"
    )
    apply_lora(model, "q,v", rank=2)
    save_adapter(model, tmp_path / "adapter")
    given = ["--model", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter")]
    with pytest.raises(FolderError, match="which this command reads from"):
        _run_merge(*given, "--out", str(tmp_path / "base"))
    hf_model.save_pretrained(tmp_path / "other")
    with pytest.raises(FolderError, match=r"already holds a model.*--overwrite"):
        _run_merge(*given, "--out", str(tmp_path / "other"))
    with pytest.raises(FolderError, match=r"adapter is .*adapter, which this command reads from"):
        _run_merge(*given, "--out", str(tmp_path / "adapter"), "--overwrite")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(FolderError, match="holds files that are not a model"):
        _run_merge(*given, "--out", str(tmp_path / "notes"), "--overwrite")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    _run_merge(*given, "--out", str(tmp_path / "other"), "--overwrite")
    merged, _ = gf.from_pretrained(tmp_path / "other")
    merge_lora(model)
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS), model(IDS), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "command", [["generate", "hi"], ["chat"], ["serve"], ["inspect", "attention", "hi"]]
)
def test_model_loading_commands_take_an_adapter(command):
    from glassformer.cli import build_parser

    args = build_parser().parse_args([*command, "--model", "m", "--adapter", "dir"])
    assert args.adapter == "dir"
