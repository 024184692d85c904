"""The fused decode step (infer/fused.py, kernels/decode.c) against the torch modules: the same
fp32 logits on the architectures it takes (Llama/GQA, Qwen2's qkv bias, Qwen3's qk_norm, GPT-2's
LayerNorm and learned positions, a plain ReLU MLP, GeGLU, head dims of 24, 32, 64 and 128);
bf16, int8 and int4 weights on two of them (Llama/GQA, GPT-2); runs of tokens in fp32, int8 and
int4 on three; the Engine's greedy and sampled tokens with and without it; and the models it
refuses, with why."""

from __future__ import annotations

import copy
import ctypes

import pytest
import torch
import torch.nn.functional as F
from conftest import SWITCH_FOR, needs_kernels, rounded_product, tiny_model

from glassformer import kernels
from glassformer.config import ModelConfig
from glassformer.infer.engine import Engine
from glassformer.infer.fused import FusedStep, unsupported
from glassformer.infer.optimize import optimize_for_decode
from glassformer.inspect.capture import capture
from glassformer.kernels import step as step_h
from glassformer.models import build_model
from glassformer.nn.lora import apply_lora, lora_parameters, merge_lora
from glassformer.nn.quant import quantize_int4, quantize_int8, round_inputs

pytestmark = needs_kernels

LLAMA = dict(position="rope", norm="rms", ffn="swiglu", bias=False, n_kv_heads=2)
ARCHS = {
    "llama-gqa": LLAMA,
    "qwen2-qkv-bias": {**LLAMA, "qkv_bias": True},
    "qwen3-qk-norm": {**LLAMA, "qk_norm": True, "rope_theta": 1e6},
    "gpt2": dict(position="learned", norm="layer", ffn="gelu_tanh", bias=True),
    "relu-sinusoidal-mha": dict(position="sinusoidal", norm="layer", ffn="relu", bias=False),
    "geglu-scaled": {**LLAMA, "ffn": "geglu", "attention_scale": 0.3, "n_kv_heads": 1},
    "head-dim-24": {**LLAMA, "d_model": 96},  # attention's scalar loop where SIMD lanes are 16
    # attention's weighted values summed in registers: heads of 4 and 8 vectors (AVX-512: 64
    # and 128 floats; AVX2: 32 and 64)
    "head-dim-32": {**LLAMA, "n_heads": 2, "n_kv_heads": 1},
    "head-dim-64": {**LLAMA, "d_model": 128, "n_heads": 2, "n_kv_heads": 1},
    "head-dim-128": {**LLAMA, "d_model": 256, "n_heads": 2, "n_kv_heads": 1},
    # three query heads to a key/value head, which go over its rows together: SmolLM2's 9 on 3
    # (64 floats, three at a time over the keys), and 128-float heads (two at a time, then one)
    "smollm2-heads": {**LLAMA, "d_model": 576, "n_heads": 9, "n_kv_heads": 3},
    "gqa-128": {**LLAMA, "d_model": 384, "n_heads": 3, "n_kv_heads": 1},
}


SIZES = dict(vocab_size=300, d_model=64, n_heads=4, n_kv_heads=None, d_ff=96)


def _model(arch: str, seed: int = 0, **fields) -> torch.nn.Module:
    model = tiny_model(**SIZES | ARCHS[arch] | fields, seed=seed, scale=1)
    with torch.no_grad():  # norm gains and biases away from 1 and 0, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                p.copy_(
                    1 + 0.3 * torch.randn_like(p) if "norm.weight" in name else torch.randn_like(p)
                )
    return model


def _torch_step(model, token: int, position: int, cache) -> torch.Tensor:
    ids, positions = torch.tensor([[token]]), torch.tensor([position])
    return model(ids, positions, cache=cache, last_token_only=True)[:, -1].float()


def _compare(
    model, fused_model=None, cache_dtype=torch.float32, n_steps: int = 6, step=None,
    reference_dtype=torch.float32,
):  # fmt: skip
    """Prefill 5 tokens through torch into a cache (in reference_dtype) and a copy of it (in
    cache_dtype), then decode n_steps tokens, the cache through `model`'s modules, the copy
    through `step` (default: a fused step of fused_model, default model): the largest logit
    difference."""
    step = step or FusedStep(fused_model or model)
    length = max(48, 5 + n_steps)
    reference = model.new_cache(1, length, dtype=reference_dtype)
    worst, token = 0.0, 7
    with torch.inference_mode():
        model(torch.tensor([[3, 141, 59, 26, 5]]), torch.arange(5), cache=reference)
        fused = model.new_cache(1, length, dtype=cache_dtype)
        fused.k.copy_(reference.k), fused.v.copy_(reference.v)
        for position in range(5, 5 + n_steps):
            want = _torch_step(model, token, position, reference)
            got = step(token, position, fused)
            worst = max(worst, (got - want).abs().max().item())
            token = int(want.argmax())
    return worst


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fp32_step_matches_the_modules(arch, simd):
    assert _compare(_model(arch)) < 1e-4


