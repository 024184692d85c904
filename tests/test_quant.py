"""int8 weight-only quantization (issue 5) against float references: the dequantized weight in
float64, the rounding bound scale / 2, the float model's logits, greedy decoding recomputed
without a cache, and a Q8_0 GGUF file's own dequantized values.
"""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import finish_gguf, rounded_product, tiny_model
from gguf import GGMLQuantizationType as Q
from torch import nn

import glassformer as gf
from glassformer import kernels
from glassformer.cli import main
from glassformer.interop.gguf import load_gguf, rules
from glassformer.interop.hf import export_state
from glassformer.interop.pretrained import from_pretrained
from glassformer.nn import quant
from glassformer.nn.quant import (
    Int4Linear,
    Int8Linear,
    quantize_groupwise,
    quantize_int8,
    weight_bytes,
)
from glassformer.tokenizers import CharTokenizer
from glassformer.train.checkpoint import save_checkpoint, save_model_weights

# Widths that are multiples of 32 (the int8 kernel's step) and a head of its own. tiny_model's
# scale 8 gives peaked distributions, so greedy choices are not near-ties; scale 1 keeps the
# random network out of the chaotic regime where a 0.5% weight change grows layer by layer, for
# comparing logits.
SIZES = dict(vocab_size=97, d_model=64, d_ff=128, max_seq_len=64, tie_embeddings=False)


def int8_linears(model: nn.Module) -> list[Int8Linear]:
    return [m for m in model.modules() if isinstance(m, Int8Linear)]


# --- the module -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("in_features", "group_size"), [(64, 32), (64, None), (576, 64), (40, 8), (40, None)]
)  # 40: not a multiple of 32, the dequantize-then-F.linear path
@pytest.mark.parametrize("rows", [1, 15])  # 15 rows: more than the kernel takes
def test_int8_linear_equals_matmul_with_the_dequantized_weight(in_features, group_size, rows):
    linear = nn.Linear(in_features, 24, bias=True)
    layer = Int8Linear.from_linear(linear, group_size)
    x = torch.randn(rows, in_features)
    q, scales = layer.weight.double(), layer.scales.double()  # (O, K), (O, G)
    w = q * scales.repeat_interleave(layer.group_size, dim=1)  # recomputed here, column-wise
    reference = x.double() @ w.T + linear.bias.double()  # (rows, O)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (rows, 24) and out.dtype == torch.float32
    rel = (out.double() - reference).abs().max() / reference.abs().max()
    assert rel < 1e-5


