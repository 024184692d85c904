"""CompiledDecoder (seed 000 §2.5.1) against the eager model and Engine: the static-cache step
(every key slot attended, unfilled ones masked) must compute what the growing cache does."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import glassformer as gf
from glassformer import kernels
from glassformer.infer.compiled import CompiledDecoder, capacity_for
from glassformer.nn.quant import quantize_int8

# A vocabulary of 64 (token 63 below), widths of 64, and room for capacities of 256 and up.
SIZES = dict(vocab_size=64, d_model=64, max_seq_len=512)
PROMPT = [3, 14, 15, 9, 2, 6]


def eager_step_logits(model, prompt: list[int], continuation: list[int]) -> list[torch.Tensor]:
    """The eager model's next-token logits after the prompt and after each fed token."""
    cache = model.new_cache(batch_size=1, max_seq_len=len(prompt) + len(continuation))
    with torch.no_grad():
        at = torch.arange(len(prompt))
        logits = [model(torch.tensor([prompt]), at, cache=cache, last_token_only=True)[:, -1]]
        for position, token in enumerate(continuation, start=len(prompt)):
            at = torch.tensor([position])
            step = model(torch.tensor([[token]]), at, cache=cache, last_token_only=True)
            logits.append(step[:, -1])
    return logits


def decoder_step_logits(decoder, prompt: list[int], continuation: list[int]) -> list[torch.Tensor]:
    """The decoder's logits: the prompt through the model eagerly, then one (compiled) step per
    token, over the decoder's static cache."""
    decoder.reserve(1, len(prompt) + len(continuation))
    cache = decoder.cache
    with torch.inference_mode():
        logits = [decoder.forward(torch.tensor([prompt]), torch.arange(len(prompt)), cache)]
        for i, token in enumerate(continuation):
            position = torch.tensor([len(prompt) + i])
            logits.append(decoder.compiled_forward(torch.tensor([[token]]), position, cache))
    return logits


def assert_same_logits(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Each step's logits equal up to fp32 rounding at their own scale: a compiled graph's
    loops sum in their own order (on an AVX2-only AMD EPYC the int8 step differed by up to
    1.8e-4 in logits as large as 19, 1e-5 of them), so the absolute tolerance is 1e-4 of the
    step's largest logit; a wrong operation moves them by far more."""
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        atol = 1e-4 * b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=atol, msg=f"step {step}")


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"position": "learned", "norm": "layer", "ffn": "gelu", "n_kv_heads": 4},
        {"position": "alibi"},
        {"sliding_window": 4},
    ],
    ids=["llama", "gpt2", "alibi", "sliding"],
)
def test_static_step_equals_eager_model(overrides):
    """compile=False: the same step, eagerly, so every config runs in well under a second."""
    model = tiny_model(**SIZES, **overrides)
    continuation = [5, 7, 1, 0, 63, 8, 8, 2]
    expected = eager_step_logits(model, PROMPT, continuation)
    got = decoder_step_logits(CompiledDecoder(model, compile=False), PROMPT, continuation)
    assert_same_logits(got, expected)


@pytest.mark.parametrize("quantize", [False, True], ids=["fp32", "int8"])
def test_greedy_tokens_equal_engine_uncompiled(quantize):
    model = tiny_model(**SIZES)
    if quantize:
        model = quantize_int8(model)
    expected = gf.Engine(model).generate(PROMPT, max_new_tokens=24, temperature=0.0)
    result = CompiledDecoder(model, compile=False).generate(PROMPT, 24, temperature=0.0)
    assert result.token_ids == expected.token_ids
    assert result.stats.generated_tokens == 24 and result.stats.stop_reason == "max_new_tokens"


def test_sampling_with_a_seed_equals_engine():
    model = tiny_model(**SIZES)
    kwargs = dict(max_new_tokens=16, temperature=0.8, top_k=20, seed=3)
    expected = gf.Engine(model).generate(PROMPT, **kwargs).token_ids
    assert CompiledDecoder(model, compile=False).generate(PROMPT, **kwargs).token_ids == expected


def test_capacity_comes_in_powers_of_two_within_the_context():
    assert [capacity_for(n, 4096) for n in (1, 256, 257, 1000)] == [256, 256, 512, 1024]
    assert capacity_for(300, 300) == 300


def test_context_full_stops_like_engine():
    model = tiny_model(**SIZES | {"max_seq_len": 12})
    result = CompiledDecoder(model, compile=False).generate(PROMPT, 40, temperature=0.0)
    assert result.stats.stop_reason == "context_full" and len(result.token_ids) == 12 - 6 + 1


def test_unsupported_models_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="moe"):
        CompiledDecoder(
            tiny_model(**SIZES, ffn="moe", n_experts=4, n_experts_per_token=2), compile=False
        )


def test_matvec_operator_equals_matvec():
    x, weight = torch.randn(1, 1, 64), torch.randn(96, 64)
    q, scales = torch.randint(-127, 128, (96, 64), dtype=torch.int8), torch.rand(96, 2)
    torch.testing.assert_close(kernels.matvec_op(x, weight, None), kernels.matvec(x, weight))
    torch.testing.assert_close(kernels.matvec_op(x, q, scales), kernels.matvec(x, q, scales))


@pytest.mark.slow
def test_compiled_int8_decoder_matches_eager_and_engine():
    """The real thing: one fullgraph compile (~10 s on a tiny model), the C kernel inside as the
    glassformer::matvec operator, reused across generations with no recompile."""
    torch._dynamo.reset()
    model = quantize_int8(tiny_model(**SIZES))
    decoder = CompiledDecoder(model)
    continuation = [5, 7, 1, 0, 63, 8, 8, 2]
    expected = eager_step_logits(model, PROMPT, continuation)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = decoder_step_logits(decoder, PROMPT, continuation)
        assert_same_logits(got, expected)
        engine = gf.Engine(model).generate(PROMPT, max_new_tokens=24, temperature=0.0)
        for prompt in (PROMPT, PROMPT[:2]):  # a second generation reuses the graph
            result = decoder.generate(prompt, max_new_tokens=24, temperature=0.0)
            if prompt == PROMPT:
                assert result.token_ids == engine.token_ids