@pytest.mark.parametrize("arch", ["head-dim-32", "head-dim-64", "head-dim-128"])
def test_long_attention_matches_the_modules_at_every_head_size(arch, simd):
    # 145 positions: the scores four keys at a time (key_scores) and a rest, the softmax 16
    # (AVX-512) or 8 scores at a time and then a scalar tail, and the weighted values, kept in
    # registers for heads of 4 or 8 vectors, prefetch 8 positions ahead; each head size takes
    # its own branch.
    assert _compare(_model(arch), n_steps=140) < 1e-4


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("arch", ["smollm2-heads", "gqa-128"])
def test_query_heads_of_one_key_value_head_attend_together(arch, threads, simd, monkeypatch):
    # attention.h's attend takes the query heads of one key/value head in one pass over its
    # keys and values; one row's heads are shared out in contiguous runs, which can end inside
    # such a group (SmolLM2's 9 heads on 2 threads: 0-4 and 5-8). Against the modules over 140
    # positions, and bit for bit against the batched step, which takes one head at a time.
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert _compare(_model(arch), n_steps=140) < 1e-4
    _batch_matches(arch, 32, 7)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_long_contexts_and_far_out_exponentials_match(arch, threads, simd, monkeypatch):
    # The C step's exponentials are its own SIMD ones (kernels/simd.h): the softmax's over 16
    # or 8 scores at a time plus a scalar tail (40 positions here), SiLU's and GELU's. With the
    # up-projections and q/k scaled up, FFN inputs reach the thousands and scores the hundreds,
    # where e^x is clamped; a 0.2% error in one coefficient of its polynomial fails this. With
    # 3 threads, each takes a third of every matrix's rows and of the heads (150 positions).
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    model = _model(arch, max_seq_len=160)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv_proj.weight.mul_(8.0)
            (block.ffn.gate_up if arch == "llama-gqa" else block.ffn.fc_in).weight.mul_(200.0)
    step, fused, reference = FusedStep(model), model.new_cache(1, 160), model.new_cache(1, 160)
    worst, largest, token = 0.0, 0.0, 7
    with torch.inference_mode():
        for position in range(150):
            want = _torch_step(model, token, position, reference)
            worst = max(worst, (step(token, position, fused) - want).abs().max().item())
            largest, token = max(largest, want.abs().max().item()), int(want.argmax())
    assert worst < 1e-5 * largest


@pytest.mark.parametrize("bits", [32, 8, 4, "w4a8"])
@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2", "qwen3-qk-norm"])
def test_a_run_of_tokens_matches_the_forward_over_them(arch, bits, simd):
    # many(): up to max_tokens consecutive tokens in one call (a speculative round's check),
    # each seeing the cache and the run's earlier tokens, as one forward over the run does.
    model = _quantized(_model(arch), bits)
    step, prompt, run = FusedStep(model), [3, 141, 59, 26, 5], [7, 200, 11, 42, 9, 1, 2, 3]
    with torch.inference_mode():
        reference, fused = model.new_cache(1, 48), model.new_cache(1, 48)
        for cache in (reference, fused):
            model(torch.tensor([prompt]), torch.arange(5), cache=cache)
        want = model(torch.tensor([run]), torch.arange(5, 13), cache=reference)[0]  # (8, V)
        got = step.many(run, 5, fused)
    assert got.shape == want.shape and (got - want).abs().max() < _tolerance(bits)
    torch.testing.assert_close(fused.k[:, :, :, :13], reference.k[:, :, :, :13], atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.k[..., :13, :], reference.k[..., :13, :], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="9 tokens: the fused step takes 1 to 8"):
        step.many([1] * 9, 0, fused)


# int8's dot products are compiled once for groups of 32 (Q8_0), once for 64 (Int8Linear's
# default: the widths here that 64 does not divide get 32) and once for any other grouping
# (one scale per row, here 64 and 96 columns)
INT8_GROUPS = {8: 32, "8/64": 64, "8/row": None}


def _tolerance(bits) -> float:
    """The largest logit difference from the torch modules a step may show. With inputs rounded
    to int8, an input that the two paths compute a rounding apart (float order) can round to
    neighbouring integers: one q differs by 1, and the logits by up to a few 1e-3 (3.3e-3 seen);
    test_each_projection_matches_its_module_on_the_same_input holds those products to 1e-5."""
    return 1e-2 if bits in ("w8a8", "w4a8") else 1e-4


def _quantized(model, bits):
    """The model in a precision of the tests' names: 32, 4, 8 (groups of 32), 8/64, 8/row, and
    w8a8 / w4a8 (int8 groups of 32 or int4, inputs rounded to int8: a8.h)."""
    if bits in ("w8a8", "w4a8"):
        return round_inputs(_quantized(model, 8 if bits == "w8a8" else 4))
    if bits == 32:
        return model
    return quantize_int4(model) if bits == 4 else quantize_int8(model, INT8_GROUPS[bits])


