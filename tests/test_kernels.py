"""The decode kernels (glassformer/kernels) and the optimized model (infer/optimize.py) against
torch's F.linear and the plain model."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import needs_kernels, tiny_model

import glassformer as gf
from glassformer import kernels
from glassformer.infer.engine import Engine
from glassformer.infer.optimize import DecodeLinear, optimize_for_decode


@needs_kernels
def test_kernels_build_on_this_machine():
    # A machine with AVX2/FMA and a C compiler (the project's) must have the kernels, not
    # silently F.linear instead (which would make every kernel test below vacuous).
    assert kernels.available()


@needs_kernels
def test_a_failed_build_warns_and_falls_back_to_linear(monkeypatch, tmp_path):
    # A compiler that fails (here `false`) into an empty cache: one warning that says the
    # kernels are unavailable and why, then torch's F.linear for every product, with its numbers.
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "SWITCH", "avx2")  # a library this process has not loaded yet
    kernels._load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="decode kernels unavailable.*false failed"):
            assert not kernels.available()
        weight, scale = int8_weight(24, 64)
        x = torch.randn(2, 64)
        assert not kernels.can_use(x, weight, scale)
        torch.testing.assert_close(
            kernels.matvec(x, weight, scale), F.linear(x, weight.float() * scale[:, None])
        )
        assert not list(tmp_path.rglob("*.so"))  # nothing half-built left under a final name
    finally:
        kernels._load.cache_clear()


def int8_weight(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(out_features, in_features)
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def reference(x: torch.Tensor, weight: torch.Tensor, scale=None) -> torch.Tensor:
    """F.linear in float64 on the exact weight values the kernel reads; scale (out,) or
    (out, G) for groups of in/G columns, expanded column by column here."""
    w = weight.double()
    if scale is not None:
        scale = scale.double().reshape(w.shape[0], -1)  # (out, G)
        w = w * scale.repeat_interleave(w.shape[1] // scale.shape[1], dim=1)
    return F.linear(x.double(), w)


# --- the kernels --------------------------------------------------------------------------------


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize(("out_features", "in_features"), [(7, 32), (96, 64), (33, 576)])
def test_matvec_equals_linear(storage, rows, out_features, in_features, simd):
    x = torch.randn(rows, in_features)
    if storage is torch.int8:
        weight, scale = int8_weight(out_features, in_features)
    else:
        weight, scale = torch.randn(out_features, in_features).to(storage), None
    assert kernels.can_use(x, weight) == (rows <= kernels.MAX_ROWS[storage])
    with torch.no_grad():
        y = kernels.matvec(x, weight, scale)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    # fp32 accumulation of `in` products in another order than float64: ~sqrt(in) ulps
    torch.testing.assert_close(y.double(), reference(x, weight, scale), rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize(("vendor", "prefetch"), [("AuthenticAMD", False), ("GenuineIntel", True)])
def test_each_vendors_build_gives_the_same_products(vendor, prefetch, monkeypatch):
    # On AMD's CPUs the one-row fp32 and bf16 dots leave their weights to the hardware
    # prefetcher (simd.h's FLOAT_PREFETCH): each vendor's library, built here whatever this
    # CPU is, multiplies as F.linear in float64 does.
    cpu_info = kernels.build.cpu_info
    monkeypatch.setattr(
        kernels.build, "cpu_info", lambda field: vendor if field == "vendor_id" else cpu_info(field)
    )
    assert ("-DFLOAT_PREFETCH=0" not in kernels.build.build_flags(avx512=False)) == prefetch
    monkeypatch.setattr(kernels, "SWITCH", "avx2")
    kernels._load.cache_clear()
    try:
        assert kernels.simd() == "avx2", "the kernels failed to build: see the warning"
        for storage in (torch.float32, torch.bfloat16):
            x, weight = torch.randn(1, 576), torch.randn(33, 576).to(storage)
            with torch.no_grad():
                y = kernels.matvec(x, weight)
            torch.testing.assert_close(y.double(), reference(x, weight), rtol=1e-5, atol=1e-4)
    finally:
        kernels._load.cache_clear()


def int8_groups(group: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (rows, 576) and an int8 weight (40, 576) with one scale per row and group of columns."""
    weight = torch.randint(-127, 128, (40, 576), dtype=torch.int8)
    scale = torch.rand(40, 576 // group) + 0.01
    return torch.randn(rows, 576), weight, scale


@pytest.mark.parametrize("group", [32, 64, 192])
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_group_scales_equal_linear(group, rows, simd):
    x, weight, scale = int8_groups(group, rows)
    assert kernels.can_use(x, weight, scale)
    with torch.no_grad():
        y = kernels.matvec(x, weight, scale)
    torch.testing.assert_close(y.double(), reference(x, weight, scale), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("group", [32, 64, 192])
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_group_scales_dequantized_equal_linear(group, rows):
    x, weight, scale = int8_groups(group, rows)  # what a machine without the kernels computes
    fallback = F.linear(x, kernels.dequantize(weight, scale, torch.float32))
    torch.testing.assert_close(fallback.double(), reference(x, weight, scale), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("bf16_products", [True, False])
def test_many_bf16_rows_are_torchs_bf16_matmul(bf16_products, monkeypatch):
    # Prefill of a bf16 model: torch's bf16 matmul where the CPU multiplies bf16 itself, else
    # fp32 matmuls on slices of the weight (here 7 rows a slice: 5 slices) widened exactly;
    # either way the float64 products' sums rounded to bf16, as torch's bf16 F.linear gives.
    monkeypatch.setattr(kernels, "bf16_products", lambda: bf16_products)
    monkeypatch.setattr(kernels, "SLICE_WEIGHTS", 7 * 576)
    x = torch.randn(3, 40, 576).to(torch.bfloat16)
    weight = torch.randn(33, 576).to(torch.bfloat16)
    with torch.no_grad():
        y = kernels.matvec(x, weight)
    assert y.shape == (3, 40, 33) and y.dtype == torch.bfloat16
    exact = F.linear(x.double(), weight.double())
    torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-3)  # bf16's rounding
    torch.testing.assert_close(y, F.linear(x, weight), rtol=2**-7, atol=1e-2)


def test_matvec_keeps_leading_dims_and_input_dtype():
    weight = torch.randn(48, 32)
    x = torch.randn(2, 1, 32).transpose(0, 1)  # (1, 2, 32), not contiguous
    with torch.no_grad():
        y = kernels.matvec(x, weight)
        y_bf16 = kernels.matvec(x.bfloat16(), weight.bfloat16())
    assert y.shape == (1, 2, 48)
    torch.testing.assert_close(y, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert y_bf16.dtype == torch.bfloat16
    expected = F.linear(x.bfloat16().float(), weight.bfloat16().float())
    torch.testing.assert_close(y_bf16.float(), expected, rtol=2e-2, atol=2e-2)


def test_shapes_the_kernel_does_not_take_fall_back_to_linear():
    weight = torch.randn(12, 20)  # in_features 20 is not a multiple of 32
    x = torch.randn(3, 20)
    many_rows = torch.randn(kernels.MAX_ROWS[torch.float32] + 1, 32)
    wide = torch.randn(5, 32)
    with torch.no_grad():
        assert not kernels.can_use(x, weight) and not kernels.can_use(many_rows, wide)
        torch.testing.assert_close(kernels.matvec(x, weight), F.linear(x, weight))
        torch.testing.assert_close(kernels.matvec(many_rows, wide), F.linear(many_rows, wide))
    # Training needs gradients, which the C loops do not give: F.linear is used.
    assert not kernels.can_use(torch.randn(1, 32, requires_grad=True), wide)
    assert not kernels.can_use(torch.randn(1, 64), wide)  # shapes that do not fit: F.linear says so


def test_int8_without_kernel_dequantizes_exactly():
    weight, scale = int8_weight(9, 20)
    x = torch.randn(2, 20)
    with torch.no_grad():
        y = kernels.matvec(x, weight, scale)
    torch.testing.assert_close(y.double(), reference(x, weight, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8 per row", "int8 groups of 32", "int4"])
@pytest.mark.parametrize("slice_rows", [5, 64])
def test_many_rows_dequantize_slice_by_slice_like_the_whole_matrix(
    kind, slice_rows, simd, monkeypatch
):
    """Prefill: more rows than the matvec loop takes. A slice of 5 weight rows at a time (the
    last one partial: 23 rows), or the whole matrix in one slice, must give the matmul on the
    whole dequantized matrix."""
    from glassformer.nn.quant import quantize_groupwise, quantize_q4

    monkeypatch.setattr(kernels, "SLICE_WEIGHTS", slice_rows * 64)
    monkeypatch.setattr(kernels, "_scratch", threading.local())
    torch.manual_seed(3)
    w = torch.randn(23, 64)
    if kind == "int4":
        weight, scale, mins = quantize_q4(w)
    else:
        weight, scale = quantize_groupwise(w, None if kind == "int8 per row" else 32)
        mins = None
    monkeypatch.setattr(kernels, "amx", lambda: False)  # the slices even on an AMX CPU
    x = torch.randn(2, 9, 64)  # (batch, time, in): leading dims kept
    with torch.no_grad():
        assert not kernels.can_use(x, weight, scale) and kernels._can_slice(x, weight, scale)
        got = kernels.matvec(x, weight, scale, mins)
    want = F.linear(x.double(), kernels.dequantize(weight, scale, torch.float64, mins))
    assert got.shape == (2, 9, 23) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8 per row", "int8 groups of 32", "int8 groups of 64", "int4"])
@pytest.mark.parametrize("rows", [9, 16, 37])
@pytest.mark.parametrize("out_features", [40, 48])
def test_many_rows_of_quantized_weights_equal_the_float64_products(kind, rows, out_features, simd):
    """Prefill's int8 and int4 products: on an AMX CPU (the simd fixture's "amx") through the
    tile unit's bf16 products, x in three exact bf16 pieces (tiles_split.h), elsewhere the
    dequantized slices; both against float64, element by element within 2e-6 of sum |w x| (an
    fp32 dot product's rounding; leaving out x's third piece, an error of 2^-16 of each x,
    fails it). 16 rows are one tile of inputs, 37 two and a part, 40 outputs two blocks of 16
    and a part; rows of inputs from 1e-3 to 1e3, and a chunk of zeros."""
    from glassformer.nn.quant import quantize_groupwise, quantize_q4

    torch.manual_seed(rows + out_features)
    w = torch.randn(out_features, 192)
    if kind == "int4":
        weight, scale, mins = quantize_q4(w)
    else:
        group = {"int8 per row": None, "int8 groups of 32": 32, "int8 groups of 64": 64}[kind]
        (weight, scale), mins = quantize_groupwise(w, group), None
    x = torch.randn(rows, 192) * torch.logspace(-3, 3, rows)[:, None]
    x[0, 32:64] = 0.0
    with torch.no_grad():
        got = kernels.matvec(x, weight, scale, mins)
        tiles = kernels._on_tiles(False, x, weight, scale, mins)
    assert (tiles is not None) == (simd == "amx")
    dequantized = kernels.dequantize(weight, scale, torch.float64, mins)
    want = F.linear(x.double(), dequantized)
    bound = 2e-6 * F.linear(x.double().abs(), dequantized.abs())
    assert ((got.double() - want).abs() <= bound).all()


def test_fast_linears_multiply_in_fp32_on_onednn(monkeypatch):
    """Prefill's F.linear inside FastLinears: oneDNN's matmul where torch has it, an fp32
    product all the same (against float64), bias added; with gradients it stays F.linear."""
    from torch.profiler import profile

    monkeypatch.setenv("GLASSFORMER_PREFILL_MATMUL", "onednn")

    torch.manual_seed(4)
    layer = torch.nn.Linear(96, 40)
    x = torch.randn(2, 33, 96)
    want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    with torch.no_grad(), profile() as trace, kernels.FastLinears():
        got = layer(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    ops = {event.name for event in trace.events()}
    if torch.backends.mkldnn.is_available():
        assert "mkldnn::_linear_pointwise" in ops and "aten::addmm" not in ops
    with kernels.FastLinears():
        loss = layer(x).sum()
    loss.backward()  # training keeps autograd's F.linear
    torch.testing.assert_close(layer.bias.grad, torch.full((40,), 66.0))


def test_fast_linears_apply_to_fp32_linears_only(monkeypatch):
    """The Engine enters the mode for models whose nn.Linear layers are fp32, not for bf16 or
    quantized ones (no gain there, only the mode's cost per torch call)."""
    from glassformer.nn.quant import quantize_int8

    monkeypatch.setenv("GLASSFORMER_PREFILL_MATMUL", "onednn")
    model = tiny_model()
    assert kernels.FastLinears.applies(model) == torch.backends.mkldnn.is_available()
    assert not kernels.FastLinears.applies(copy.deepcopy(model).to(torch.bfloat16))
    assert not kernels.FastLinears.applies(quantize_int8(copy.deepcopy(model)))


# --- the optimized model ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # Llama-style, tied
        {"position": "learned", "norm": "layer", "ffn": "gelu", "bias": True, "n_kv_heads": 4},
        {"tie_embeddings": False, "n_kv_heads": 1},
        {"ffn": "moe", "n_experts": 4, "n_experts_per_token": 2},
    ],
)
def test_optimized_model_equals_the_plain_one(overrides):
    plain = tiny_model(**overrides)
    fast = optimize_for_decode(copy.deepcopy(plain))
    assert any(isinstance(m, DecodeLinear) for m in fast.modules())
    assert not any(type(m) is torch.nn.Linear and n != "router" for n, m in _named(fast))
    prompt = torch.tensor([[3, 14, 15, 9, 2, 6, 5, 35]])
    with torch.inference_mode():
        assert_logits_close(fast(prompt), plain(prompt))
        # decode steps through the cache: 1 row each, the kernel path
        caches = plain.new_cache(1, 20), fast.new_cache(1, 20)
        plain(prompt, torch.arange(8), cache=caches[0])
        fast(prompt, torch.arange(8), cache=caches[1])
        for position, token in enumerate((7, 1, 30), start=8):
            step, at = torch.tensor([[token]]), torch.tensor([position])
            assert_logits_close(fast(step, at, cache=caches[1]), plain(step, at, cache=caches[0]))
    plain_ids = Engine(plain).generate([1, 2, 3], max_new_tokens=20, temperature=0).token_ids
    fast_ids = Engine(fast).generate([1, 2, 3], max_new_tokens=20, temperature=0).token_ids
    assert fast_ids == plain_ids


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # fp32 sums in another order, amplified through two layers of x8 weights: relative to
    # the logits' scale, far below any difference that changes a greedy choice
    assert (actual - expected).abs().max() <= 5e-5 * expected.abs().max()


def _named(model):
    for parent in model.modules():
        yield from parent.named_children()


def test_tied_head_keeps_sharing_the_embedding_table():
    fast = optimize_for_decode(tiny_model())
    assert fast.lm_head.weight is fast.tok_emb.weight


def test_bf16_model_matches_the_plain_model_cast_to_bf16():
    plain = tiny_model(vocab_size=40)  # the model the bounds below were set on
    fast = optimize_for_decode(copy.deepcopy(plain), dtype="bf16")
    reference_bf16 = copy.deepcopy(plain).to(torch.bfloat16)
    assert fast.lm_head.weight.dtype == torch.bfloat16
    ids = torch.tensor([[3, 14, 15, 9]])
    with torch.inference_mode():
        cache = fast.new_cache(1, 8)
        fast(ids[:, :3], torch.arange(3), cache=cache)
        step = fast(ids[:, 3:], torch.tensor([3]), cache=cache)[0, -1].float()  # the kernel path
        expected = reference_bf16(ids)[0, -1].float()
        full = plain(ids)[0, -1]
    # bf16 keeps 8 bits of mantissa; both bf16 paths stay near each other and near fp32
    scale = full.abs().max()
    assert (step - expected).abs().max() < 0.03 * scale
    assert (step - full).abs().max() < 0.05 * scale


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="dtype='fp16' is not supported"):
        optimize_for_decode(tiny_model(), dtype="fp16")
    bert = gf.build_model(
        gf.ModelConfig(family="bert", vocab_size=30, d_model=32, n_layers=1, n_heads=2)
    )
    with pytest.raises(ValueError, match="decoder-only"):
        optimize_for_decode(bert)


@pytest.mark.slow
def test_smollm2_fast_greedy_equals_plain_greedy():
    from glassformer.interop.pretrained import from_pretrained

    plain, tokenizer = from_pretrained("smollm2")
    prompt = tokenizer.encode("The capital of France is")
    expected = Engine(plain).generate(prompt, max_new_tokens=24, temperature=0).token_ids
    fast = optimize_for_decode(plain)
    assert Engine(fast).generate(prompt, max_new_tokens=24, temperature=0).token_ids == expected


def test_prefill_matmuls_go_to_the_library_chosen_for_the_cpu(monkeypatch):
    """MKL on Intel CPUs and oneDNN elsewhere (each the faster there, benchmarks/
    prefill_matmul.py), GLASSFORMER_PREFILL_MATMUL overriding; with MKL chosen the Engine's
    prefill takes torch's own F.linear (aten's matmul, no oneDNN op), the same fp32 numbers."""
    from torch.profiler import profile

    assert kernels._prefill_matmul("", "GenuineIntel") == "mkl"
    assert kernels._prefill_matmul("", "AuthenticAMD") == "onednn"
    assert kernels._prefill_matmul(" oneDNN ", "GenuineIntel") == "onednn"
    assert kernels._prefill_matmul("mkl", "AuthenticAMD") == "mkl"
    with pytest.raises(ValueError, match=r"GLASSFORMER_PREFILL_MATMUL='cublas'.*onednn or mkl"):
        kernels._prefill_matmul("cublas", "GenuineIntel")
    monkeypatch.setenv("GLASSFORMER_PREFILL_MATMUL", "mkl")
    model = tiny_model()
    assert kernels.prefill_matmul() == "mkl" and not kernels.FastLinears.applies(model)
    layer, x = torch.nn.Linear(96, 40), torch.randn(2, 33, 96)
    with torch.no_grad(), profile() as trace:
        got = kernels.linear(x, layer.weight)
    assert "mkldnn::_linear_pointwise" not in {event.name for event in trace.events()}
    torch.testing.assert_close(got, x @ layer.weight.T.detach(), rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("width", [1, 7, 16, 17, 63, 64, 65, 100, 49152])
def test_all_finite_finds_every_nan_and_infinity_numpy_finds(width, simd):
    # matvec.c's all_finite against numpy: a NaN, +inf or -inf in the first value, in the four-
    # vector loop, in the one-vector loop and in the tail; finite values near float32's largest
    # (whose sum overflows) pass; anything but contiguous float32 is left to torch (None).
    generator = torch.Generator().manual_seed(width)
    cases = [torch.randn(width, generator=generator),
             torch.full((width,), torch.finfo(torch.float32).max)]  # fmt: skip
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in sorted({0, width // 2, width - 17, width - 5, width - 1} - {-1}):
            case = torch.randn(width, generator=generator)
            case[max(at, 0)] = bad
            cases.append(case)
    verdicts = [kernels.all_finite(case) for case in cases]
    assert verdicts == [bool(np.isfinite(case.numpy()).all()) for case in cases]
    assert verdicts.count(True) == 2
    assert kernels.all_finite(cases[0].double()) is None
    assert kernels.all_finite(torch.randn(4, width, generator=generator).T) is (
        None if width > 1 else True
    )


@needs_kernels
@pytest.mark.parametrize("width", [1, 7, 16, 17, 100, 49152])
def test_argmax_picks_the_index_torch_picks(width, simd):
    # matvec.c's argmax_rows against torch.argmax: random rows, rows of few values (ties: the
    # first of the largest), a row of -inf, -inf beside values, and a NaN (torch's answer).
    generator = torch.Generator().manual_seed(width)
    rows = [torch.randn(width, generator=generator),
            torch.randint(0, 3, (width,), generator=generator).float(),
            torch.full((width,), float("-inf")),
            torch.randn(width, generator=generator).masked_fill(torch.arange(width) % 3 == 0,
                                                                 float("-inf"))]  # fmt: skip
    nan = torch.randn(width, generator=generator)
    nan[width // 2] = float("nan")
    logits = torch.stack([*rows, nan])
    assert torch.equal(kernels.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(kernels.argmax(logits[:4]), logits[:4].argmax(dim=-1))
    assert kernels.argmax(logits[1:2].double()).tolist() == logits[1:2].argmax(dim=-1).tolist()