def test_bf16_input_gives_bf16_output():
    layer = Int8Linear.from_linear(nn.Linear(64, 32, bias=True))
    x = torch.randn(1, 64)
    with torch.no_grad():
        out = layer(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), layer(x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("group_size", [None, 16])
def test_rounding_error_is_at_most_half_a_scale(group_size):
    w = torch.randn(33, 48)
    w[0] = 0.0  # an all-zero row
    w[1, 3] = 50.0  # an outlier: its group's scale is large
    q, scales = quantize_groupwise(w, group_size)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert scales.shape == (33, 1 if group_size is None else 48 // group_size)
    s = scales.double().repeat_interleave(q.shape[1] // scales.shape[1], dim=1)
    err = (w.double() - q.double() * s).abs()
    assert torch.all(err <= s / 2 * (1 + 1e-6))
    assert torch.all(q[0] == 0)
    assert torch.all(q[1:].abs().amax(dim=1) >= 126)  # each row uses the whole int8 range
    if group_size is not None:  # the outlier spoils only its own group's precision
        assert scales[1, 0] > 10 * scales[1, 1]


def test_bad_group_size_is_a_clear_error():
    with pytest.raises(ValueError, match="group_size=24 does not divide in_features=64"):
        Int8Linear.from_linear(nn.Linear(64, 8), group_size=24)
    with pytest.raises(ValueError, match="group_size=0 must be a positive integer"):
        quantize_int8(tiny_model(**SIZES), group_size=0)


def test_layers_the_group_does_not_divide_fall_back_to_smaller_groups():
    model = quantize_int8(tiny_model(**SIZES | {"d_model": 96, "d_ff": 160}), group_size=64)
    groups = {m.in_features: m.group_size for m in int8_linears(model)}
    assert groups == {96: 32, 160: 32}  # 64 divides neither width; 32 divides both
    odd = quantize_int8(tiny_model(**SIZES | {"d_model": 40, "d_ff": 80}), group_size=64)
    assert {m.in_features: m.group_size for m in int8_linears(odd)} == {40: 40, 80: 80}


# --- whole models -----------------------------------------------------------------------------


def logit_error(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """(max, rms) |logit difference| in units of the logits' standard deviation."""
    diff = (logits - reference).float()
    return float(diff.abs().max() / reference.std()), float(
        diff.pow(2).mean().sqrt() / reference.std()
    )


# Why these bounds: a row of K Gaussian weights has max|w| ~ 2.4 sigma at K = 64, so the int8
# step is ~ 0.019 sigma and its rounding error (uniform, std step / sqrt(12)) ~ 0.55% of sigma:
# each matmul output moves by ~0.55% rms, and a few of them in a row give about 0.7%.
# Per-channel measured on tiny_model(**SIZES, scale=1): max 0.028 / rms 0.0068; groups of 32
# are smaller.
@pytest.mark.parametrize("group_size", [None, 32])
def test_quantized_gpt_logits_are_close_to_float(group_size):
    model = tiny_model(**SIZES, scale=1.0)
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        reference = model(ids)
        quantized = quantize_int8(model, group_size)
        logits = quantized(ids)
    assert len(int8_linears(quantized)) == 2 * 4 + 1  # qkv, out, gate_up, down per block; head
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    max_error, rms_error = logit_error(reference, logits)
    assert max_error < 0.06 and rms_error < 0.015


def test_gpt2_style_model_with_biases():
    model = tiny_model(**SIZES, scale=1.0, position="learned", norm="layer", ffn="gelu", bias=True)
    ids = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        reference = model(ids)
        logits = quantize_int8(model)(ids)
    assert all(m.bias is not None for m in int8_linears(model)[:-1])  # the head has no bias
    max_error, rms_error = logit_error(reference, logits)
    assert max_error < 0.06 and rms_error < 0.015


def test_greedy_engine_with_kv_cache_equals_recompute():
    model = quantize_int8(tiny_model(**SIZES))
    prompt = [3, 14, 15, 9, 2, 6]
    result = gf.Engine(model).generate(prompt, max_new_tokens=20, temperature=0.0)
    ids = list(prompt)  # the reference: the whole sequence from scratch, no cache
    with torch.no_grad():
        for _ in range(20):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert result.token_ids == ids[len(prompt) :]


def test_tied_embeddings_are_untied_into_a_float_table_and_an_int8_head():
    model = tiny_model(**SIZES | {"tie_embeddings": True})
    table = model.tok_emb.weight.detach().clone()
    float_bytes = weight_bytes(model)
    quantize_int8(model)
    assert torch.equal(model.tok_emb.weight, table)  # the lookup keeps the float table
    head = model.lm_head
    assert isinstance(head, Int8Linear)
    half_scale = head.scales.repeat_interleave(head.group_size, dim=1) / 2
    assert torch.all((head.dequantize() - table).abs() <= half_scale + 1e-6)
    # Closed form: every float tensor but the block matrices stays, and each int8 matrix takes
    # O*K bytes plus O*K/g fp32 scales (g = 64 columns per scale); the tied table is now
    # stored twice (float + int8).
    cfg = model.cfg
    C, V, F_ = cfg.d_model, cfg.vocab_size, cfg.d_ff
    q_out = cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim
    matrices = [(q_out, C), (C, cfg.n_heads * cfg.head_dim), (2 * F_, C), (C, F_)]
    g = head.group_size
    assert g == 64
    block_int8 = cfg.n_layers * sum(o * k + 4 * o * k // g for o, k in matrices)
    block_fp32 = cfg.n_layers * sum(o * k * 4 for o, k in matrices)
    assert weight_bytes(model) == float_bytes - block_fp32 + block_int8 + V * C + 4 * V * C // g


def test_refuses_other_families_and_saving(tmp_path):
    bert = gf.build_model(gf.ModelConfig(family="bert", vocab_size=50, d_model=32, n_heads=2))
    with pytest.raises(ValueError, match=r"GPT-family.*'bert'"):
        quantize_int8(bert)
    with pytest.raises(ValueError, match=r"a quantized model.*quantize after loading"):
        save_model_weights(quantize_int8(tiny_model(**SIZES)), tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()


# --- loading: a checkpoint through the CLI, a Q8_0 GGUF file ------------------------------------


@pytest.fixture(scope="module")
def char_checkpoint(tmp_path_factory) -> Path:
    text = "To be, or not to be, that is the question. KING: "
    tokenizer = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    model = tiny_model(**SIZES | {"vocab_size": tokenizer.vocab_size})
    out = tmp_path_factory.mktemp("quant") / "run"
    save_checkpoint(out, 0, model, model.cfg, tokenizer)
    return out


def test_cli_quantize_flag_generates_what_the_quantized_model_does(
    char_checkpoint, capsys, monkeypatch
):
    model, tokenizer = from_pretrained(char_checkpoint, quantize="int8")
    assert len(int8_linears(model)) == 9
    ids = gf.Engine(model).generate(tokenizer.encode("To be"), 12, temperature=0.0).token_ids
    quantized = []  # the models the CLI quantized: greedy text alone may equal the float one's
    real_quantize = quantize_int8
    monkeypatch.setattr(
        quant, "quantize_int8", lambda m, *a: quantized.append(real_quantize(m, *a)) or m
    )
    args = ["generate", "--model", str(char_checkpoint), "To be", "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "12", "--quantize", "int8"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == "To be" + tokenizer.decode(ids)
    assert len(quantized) == 1 and len(int8_linears(quantized[0])) == 9


def test_unknown_quantize_value_is_one_clear_line(char_checkpoint, capsys):
    with pytest.raises(
        ValueError,
        match="quantize='int2' is not known: pick None, 'int8', 'int4', 'w8a8', 'w4a8' or 'file'",
    ):
        from_pretrained(char_checkpoint, quantize="int2")
    with pytest.raises(SystemExit):  # argparse: usage and one error line, exit status 2
        main(["generate", "--model", str(char_checkpoint), "hi", "--quantize", "int2"])
    assert "invalid choice: 'int2'" in capsys.readouterr().err


def write_q8_0_gguf(path: Path, model: nn.Module) -> Path:
    """A GPT's weights as a llama.cpp Q8_0 file: every matrix in blocks of 32 int8 values with
    one fp16 scale each, norms in F32, a byte-level vocabulary without merges."""
    from tokenizers.pre_tokenizers import ByteLevel

    cfg = model.cfg
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(sorted(ByteLevel.alphabet()))
    writer.add_token_types([1] * cfg.vocab_size)
    for name, tensor in export_state(model, rules(cfg, permuted=True)).items():
        data = tensor.numpy().astype(np.float32)
        if data.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(name, data)
    finish_gguf(writer)
    return path


def test_q8_0_gguf_loads_as_int8_exactly(tmp_path):
    """Q8_0 blocks are 32 int8 values times one fp16 scale, d = max|w| / 127 over the block:
    requantizing the file's values in groups of 32 finds the same q and d, so the int8 model
    computes with exactly the file's weights."""
    path = write_q8_0_gguf(
        tmp_path / "tiny.Q8_0.gguf", tiny_model(**SIZES | {"vocab_size": 256}, scale=1.0)
    )
    file_model, _ = load_gguf(path)  # the file's values, dequantized to float32
    model, tokenizer = from_pretrained(path, quantize="int8")
    file_linears = {n: m for n, m in file_model.named_modules() if isinstance(m, nn.Linear)}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert set(quantized) == set(file_linears) and len(quantized) == 9
    for name, layer in quantized.items():
        w_file = file_linears[name].weight  # (O, K): q_block * d_block, exact in fp32
        assert layer.group_size == 32
        assert torch.equal(layer.dequantize(), w_file)
    ids = torch.tensor([tokenizer.encode("The quick brown fox")])
    with torch.no_grad():
        reference, logits = file_model(ids), model(ids)
    max_error, rms_error = logit_error(reference, logits)
    assert max_error < 1e-5 and rms_error < 1e-6  # the same weights: rounding only


# --- inputs rounded to int8 (w8a8, w4a8) -------------------------------------------------------


def test_inputs_are_rounded_as_llama_cpp_rounds_q8_0_blocks():
    """round_to_int8 against gguf-py's Q8_0 quantizer (llama.cpp's reference in numpy): the
    same q in every block of 32, and d = max|x| / 127, which the file keeps in fp16. Values
    spread over magnitudes (and a block of zeros, and one with a single large value)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 256, generator=generator) * torch.logspace(-1, 2, 6)[:, None]
    x[0, :32] = 0.0
    x[1, 32:64] = 0.0
    x[1, 40] = 50.0
    rounded = quant.round_to_int8(x)
    blocks = x.unflatten(-1, (-1, 32))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(rounded.unflatten(-1, (-1, 32)) / d), 0.0)
    raw = gguf.quants.quantize(x.numpy(), Q.Q8_0).reshape(6, 8, 34)  # per block: fp16 d, 32 q
    file_d = torch.from_numpy(raw[..., :2].copy().view(np.float16).astype(np.float32))
    file_q = torch.from_numpy(raw[..., 2:].copy().view(np.int8).astype(np.float32))
    assert torch.equal(q, file_q)
    torch.testing.assert_close(d, file_d, rtol=5e-4, atol=0)  # fp16: 11 bits
    assert q.abs().max() == 127 and torch.equal(rounded, (q * d).flatten(-2))


def test_round_inputs_makes_w4a8_and_w8a8_models(char_checkpoint):
    from glassformer.nn.quant import precision_name

    model = tiny_model(**SIZES, scale=1.0)
    with pytest.raises(ValueError, match="quantize it first"):
        quant.round_inputs(model)
    ids = torch.tensor([[5, 17, 3, 60, 2, 9]])
    with torch.no_grad():
        reference = model(ids)
        int4 = quant.quantize_int4(copy.deepcopy(model))
        w4a8 = quant.round_inputs(quant.quantize_int4(copy.deepcopy(model)))
        w8a8 = quant.round_inputs(quantize_int8(copy.deepcopy(model), 32))
        assert [precision_name(m) for m in (int4, w4a8, w8a8)] == ["int4", "w4a8", "w8a8"]
        assert "inputs=int8" in repr(w4a8.lm_head)
        # rounding the inputs changes the logits (the function is another), by about what
        # rounding the weights does
        weights_only, both = logit_error(reference, int4(ids)), logit_error(reference, w4a8(ids))
        assert both[1] > 0 and both != weights_only and both[1] < 3 * weights_only[1]
    loaded, _ = from_pretrained(char_checkpoint, quantize="w8a8")
    assert precision_name(loaded) == "w8a8"


@pytest.mark.parametrize("kind", ["int8/32", "int8/64", "int4"])
@pytest.mark.parametrize("rows", [1, 16, 37])
@pytest.mark.parametrize("out_features", [48, 40])
def test_rounded_inputs_multiply_as_their_float64_products(kind, rows, out_features, simd):
    """w8a8 and w4a8 modules against their function in float64, with each kernel: on the tile
    unit (tiles_a8.h, the simd fixture's "amx"), else x rounded in torch and then the C loops
    (8 rows or fewer) or the dequantized matmul. 16 rows are one tile of inputs, 37 two and a
    part; 40 outputs two blocks of 16 weight rows and a part. A group of zeros (d = 0) and a
    group with one large value."""
    generator = torch.Generator().manual_seed(rows)
    linear = nn.Linear(192, out_features)
    if kind == "int4":
        module = Int4Linear.from_linear(linear)
    else:
        module = Int8Linear.from_linear(linear, int(kind.split("/")[1]))
    module.round_inputs = True
    x = 3 * torch.randn(rows, 192, generator=generator)
    x[0, :32] = 0.0
    x[-1, 64] = 40.0
    with torch.inference_mode():
        got = module(x)
        on_tiles = kernels.matmul_a8(x, module.weight, module.scales, getattr(module, "mins", None))
    assert (on_tiles is not None) == (simd == "amx")
    want = rounded_product(module, x)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