@pytest.mark.parametrize("n_rows", [2, 4, 5, 7])
@pytest.mark.parametrize("bits", [32, 8, 4, "w8a8", "w4a8"])
@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2", "qwen3-qk-norm"])
def test_a_batch_of_rows_matches_the_batched_forward_and_each_row_alone(arch, bits, n_rows, simd):
    _batch_matches(arch, bits, n_rows)


@pytest.mark.parametrize("bits", ["8/64", "8/row"])
def test_every_int8_grouping_batches_as_it_runs_alone(bits, simd):
    _batch_matches("llama-gqa", bits, 7)


@pytest.mark.parametrize("threads", [3, 6])
def test_a_batch_splits_its_heads_and_rows_among_threads(threads, simd, monkeypatch):
    # Each thread takes a share of every matrix's rows and of the attention: with 3 threads,
    # 7 rows' 2 key/value heads (14 units, each thread with its own scores), unevenly; with 6,
    # more threads than the 4 query heads, the heads, which leaves two threads without one.
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    _batch_matches("llama-gqa", 32, 7)


def test_threads_attending_at_once_keep_their_own_scores(simd, monkeypatch):
    # 16 rows of 2 key/value heads: units of one row's key/value head, shared by 2 threads
    # that attend at the same moment, each over ~400 positions; a scores buffer the threads
    # shared would mix their softmaxes (the rows then differ from each row run alone).
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    model = tiny_model(**SIZES | LLAMA, max_seq_len=512, scale=1)
    step, generator = FusedStep(model, max_tokens=16), torch.Generator().manual_seed(0)
    cache = model.new_cache(16, 512)
    with torch.inference_mode():
        cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
        cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
        alone = copy.deepcopy(cache)
        positions = torch.randint(380, 420, (16,), generator=generator).tolist()
        tokens, slots = list(range(16)), list(range(16))[::-1]
        for _ in range(3):
            got = step.rows(tokens, positions, slots, cache)
            one_by_one = torch.cat(
                [step(t, p, alone, s) for t, p, s in zip(tokens, positions, slots, strict=True)]
            )
            assert torch.equal(got, one_by_one)


def _batch_matches(arch, bits, n_rows):
    # rows(): the Engine's batched step, each row a token at its own position of its own slot.
    # Against the torch modules' batched forward over the same cache rows (float rounding),
    # and against one-row calls on a copy of the cache: exactly, the same dot products. Rows
    # go in tiles of inputs (decode.c's ROW_TILE: 4, or 2 on AVX2), the last one partial but
    # for 4 rows: 2 (a partial tile on AVX-512), 5 (a tile and one), 7 (a tile and three).
    model = _quantized(_model(arch), bits)
    step, generator = FusedStep(model, max_tokens=n_rows), torch.Generator().manual_seed(0)
    lengths = [5, 11, 2, 8, 14, 1, 9][:n_rows]  # rows in no order of slot, apart in length
    slots = [slot for slot in (2, 0, 3, 1, 6, 4, 5) if slot < n_rows]
    tokens = [7, 200, 11, 42, 99, 3, 150][:n_rows]
    with torch.inference_mode():
        reference = model.new_cache(n_rows, 48)
        for slot, length in zip(slots, lengths, strict=True):
            prompt = torch.randint(0, 300, (1, length), generator=generator)
            model(prompt, torch.arange(length), cache=reference.rows(slot, slot + 1))
        fused, alone = copy.deepcopy(reference), copy.deepcopy(reference)
        order = sorted(range(n_rows), key=lambda i: slots[i])  # the forward reads every slot
        ids = torch.tensor([[tokens[i]] for i in order])
        positions = torch.tensor([[lengths[i]] for i in order])
        want = model(ids, positions, cache=reference, last_token_only=True)[:, -1]  # (n, V)
        want = want[torch.tensor(order).argsort()]  # back in the rows' order
        got = step.rows(tokens, lengths, slots, fused)
        picks = step.picks  # the greedy picks the C step found
        one_by_one, alone_picks = [], []
        for t, n, s in zip(tokens, lengths, slots, strict=True):
            one_by_one.append(step(t, n, alone, s))
            alone_picks += step.picks
        one_by_one = torch.cat(one_by_one)
    assert (got - want).abs().max() < _tolerance(bits)
    assert picks == alone_picks == got.argmax(dim=-1).tolist()
    assert torch.equal(got, one_by_one)
    assert torch.equal(fused.k, alone.k) and torch.equal(fused.v, alone.v)
    torch.testing.assert_close(fused.k, reference.k, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="each row needs its own slot"):
        step.rows([1, 2], [3, 3], [0, 0], fused)
    with pytest.raises(ValueError, match=f"takes 1 to {n_rows} rows"):
        step.rows([1] * (n_rows + 1), [3] * (n_rows + 1), list(range(n_rows + 1)), fused)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_logit_is_no_pick_and_the_engine_says_why(bad, simd):
    # A logit that is NaN or infinite (one head weight made so): the C step picks nothing for
    # its row (FusedStep.picks -1, in one-row and batched calls), and a greedy Engine refuses
    # the step with the words its torch path has, as torch's logits would make it.
    model = _model("llama-gqa")
    with torch.no_grad():
        model.lm_head.weight[123, 0] = bad
    step = FusedStep(model, max_tokens=3)
    with torch.inference_mode():
        cache = model.new_cache(3, 16)
        logits = step(5, 0, cache, 1)
        assert not logits[0, 123].isfinite() and step.picks == [-1]
        step.rows([5, 6, 7], [1, 0, 0], [1, 0, 2], cache)
        assert step.picks == [-1, -1, -1]
    for fast in (True, False):
        with pytest.raises(ValueError, match=r"logits at step 1 are NaN/inf"):
            Engine(model, fast=fast).generate([3, 141, 59], 4, temperature=0.0)


