"""int4 weights (nn/quant.py's Int4Linear, the kernels' q4 loop): the packing against its
closed form, the kernel against F.linear on the dequantized matrix, a quantized model against a
float model holding the same dequantized weights, and SmolLM2's Q4_1 file given back exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_gguf import tiny_hf_model, vocab, write_gguf  # noqa: F401  (vocab: a fixture)

from glassformer import kernels
from glassformer.config import ModelConfig
from glassformer.models import build_model
from glassformer.nn.quant import Int4Linear, Int8Linear, quantize_int4, quantize_q4


def test_packing_keeps_every_weight_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(12, 96) * torch.rand(12, 1)
    packed, scales, mins = quantize_q4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (12, 48) and scales.shape == (12, 3)
    back = kernels.dequantize(packed, scales, torch.float32, mins)
    step = scales.repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    # GGUF's order: byte j of a group holds weight j (low nibble) and weight j + 16 (high).
    q = torch.round((w[0, :32] - mins[0, 0]) / scales[0, 0]).to(torch.uint8)
    assert packed[0, 3].item() == q[3].item() | (q[19].item() << 4)


def test_weights_on_a_q4_grid_come_back_exactly():
    # What a Q4_1 (or Q4_0, Q4_K) file holds: scale * q + min with q over the whole 0..15.
    torch.manual_seed(1)
    q = torch.randint(0, 16, (8, 64)).float()
    q[:, ::32], q[:, 1::32] = 0, 15  # every group reaches both ends, as Q4_1's min/max do
    scale, low = torch.rand(8, 2, 1) * 0.1, torch.randn(8, 2, 1)
    w = (q.view(8, 2, 32) * scale + low).view(8, 64)
    packed, scales, mins = quantize_q4(w)
    back = kernels.dequantize(packed, scales, torch.float32, mins)
    torch.testing.assert_close(back, w, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_kernel_matches_the_dequantized_matmul(rows, simd):
    torch.manual_seed(2)
    packed, scales, mins = quantize_q4(torch.randn(40, 128))
    x = torch.randn(rows, 128)
    assert kernels.can_use(x, packed, scales)
    want = F.linear(x, kernels.dequantize(packed, scales, torch.float32, mins))
    torch.testing.assert_close(kernels.matvec(x, packed, scales, mins), want, atol=1e-4, rtol=1e-5)


def test_a_quantized_model_computes_with_its_dequantized_weights():
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=200, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                      max_seq_len=32, position="rope", norm="rms", ffn="swiglu")  # fmt: skip
    model = build_model(cfg).eval()
    quantized = quantize_int4(copy.deepcopy(model))
    reference = copy.deepcopy(model)
    with torch.no_grad():  # the float model, holding exactly what the int4 model computes with
        for (_, float_module), (_, int4_module) in zip(
            reference.named_modules(), quantized.named_modules(), strict=True
        ):
            if isinstance(int4_module, Int4Linear | Int8Linear):  # the head is int8
                float_module.weight = torch.nn.Parameter(int4_module.dequantize())
    ids = torch.tensor([[5, 17, 120, 3, 9, 44, 61]])
    with torch.inference_mode():
        torch.testing.assert_close(quantized(ids), reference(ids), atol=1e-4, rtol=1e-4)  # prefill
        cache_q, cache_r = quantized.new_cache(1, 32), reference.new_cache(1, 32)
        prompt, at = torch.arange(ids.shape[1]), torch.tensor([ids.shape[1]])
        quantized(ids, prompt, cache=cache_q), reference(ids, prompt, cache=cache_r)
        step = torch.tensor([[7]])
        torch.testing.assert_close(quantized(step, at, cache=cache_q),
                                   reference(step, at, cache=cache_r),
                                   atol=1e-4, rtol=1e-4)  # decode: the kernel  # fmt: skip


def test_narrow_layers_stay_float_and_other_families_are_refused():
    cfg = ModelConfig(vocab_size=50, d_model=48, n_layers=1, n_heads=2, d_ff=64, max_seq_len=16)
    model = quantize_int4(build_model(cfg))
    assert isinstance(model.blocks[0].ffn.fc_out, Int4Linear)  # 64 columns
    assert type(model.blocks[0].attn.qkv_proj) is torch.nn.Linear  # 48 columns
    with pytest.raises(ValueError, match="quantize_int4 supports GPT-family"):
        quantize_int4(build_model(ModelConfig(family="bert", vocab_size=50, d_model=32,
                                              n_layers=1, n_heads=2, max_seq_len=16)))  # fmt: skip


def test_smollm2_q4_1_file_is_given_back_by_int4():
    from glassformer.interop.pretrained import from_pretrained

    exact, _ = from_pretrained("smollm2")
    int4, _ = from_pretrained("smollm2", quantize="int4")
    for name in ("blocks.0.attn.qkv_proj", "blocks.7.ffn.down", "blocks.29.ffn.gate_up"):
        want = exact.get_submodule(name).weight
        assert torch.equal(int4.get_submodule(name).dequantize(), want)  # the file's blocks
    # The head (the tied Q8_0 embedding table) stays at 8 bits, in Q8_0's groups of 32.
    torch.testing.assert_close(int4.lm_head.dequantize(), exact.lm_head.weight, atol=1e-6, rtol=0)
    ids = torch.tensor([[504, 3575, 282, 4649, 314]])  # "The capital of France is"
    with torch.inference_mode():
        torch.testing.assert_close(int4(ids), exact(ids), atol=2e-3, rtol=1e-4)


def test_gguf_4bit_blocks_are_kept_bit_for_bit_and_wider_matrices_become_int8(tmp_path, vocab):  # noqa: F811
    """A file whose matrices cycle through Q4_0, Q4_1, Q4_K and Q6_K (a Q4_K_M file's mix):
    the gguf package's own dequantization of each matrix is the reference."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader

    from glassformer.interop.gguf import load_gguf
    from glassformer.interop.pretrained import from_pretrained

    hf = tiny_hf_model(hidden_size=256, intermediate_size=256, num_key_value_heads=2)
    path = write_gguf(tmp_path / "q4.gguf", hf, vocab, qtypes=[Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K])
    stored = {t.name: t.tensor_type for t in GGUFReader(str(path)).tensors}
    exact, _ = load_gguf(path)  # float32 through gguf.quants.dequantize
    int4, _ = from_pretrained(path, quantize="int4")
    sources = {"attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "attn.out_proj": ("attn_output",),
               "ffn.gate_up": ("ffn_gate", "ffn_up"), "ffn.down": ("ffn_down",)}  # fmt: skip
    kept = set()
    for i in range(2):
        for name, parts in sources.items():
            got = int4.get_submodule(f"blocks.{i}.{name}")
            want = exact.get_submodule(f"blocks.{i}.{name}").weight
            types = {stored[f"blk.{i}.{part}.weight"] for part in parts}
            if types <= {Q.Q4_0, Q.Q4_1, Q.Q4_K}:
                assert isinstance(got, Int4Linear)
                assert torch.equal(got.dequantize(), want), (name, types)  # bit for bit
                kept |= types
            else:
                assert isinstance(got, Int8Linear) and got.group_size == 32, (name, types)
                step = got.scales.repeat_interleave(32, dim=1)
                assert ((got.dequantize() - want).abs() <= step * 0.5001).all()  # + float rounding
    assert kept == {Q.Q4_0, Q.Q4_1, Q.Q4_K}  # each 4-bit type was read, qkv's rows unpermuted


def test_the_file_precision_is_the_one_that_keeps_its_numbers(tmp_path, vocab):  # noqa: F811
    """stored_precision (the CLI's default on the CPU) picks int4 for 4-bit blocks with a Q8_0
    head, int8 for an all-Q8_0 file, and float for anything a kernel would round; what it picks
    runs the numbers the gguf package's own dequantization gives."""
    from gguf import GGMLQuantizationType as Q

    from glassformer.interop.gguf import load_gguf
    from glassformer.interop.pretrained import from_pretrained, stored_precision

    hf = tiny_hf_model(hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    blocks = 7 * hf.config.num_hidden_layers  # q, k, v, o, gate, up, down; the table first
    files = {
        "int4": [Q.Q8_0] + [Q.Q4_0, Q.Q4_1] * (blocks // 2),
        "int8": [Q.Q8_0],
        None: [Q.Q8_0] + [Q.Q4_1] * (blocks - 1) + [Q.F16],  # one matrix above 4 bits
    }
    for want, qtypes in files.items():
        path = write_gguf(tmp_path / f"{want}.gguf", hf, vocab, qtypes=qtypes)
        assert stored_precision(path) == want, qtypes
        exact, _ = load_gguf(path)  # float32 through gguf.quants.dequantize
        own, _ = from_pretrained(path, quantize="file")
        kinds = {type(m) for m in own.blocks.modules()}
        assert (Int4Linear in kinds, Int8Linear in kinds) == (want == "int4", want == "int8")
        for name, module in own.named_modules():
            weight = exact.get_submodule(name).weight if hasattr(module, "dequantize") else None
            if isinstance(module, Int4Linear):
                assert torch.equal(module.dequantize(), weight), name  # the blocks, bit for bit
            elif isinstance(module, Int8Linear):  # Q8_0 regrouped by 32: fp16 scales in fp32
                torch.testing.assert_close(module.dequantize(), weight, atol=1e-6, rtol=0)
    assert stored_precision(write_gguf(tmp_path / "f32.gguf", hf, vocab)) is None


def test_decoding_commands_run_the_file_precision_unless_told(tmp_path, vocab):  # noqa: F811
    from gguf import GGMLQuantizationType as Q

    from glassformer.cli.common import DecodeOptions, load_for_decode
    from glassformer.nn.quant import precision_name

    hf = tiny_hf_model(hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    qtypes = [Q.Q8_0] + [Q.Q4_1] * 7 * hf.config.num_hidden_layers
    path = str(write_gguf(tmp_path / "q4_1.gguf", hf, vocab, qtypes=qtypes))
    runs = {
        DecodeOptions(threads=1): "int4",  # generate, chat, serve, rag ask by default
        DecodeOptions(threads=1, dtype="fp32"): "fp32",  # the file's weights dequantized
        DecodeOptions(threads=1, dtype="bf16"): "bf16",
        DecodeOptions(threads=1, quantize="int8"): "int8",
        DecodeOptions(threads=1, plain=True): "fp32",  # the model as built, for comparison
    }
    for options, want in runs.items():
        model, _ = load_for_decode(path, options, "the test needs one")
        assert precision_name(model) == want, options