def test_the_engine_decodes_a_batch_through_the_fused_rows(monkeypatch):
    # A batch of rows goes through FusedStep.rows, never the torch forward, and each row gets
    # the tokens it gets decoding alone.
    model = _model("llama-gqa")
    engine = Engine(model, max_rows=4)
    prompts = [[3, 141, 59], [26, 5, 7, 8, 9], [1], [200, 11]]
    alone = [engine.generate(p, 10, temperature=0.0).token_ids for p in prompts]
    calls, torch_decodes = [], []
    rows, forward = FusedStep.rows, model.forward

    def counted_rows(self, tokens, *rest):
        calls.append(len(tokens))
        return rows(self, tokens, *rest)

    def counted_forward(ids, *rest, **kwargs):
        if ids.shape[0] > 1 and ids.shape[1] == 1:  # a batched one-token (decode) forward
            torch_decodes.append(ids.shape[0])
        return forward(ids, *rest, **kwargs)

    monkeypatch.setattr(FusedStep, "rows", counted_rows)
    monkeypatch.setattr(model, "forward", counted_forward)
    batch = engine.generate_batch(prompts, 10, temperature=0.0)
    assert [r.token_ids for r in batch] == alone
    assert max(calls) == 4 and not torch_decodes


def test_a_short_prefill_runs_through_the_fused_step(monkeypatch):
    # A prompt of FUSED_PREFILL tokens or fewer, and a conversation's next turn, go through
    # FusedStep.many (max_tokens at a time: 8 here; a decode step is a `many` of one), a longer
    # one through the torch forward; the tokens are those of the torch modules alone.
    from glassformer.infer.prefill import FUSED_PREFILL
    from glassformer.infer.sampling import SamplingParams

    model = _model("llama-gqa")
    fast, plain = Engine(model, max_rows=4), Engine(model, max_rows=4, fast=False)
    assert fast.fused.max_tokens == 8 and FUSED_PREFILL > 20
    runs, forwards = [], []
    many, forward = FusedStep.many, model.forward

    def counted_many(self, tokens, position, *rest):
        runs.append((len(tokens), position))
        return many(self, tokens, position, *rest)

    def counted_forward(ids, *rest, **kwargs):
        forwards.append(ids.shape[1])
        return forward(ids, *rest, **kwargs)

    monkeypatch.setattr(FusedStep, "many", counted_many)
    monkeypatch.setattr(model, "forward", counted_forward)
    short = [(7 * i) % 250 + 1 for i in range(20)]
    long = [(11 * i) % 250 + 1 for i in range(FUSED_PREFILL + 1)]
    for params in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 3}):
        runs.clear(), forwards.clear()
        got = fast.generate(short, max_new_tokens=6, **params).token_ids
        assert runs[:3] == [(8, 0), (8, 8), (4, 16)] and forwards == []  # then the decode steps
        assert got == plain.generate(short, max_new_tokens=6, **params).token_ids
        forwards.clear()
        got = fast.generate(long, max_new_tokens=6, **params).token_ids
        assert forwards == [len(long)]
        assert got == plain.generate(long, max_new_tokens=6, **params).token_ids
    first = fast.add(short, SamplingParams(temperature=0.0, max_new_tokens=6), keep_cache=True)
    while not first.finished:
        fast.step()
    runs.clear(), forwards.clear()
    turn = [*first.context, 5, 6, 7]
    second = fast.add(turn, continues=first)
    assert second.stats.cached_prompt_tokens == len(first.context) - 1
    assert runs[0] == (4, len(first.context) - 1) and forwards == []


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_bf16_weights_match_their_float32_copy(arch, simd):
    # The C step reads bf16 weights and computes in float32: the exact reference is a float32
    # model holding the same (bf16-rounded) weights, with a float32 cache.
    half = optimize_for_decode(_model(arch), "bf16")
    rounded = copy.deepcopy(half).float()
    assert _compare(rounded, fused_model=half) < 1e-4


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_a_half_cache_rounds_keys_and_values_only(cache_dtype):
    # A bf16 or f16 cache (a bf16 model's, or the Engine's kv_dtype) changes the logits by the
    # rounding of the cached keys and values: small against the logits' own spread.
    model = _model("llama-gqa")
    exact = _compare(model)
    rounded = _compare(model, cache_dtype=cache_dtype)
    assert exact < 1e-4 and rounded < 0.02


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2", "qwen3-qk-norm", "head-dim-64"])
def test_a_half_cache_reads_and_writes_as_the_modules_do(arch, cache_dtype, simd):
    # The exact reference for a half cache: the modules over a cache of the same dtype (keys
    # and values rounded to nearest even when written, read back as float32).
    model = _model(arch)
    assert _compare(model, cache_dtype=cache_dtype, reference_dtype=cache_dtype) < 1e-4


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
@pytest.mark.parametrize("bits", [8, "8/64", "8/row", 4, "w8a8", "w4a8"])
def test_quantized_weights_match_the_quantized_modules(arch, bits, simd):
    assert _compare(_quantized(_model(arch), bits)) < _tolerance(bits)


@pytest.mark.parametrize("rows", [1, 7, 19])
@pytest.mark.parametrize("bits", [32, 8, "8/64", 4, "w8a8", "w4a8"])
@pytest.mark.parametrize("d_model", [224, 288])
def test_each_projection_matches_its_module_on_the_same_input(d_model, bits, rows, simd):
    # decode.c's linear() alone (linear_rows) against the module's forward on the same input,
    # one row and a tile of inputs and a rest. a8.h takes int4 rows 4 groups of 32 at a time
    # (AVX2: 2) and int8 rows 2 (AVX2: 1), in pairs of chunks, then one whole chunk and a part
    # where they are left: widths of 7 and 9 groups (d_model) and 5 and 13 (d_ff) take each.
    # 19 rows of int8 or int4 weights go to the tile unit where it runs (tiles_a8.h for
    # rounded inputs, tiles_split.h for float ones), as the module's own forward does: both
    # are held to the float64 products too.
    _projections_match(d_model, bits, rows)


def test_byte_products_without_vnni_are_the_same(monkeypatch):
    # An AVX-512 CPU without VNNI (Skylake-X) forms a8.h's byte products with maddubs and madd
    # instead of vpdpbusd: the same integer sums.
    if "avx512" not in kernels.simd_widths():
        pytest.skip("no AVX-512 on this CPU")
    monkeypatch.setattr(kernels, "SWITCH", "on")
    monkeypatch.setattr(kernels.build, "VNNI_FLAGS", ())
    kernels._load.cache_clear()
    try:
        _projections_match(224, "w4a8", 7)
        _projections_match(288, "w8a8", 1)
    finally:
        kernels._load.cache_clear()


def test_a_compiler_without_the_tile_units_flags_builds_the_loops_alone(monkeypatch):
    # GCC before 11 knows no -mamx-int8: on an AMX CPU the build with the tile unit fails, and
    # the kernels come without it (a warning says so) rather than not at all.
    if not kernels.build.has_amx():
        pytest.skip("no AMX on this CPU")
    monkeypatch.setattr(kernels, "SWITCH", "on")
    monkeypatch.setattr(kernels.build, "AMX_FLAGS", ("-mno-such-flag",))
    kernels._load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="AMX kernels unavailable"):
            assert kernels.simd() == "avx512"
        assert not kernels.amx()
        _projections_match(224, 4, 7)
    finally:
        kernels._load.cache_clear()


def _projections_match(d_model, bits, rows):
    sizes = {**SIZES, "d_model": d_model, "n_heads": 2, "d_ff": 160 if d_model == 224 else 416}
    model = _quantized(tiny_model(**sizes | LLAMA, seed=2, scale=1), bits)
    step, generator = FusedStep(model), torch.Generator().manual_seed(0)
    function = kernels.library().linear_rows
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                         ctypes.c_int]  # fmt: skip
    block = model.blocks[0]
    for module in (block.attn.qkv_proj, block.attn.out_proj, block.ffn.down, model.lm_head):
        struct = step._linear(module)
        step._pack_for_tiles([(struct, module)])  # int4 on the tile unit where it runs there
        x = 3 * torch.randn(rows, struct.in_, generator=generator)
        x[0, :32] = 0.0  # a group of zeros: d = 0
        got = torch.empty(rows, struct.out)
        function(ctypes.addressof(struct), x.data_ptr(), rows, got.data_ptr(), 2)
        with torch.inference_mode():
            want = module(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        if getattr(module, "round_inputs", False):
            exact = rounded_product(module, x)
        else:  # the weights the module holds, in float64
            weight = module.dequantize() if hasattr(module, "dequantize") else module.weight
            exact = F.linear(x.double(), weight.double().detach())
            exact = exact if module.bias is None else exact + module.bias.double()
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)


def _int4_products(switch, module, x, monkeypatch):
    """decode.c's linear() (linear_rows) for an int4 module under GLASSFORMER_KERNELS=switch."""
    monkeypatch.setattr(kernels, "SWITCH", switch)
    step = FusedStep(_model("llama-gqa"))  # keeps the tensors the struct points to
    struct = step._linear(module)
    step._pack_for_tiles([(struct, module)])
    assert (struct.packed is not None) == (switch == "on")  # amx.h's copy, or dot_q4
    function = kernels.library().linear_rows
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                         ctypes.c_int]  # fmt: skip
    y = torch.empty(x.shape[0], struct.out)
    function(ctypes.addressof(struct), x.contiguous().data_ptr(), x.shape[0], y.data_ptr(), 2)
    return y


@pytest.fixture
def int4_case():
    """An int4 projection of 16 * 5 + 7 rows (a rest past the tile unit's blocks of 16) and 9
    groups (an odd count: amx.h pairs them), and inputs with a zero group, a group 1000 times
    the others, one of tiny values and one whose values span 2^20."""
    from glassformer.nn.quant import Int4Linear

    generator = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(288, 87, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(87, 288, generator=generator) * 0.05)
        linear.bias.copy_(torch.randn(87, generator=generator))
    module = Int4Linear.from_linear(linear)
    x = 3 * torch.randn(5, 288, generator=generator)
    x[0, :32] = 0.0
    x[1, 32:64] *= 1000.0
    x[2, 64:96] *= 1e-30
    x[3, 96:128] *= torch.logspace(0, -6, 32)  # 2^0 .. 2^-20
    return module, x


@pytest.mark.skipif(not kernels.build.has_amx(), reason="needs a CPU with the AMX tile unit")
def test_int4_products_on_the_tile_unit_are_as_close_to_float64_as_dot_q4s(int4_case, monkeypatch):
    # amx.h computes s * (q . x) + m * sum(x) with x in digits against each group's largest:
    # another order of the same sums, which must land as close to the exact (float64) products
    # of the file's weights scale * q + min as groups.h's float FMAs do.
    module, x = int4_case
    weight = module.dequantize().double()  # the fp32 FMA's rounding of scale * q + min
    exact = x.double() @ weight.T + module.bias.double()
    scale = x.double().abs() @ weight.abs().T  # sum |x| |w|: an fp32 sum's errors scale with it
    errors = {}
    for switch in ("avx512", "on"):
        got = _int4_products(switch, module, x, monkeypatch).double()
        errors[switch] = ((got - exact).abs() / scale).mean().item()
        assert ((got - exact).abs() <= 2.0**-20 * scale + 1e-6).all(), switch
    assert errors["on"] <= 1.5 * errors["avx512"], errors


@pytest.mark.skipif(not kernels.build.has_amx(), reason="needs a CPU with the AMX tile unit")
def test_int4_tile_unit_rows_are_bit_for_bit_each_row_alone(int4_case, monkeypatch):
    # two inputs share a tile of digits (and one is left alone after an odd count): each row's
    # integer sums and their float steps are the same as when it is the only input
    module, x = int4_case
    together = _int4_products("on", module, x, monkeypatch)
    for r in range(x.shape[0]):
        alone = _int4_products("on", module, x[r : r + 1], monkeypatch)
        assert torch.equal(together[r], alone[0]), r


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_int4_products_with_a_non_finite_input_are_not_finite(int4_case, bad, simd, monkeypatch):
    module, x = int4_case
    x = x[:2].clone()
    x[1, 200] = bad
    got = _int4_products(SWITCH_FOR[simd], module, x, monkeypatch)
    assert torch.isfinite(got[0]).all() and not torch.isfinite(got[1]).any()


def test_engine_decodes_the_same_tokens_with_and_without_it():
    model = _model("qwen3-qk-norm")
    fast, plain = Engine(model), Engine(model, fast=False)
    assert fast.fused is not None and plain.fused is None
    for params in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 3}):
        a = fast.generate([5, 9, 200], max_new_tokens=20, **params).token_ids
        b = plain.generate([5, 9, 200], max_new_tokens=20, **params).token_ids
        assert a == b


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"position": "alibi", "norm": "layer", "ffn": "gelu"}, "ALiBi"),
        ({**LLAMA, "sliding_window": 8}, "sliding window"),
        ({**LLAMA, "norm_position": "post"}, "post-norm"),
        ({**LLAMA, "ffn": "moe", "n_experts": 2, "n_experts_per_token": 1}, "MoE"),
        ({**LLAMA, "d_ff": 80}, "not a multiple of 32"),
    ],
)
def test_models_it_cannot_run_say_why_and_the_engine_uses_torch(change, reason):
    cfg = ModelConfig(vocab_size=300, d_model=64, n_layers=1, n_heads=4, max_seq_len=32,
                      **{"d_ff": 96, **change})  # fmt: skip
    model = build_model(cfg).eval()
    assert reason in unsupported(model)
    assert Engine(model).fused is None
    with pytest.raises(ValueError, match=reason):
        FusedStep(model)


def test_inspected_and_adapted_models_use_torch():
    from glassformer.nn.lora import apply_lora

    model = _model("llama-gqa")
    handle = model.blocks[0].register_forward_hook(lambda *args: None)
    assert "inspected" in unsupported(model)  # a hook anywhere
    handle.remove()
    assert unsupported(model) is None
    apply_lora(model, "q,v", rank=4)
    assert "merge adapters" in unsupported(model)


def test_a_cache_sharing_the_keys_memory_but_not_the_values_is_pointed_at_anew():
    # The step points its layers at a cache once and keeps that while the cache is the same
    # memory. A cache made after another was freed can take the keys' old address (and their
    # object's id) with its values elsewhere; the step must write and read the new values.
    model = _model("llama-gqa")
    step, first = FusedStep(model), model.new_cache(1, 48)
    step(7, 0, first)
    second = copy.copy(first)  # the same keys tensor, new values
    second.k, second.v = first.k, torch.zeros_like(first.v)
    first.v.zero_()
    step(7, 0, second)
    assert second.v[:, 0, :, 0].abs().sum() > 0 and first.v.abs().sum() == 0


def test_bad_positions_and_tokens_are_clear_errors():
    model = _model("llama-gqa")
    step, cache = FusedStep(model), model.new_cache(1, 48)
    with pytest.raises(ValueError, match="position 48 is outside"):
        step(1, 48, cache)
    with pytest.raises(ValueError, match="token id 300 is outside"):
        step(300, 0, cache)


# --- the C boundary -----------------------------------------------------------------------------


def test_the_ctypes_structs_are_checked_against_decode_c(monkeypatch):
    # decode.c reports each struct's size and each field's offset and size as its compiler laid
    # them out; a ctypes mirror with two fields swapped (in and out of a Linear, both int64)
    # would hand every matrix-vector product its sizes crossed, and is refused.
    step_h.check_layout(kernels.library())
    fields = list(step_h.Linear._fields_)
    i, o = fields.index(("in_", ctypes.c_int64)), fields.index(("out", ctypes.c_int64))
    fields[i], fields[o] = fields[o], fields[i]
    swapped = type("Linear", (ctypes.Structure,), {"_fields_": fields})
    monkeypatch.setattr(step_h, "Linear", swapped)
    with pytest.raises(RuntimeError, match=r"at Linear\.in: 8 bytes at offset 32 in C, 8 bytes at "
                       r"offset 40 in Python; make the _fields_ of Linear"):  # fmt: skip
        FusedStep(_model("llama-gqa"))


# --- a model that changes after the step is built -----------------------------------------------


def _greedy(engine, n: int = 12) -> list[int]:
    return engine.generate([5, 9, 200], max_new_tokens=n, temperature=0.0).token_ids


def _eager(model, n: int = 12) -> list[int]:
    """The reference: the torch modules only, on the model as it is now."""
    return _greedy(Engine(model, fast=False), n)


@pytest.fixture
def torch_steps(monkeypatch):
    """The fused step's calls that ran the torch modules instead of the C step (a list)."""
    calls, original = [], FusedStep._modules_step

    def counting(self, *args):
        calls.append(args)
        return original(self, *args)

    monkeypatch.setattr(FusedStep, "_modules_step", counting)
    return calls


def test_a_hook_added_after_the_engine_is_built_runs_on_every_step(torch_steps):
    model = _model("llama-gqa")
    engine = Engine(model)
    before = _greedy(engine)
    shift = torch.randn(model.cfg.d_model)
    handle = model.blocks[0].register_forward_hook(lambda module, args, out: out + shift)
    assert _greedy(engine) == _eager(model) != before
    assert len(torch_steps) == 12  # the prompt's and every decode step's: the C step would
    # run past the hook
    handle.remove()
    torch_steps.clear()
    assert _greedy(engine) == before and torch_steps == []  # the C step again


def test_generate_checks_the_model_once_and_a_block_until_recheck(torch_steps, monkeypatch):
    # No code of the caller's runs between generate's steps, so they check the model once
    # (FusedStep.unchanged); between two generates, each check sees a hook added. Inside a
    # block the caller vouches that nothing changes: a hook added there is looked for again
    # only after recheck(), and every call after the block checks.
    model = _model("llama-gqa")
    engine = Engine(model)
    checks, changed = [], FusedStep._changed
    monkeypatch.setattr(FusedStep, "_changed", lambda self: checks.append(1) or changed(self))
    before = _greedy(engine)
    assert len(checks) == 1  # the prompt's prefill and 11 decode steps
    shift = torch.randn(model.cfg.d_model)
    handle = model.blocks[0].register_forward_hook(lambda module, args, out: out + shift)
    assert _greedy(engine) == _eager(model) != before and len(torch_steps) == 12
    handle.remove()
    step, cache = engine.fused, model.new_cache(1, 16)
    torch_steps.clear()
    with torch.inference_mode():
        with step.unchanged():
            step(5, 0, cache)
            handle = model.blocks[0].register_forward_hook(lambda module, args, out: out + shift)
            step(6, 1, cache)
            assert torch_steps == []
            step.recheck()
            step(7, 2, cache)
            assert len(torch_steps) == 1  # the hook seen: the torch modules ran
        handle.remove()
        step(8, 3, cache)
    assert len(torch_steps) == 1  # after the block the call checks, and the hook is gone


def test_an_attention_capture_after_the_engine_is_built_records_every_step():
    model = _model("qwen3-qk-norm")
    engine = Engine(model)
    with capture(model, residual=False) as fast:
        tokens = _greedy(engine)
    with capture(model, residual=False) as eager:
        assert _eager(model) == tokens
    for layer in range(model.cfg.n_layers):
        calls, want = fast.attention.calls(layer), eager.attention.calls(layer)
        assert len(calls) == len(want) == 12  # the prefill, then each of the 11 decode steps
        for got, expected in zip(calls, want, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_an_adapter_added_after_the_engine_is_built_is_used_until_merged(torch_steps):
    model = _model("llama-gqa")
    engine = Engine(model)
    before = _greedy(engine)
    apply_lora(model, "q,v", rank=4)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0.0, 0.5)  # B starts at zero: a trained adapter changes the output
    adapted = _greedy(engine)
    assert adapted == _eager(model) != before and torch_steps
    merge_lora(model)  # plain Linears again, the update folded into their weights in place
    torch_steps.clear()
    assert _greedy(engine) == _eager(model) == adapted and torch_steps == []


@pytest.mark.parametrize("change", ["copy_", "data", "load_state_dict"])
def test_weights_changed_after_the_engine_is_built_are_read_again(change, torch_steps):
    # fp32 weights: the C step reads the model's own memory, so an in-place write shows at
    # once, but new storage (.data = ..., load_state_dict(assign=True)) must be followed.
    model, other = _model("gpt2"), _model("gpt2", seed=1)
    engine = Engine(model)
    before = _greedy(engine)
    with torch.no_grad():
        if change == "copy_":
            for p, q in zip(model.parameters(), other.parameters(), strict=True):
                p.copy_(q)
        elif change == "data":
            for p, q in zip(model.parameters(), other.parameters(), strict=True):
                p.data = q.detach().clone()
        else:
            model.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    assert _greedy(engine) == _eager(model) == _eager(other) != before
    assert torch_steps == []  # the C step, rebuilt on the new weights


def test_int4_weights_written_in_place_reach_the_tile_units_copy(simd):
    # With AMX the step reads int4 matrices from its own copy in the tile unit's order
    # (kernels.pack_q4_tiles): a write into the model's packed weights, scales or mins must
    # reach it, as it reaches dot_q4's reads of the model's own memory elsewhere.
    model = quantize_int4(_model("llama-gqa"))
    other = quantize_int4(_model("llama-gqa", seed=1))
    step, old = FusedStep(model), copy.deepcopy(model)
    assert (step._layers[0].up.packed is not None) == (simd == "amx")
    with torch.no_grad():
        for p, q in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
            p.copy_(q)
    assert _compare(old, step=step) > 0.1  # the write changed the logits...
    assert _compare(other, step=step) < 1e-4  # ...and the step built before it follows


def test_bf16_weights_written_in_place_reach_the_float32_copies():
    # The step reads a bf16 model's norm gains and biases from float32 copies it made: a write
    # to the model's own tensors must reach them (torch counts every in-place write).
    half = optimize_for_decode(_model("gpt2"), "bf16")
    step = FusedStep(half)
    old = copy.deepcopy(half).float()
    with torch.no_grad():
        for name, p in half.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    new = copy.deepcopy(half).float()
    assert _compare(old, step=step) > 0.1  # the write changed the logits...
    assert _compare(new, step=step) < 1e-4  # ...and the step built before it follows


@pytest.mark.parametrize("arch", ["gpt2", "relu-sinusoidal-mha"])
def test_a_cache_longer_than_the_position_table_raises_like_the_modules(arch):
    model = _model(arch)  # max_seq_len=48 rows in its position table
    step, cache = FusedStep(model), model.new_cache(1, 64)
    with torch.inference_mode():
        step(7, 47, cache)  # the table's last row
        with pytest.raises(ValueError, match="sequence of 49 tokens is longer") as fused_error:
            step.many([7, 8], 47, cache)
        with pytest.raises(ValueError) as torch_error:
            model(torch.tensor([[7, 8]]), torch.tensor([47, 48]), cache=model.new_cache(1, 64))
    assert str(fused_error.value) == str(torch_error.value)
