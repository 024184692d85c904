"""min_tokens (vLLM's) and logit_bias (OpenAI's) through every way of generating: the library
(Engine on the fused C step, Engine(fast=False), the compiled decoder's step, batches), the CLI
and a real `glassformer serve` driven by the official openai client.

References: transformers' generate with min_new_tokens on the same random Llama, the argmax of
transformers' own logits plus the bias computed step by step, a closed-form cut of the text for
stop strings, and the library's Engine for the server.
"""

from __future__ import annotations

import openai
import pytest
import torch
import transformers
from conftest import needs_kernels, tiny_llama_config
from serving import start_server, stop_server
from test_server import tiny_chat_model

import glassformer as gf
from glassformer.cli import main
from glassformer.infer.compiled import CompiledDecoder
from glassformer.infer.sampling import NO_EOS, SamplingParams
from glassformer.interop.pretrained import from_pretrained
from glassformer.templates import END_OF_TURN_TOKENS
from glassformer.tokenizers import CharTokenizer
from glassformer.train.checkpoint import save_checkpoint

VOCAB = 96
PROMPT = [5, 17, 42, 8, 63, 2, 29, 77]
N_NEW = 14
MIN_TOKENS = 6


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers model, the same weights loaded by glassformer): a tiny random Llama."""
    config = tiny_llama_config(VOCAB, bos_token_id=None, eos_token_id=None, initializer_range=0.2)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    model, _ = gf.from_pretrained(folder)
    return hf, model.eval()


ENGINES = {
    "fused": lambda model: gf.Engine(model),  # one row on the CPU: the fused C decode step
    "torch": lambda model: gf.Engine(model, fast=False),
    "compiled-step": lambda model: CompiledDecoder(model, compile=False),
}
# The fused step needs the C kernels: without them Engine(model) is the torch one again.
ENGINE_NAMES = [pytest.param("fused", marks=needs_kernels), "torch", "compiled-step"]


def hf_greedy(hf, prompt: list[int], n_new: int, ends: list[int] | None, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
            eos_token_id=ends, pad_token_id=0, **kwargs,
        )  # fmt: skip
    new = out[0, len(prompt) :].tolist()
    if ends:  # generate pads a finished row; keep what it generated, its end token included
        stop = next((i for i, t in enumerate(new) if t in ends), len(new) - 1)
        new = new[: stop + 1]
    return new


def early_ends(hf) -> tuple[int, int]:
    """Two tokens greedy decoding produces before MIN_TOKENS (an end-of-sequence id and a stop
    token id), so without min_tokens it would stop early."""
    free = hf_greedy(hf, PROMPT, N_NEW, None)
    eos = free[1]
    stop = next(t for t in free[2:MIN_TOKENS] if t != eos and t != free[0])
    return eos, stop


# --- min_tokens -------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_min_tokens_greedy_equals_transformers_min_new_tokens(llama, engine):
    hf, model = llama
    eos, stop = early_ends(hf)
    without = hf_greedy(hf, PROMPT, N_NEW, [eos, stop])
    assert len(without) < MIN_TOKENS and without[-1] in (eos, stop)  # it would stop early
    expected = hf_greedy(hf, PROMPT, N_NEW, [eos, stop], min_new_tokens=MIN_TOKENS)
    assert len(expected) > MIN_TOKENS and not {eos, stop} & set(expected[:MIN_TOKENS])
    if engine == "fused":
        assert ENGINES[engine](model).fused is not None, "the test must run the fused step"
    result = ENGINES[engine](model).generate(
        PROMPT, N_NEW, temperature=0.0, eos_token_id=eos, stop_token_ids=(stop,),
        min_tokens=MIN_TOKENS,
    )  # fmt: skip
    assert result.token_ids == expected
    plain = ENGINES[engine](model).generate(
        PROMPT, N_NEW, temperature=0.0, eos_token_id=eos, stop_token_ids=(stop,)
    )
    assert plain.token_ids == without


def test_min_tokens_holds_for_every_row_of_a_batch(llama):
    """Several rows decoded in one batched forward, each at its own count of tokens."""
    hf, model = llama
    eos, stop = early_ends(hf)
    prompts = [PROMPT, PROMPT[2:], PROMPT[:5]]
    results = gf.Engine(model).generate_batch(
        prompts, N_NEW, temperature=0.0, eos_token_id=eos, stop_token_ids=(stop,),
        min_tokens=MIN_TOKENS,
    )  # fmt: skip
    for prompt, result in zip(prompts, results, strict=True):
        expected = hf_greedy(hf, prompt, N_NEW, [eos, stop], min_new_tokens=MIN_TOKENS)
        assert result.token_ids == expected


def test_min_tokens_holds_when_sampling(llama):
    """At temperature 1 the banned end token is never drawn in the first min_tokens, however
    likely a bias makes it; right after them it is (bias +100)."""
    _, model = llama
    eos = 11
    for seed in range(3):
        result = gf.Engine(model).generate(
            PROMPT, N_NEW, temperature=1.0, seed=seed, eos_token_id=eos, min_tokens=4,
            logit_bias={eos: 100},
        )  # fmt: skip
        assert eos not in result.token_ids[:4]
        assert result.token_ids[4:] == [eos] and result.stats.stop_reason == "eos"


# --- logit_bias -------------------------------------------------------------------------------


def biased_argmax_run(hf, prompt: list[int], n_new: int, bias: dict[int, float]) -> list[int]:
    """Greedy decoding by hand: transformers' logits over the whole context at every step (no
    cache), the bias added, the argmax taken."""
    offset = torch.zeros(VOCAB)
    for token, value in bias.items():
        offset[token] = value
    context, new = list(prompt), []
    with torch.no_grad():
        for _ in range(n_new):
            logits = hf(torch.tensor([context])).logits[0, -1] + offset
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > 1e-3, "a near-tie would make the reference fragile"
            new.append(int(logits.argmax()))
            context.append(new[-1])
    return new


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_logit_bias_greedy_is_the_argmax_of_biased_logits(llama, engine):
    hf, model = llama
    free = hf_greedy(hf, PROMPT, N_NEW, None)
    bias = {free[0]: -4.0, free[3]: -2.5, 7: 1.5, 50: 2.0}
    expected = biased_argmax_run(hf, PROMPT, N_NEW, bias)
    assert expected != free  # the bias changes the run, so the test can fail
    result = ENGINES[engine](model).generate(
        PROMPT, N_NEW, temperature=0.0, eos_token_id=NO_EOS, logit_bias=bias
    )
    assert result.token_ids == expected


def test_a_large_positive_bias_forces_the_token_and_minus_100_bans_one(llama):
    _, model = llama
    forced = gf.Engine(model).generate(
        PROMPT, 8, temperature=1.0, seed=0, eos_token_id=NO_EOS, logit_bias={33: 100}
    )
    assert forced.token_ids == [33] * 8
    free = gf.Engine(model).generate(PROMPT, 8, temperature=0.0, eos_token_id=NO_EOS).token_ids
    banned = gf.Engine(model).generate(
        PROMPT, 8, temperature=0.0, eos_token_id=NO_EOS, logit_bias={free[0]: -100}
    )
    assert free[0] not in banned.token_ids
    rows = gf.Engine(model).generate_batch(
        [PROMPT, PROMPT[:3]], 5, temperature=0.7, seed=1, eos_token_id=NO_EOS,
        logit_bias={90: 100},
    )  # fmt: skip
    assert [row.token_ids for row in rows] == [[90] * 5, [90] * 5]


def test_logprobs_are_those_of_the_biased_distribution(llama):
    """The documented choice (rows.py): logprobs after the processors, so a greedy pick is the
    top candidate and a banned end token is never listed."""
    hf, model = llama
    bias = {7: 3.0}
    eos = hf_greedy(hf, PROMPT, 2, None)[0]
    row = gf.Engine(model).add(
        PROMPT, SamplingParams(temperature=0.0, max_new_tokens=3, eos_token_id=eos,
                               min_tokens=3, logit_bias=bias, logprobs=VOCAB)
    )  # fmt: skip
    first = row.logprobs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0, -1]
    logits[7] += 3.0
    logits[eos] = float("-inf")
    expected = torch.log_softmax(logits, dim=-1)
    assert first.token_id == first.top[0][0] == int(expected.argmax())
    assert first.logprob == pytest.approx(float(expected.max()), abs=1e-4)
    assert len(first.top) == VOCAB - 1 and eos not in {t for t, _ in first.top}


# --- the rules, as one-line errors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"min_tokens": 9, "max_new_tokens": 8}, "min_tokens=9 exceeds max_new_tokens=8"),
        ({"min_tokens": -1}, "min_tokens=-1"),
        ({"min_tokens": True}, "min_tokens=True"),
        ({"logit_bias": {5: 101}}, r"token 5 the bias 101: use a number in \[-100, 100\]"),
        ({"logit_bias": {5: float("nan")}}, "token 5 the bias nan"),
        ({"logit_bias": {5: True}}, "token 5 the bias True"),
        ({"logit_bias": {-1: 1.0}}, "key -1 is not a token id"),
        ({"logit_bias": {"5": 1.0}}, "key '5' is not a token id"),
        ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "token 5 two biases"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "301 entries: at most 300"),
        ({"logit_bias": 5}, "give a mapping from token id to bias"),
    ],
)
def test_sampling_params_refuse_bad_min_tokens_and_logit_bias(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


def test_a_logit_bias_id_outside_the_vocabulary_names_it_and_the_size(llama):
    _, model = llama
    with pytest.raises(ValueError, match=f"token {VOCAB}, outside the vocabulary of {VOCAB}"):
        gf.Engine(model).generate(PROMPT, 2, logit_bias={VOCAB: 1.0})


# --- stop strings and the CLI -----------------------------------------------------------------

CHARS = "abcdefghijklmnopqrstuvwxyz ,.!"


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """A tiny GPT over single characters, saved as a checkpoint for the CLI."""
    tokenizer = CharTokenizer.from_text(CHARS)
    cfg = gf.ModelConfig(
        vocab_size=tokenizer.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        max_seq_len=64, position="rope", norm="rms", ffn="swiglu",
    )  # fmt: skip
    torch.manual_seed(3)
    model = gf.build_model(cfg).eval()
    folder = tmp_path_factory.mktemp("chars")
    save_checkpoint(folder, 0, model, model.cfg, tokenizer)
    return folder, model, tokenizer


def early_repeat(text: str) -> tuple[str, int]:
    """A character of `text` and a count m such that it occurs within the first m characters
    and again after them."""
    for m in range(2, len(text) - 1):
        for char in text[:m]:
            if char in text[m:]:
                return char, m
    raise AssertionError(f"no character repeats in {text!r}")


def test_stop_strings_match_only_after_min_tokens(char_model, capsys):
    folder, model, tokenizer = char_model
    prompt = "to be or"
    engine = gf.Engine(gf.optimize_for_decode(model), tokenizer=tokenizer)
    free = tokenizer.decode(engine.generate(tokenizer.encode(prompt), 20, 0.0).token_ids)
    stop, m = early_repeat(free)
    # Each token is one character: the first m are kept whole, the stop is searched after them.
    expected = free[:m] + free[m:][: free[m:].index(stop)]
    row = engine.add(
        tokenizer.encode(prompt),
        SamplingParams(temperature=0.0, max_new_tokens=20, stop=(stop,), min_tokens=m),
    )
    list(engine.follow(row))
    assert row.text == expected and row.stop_reason == "stop"
    plain = engine.add(
        tokenizer.encode(prompt), SamplingParams(temperature=0.0, max_new_tokens=20, stop=(stop,))
    )
    list(engine.follow(plain))
    assert plain.text == free[: free.index(stop)] != expected
    # The CLI prints by the same rule.
    args = ["generate", "--model", str(folder), prompt, "--temperature", "0",
            "--max-new-tokens", "20", "--stop", stop]  # fmt: skip
    assert main([*args, "--min-tokens", str(m)]) == 0
    assert capsys.readouterr().out == prompt + expected + "\n"


def test_cli_logit_bias_flags_force_and_ban_tokens(char_model, capsys):
    folder, _, tokenizer = char_model
    x, y = tokenizer.encode("x")[0], tokenizer.encode("y")[0]
    base = ["generate", "--model", str(folder), "to be", "--max-new-tokens", "6"]
    assert main([*base, "--logit-bias", f"{x}=100"]) == 0
    assert capsys.readouterr().out == "to be" + "x" * 6 + "\n"
    # Comma-separated and repeated entries make one set: x banned, y forced.
    assert main([*base, "--temperature", "0", "--logit-bias", f"{x}=-100,{y}=50",
                 "--logit-bias", f"{y}=100"]) == 2  # fmt: skip
    assert f"token {y} two biases" in capsys.readouterr().err
    assert main([*base, "--temperature", "0", "--logit-bias", f"{x}=-100",
                 "--logit-bias", f"{y}=100"]) == 0  # fmt: skip
    assert capsys.readouterr().out == "to be" + "y" * 6 + "\n"


def test_cli_a_malformed_logit_bias_is_a_usage_error(char_model, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["generate", "--model", str(char_model[0]), "to be", "--logit-bias", "5:100"])
    assert caught.value.code == 2
    assert "'5:100' is not ID=BIAS" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--logit-bias", "5=200"], "token 5 the bias 200.0"),
        (["--logit-bias", "99=1"], "token 99, outside the vocabulary"),
        (["--min-tokens", "9", "--max-new-tokens", "4"], "min_tokens=9 exceeds max_new_tokens=4"),
    ],
)
def test_cli_bad_sampling_controls_are_one_clear_line(char_model, capsys, flags, message):
    folder = char_model[0]
    assert main(["generate", "--model", str(folder), "to be", *flags]) == 2
    assert message in capsys.readouterr().err


# --- the server, through the official client --------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tiny_chat_model(tmp_path_factory.mktemp("served") / "tinychat")
    process, url = start_server(["--model", str(folder), "--max-batch", "4"])
    model, tokenizer = from_pretrained(folder)
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none"), model, tokenizer
    stop_server(process)


def server_stops(tokenizer) -> tuple[int, ...]:
    ids = {tokenizer.eos_token_id} | {tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS}
    return tuple(sorted(i for i in ids if i is not None))


def test_server_min_tokens_and_logit_bias_match_the_library(served):
    """The end token biased +100 ends the reply at once; with min_tokens=3 it cannot come
    before 3 tokens, and then does: the same tokens as Engine.generate with the same fields."""
    client, model, tokenizer = served
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode("The cat sat on the")
    kwargs = dict(model="tinychat", prompt=prompt, temperature=0, max_tokens=6,
                  logit_bias={str(eos): 100})  # fmt: skip
    at_once = client.completions.create(**kwargs)
    assert (at_once.choices[0].text, at_once.usage.completion_tokens) == ("", 1)
    held = client.completions.create(**kwargs, extra_body={"min_tokens": 3})
    expected = gf.Engine(model).generate(
        prompt, 6, temperature=0.0, eos_token_id=eos, stop_token_ids=server_stops(tokenizer),
        min_tokens=3, logit_bias={eos: 100},
    )  # fmt: skip
    assert len(expected.token_ids) == 4 and expected.token_ids[-1] == eos
    assert held.choices[0].text == tokenizer.decode(expected.token_ids[:-1])
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4


def test_server_chat_logit_bias_forces_a_token(served):
    client, _, tokenizer = served
    token = tokenizer.encode(" cat")[-1]
    reply = client.chat.completions.create(
        model="tinychat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        logit_bias={str(token): 100}, seed=0,
    )  # fmt: skip
    assert reply.choices[0].message.content == tokenizer.decode([token] * 4)
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"logit_bias": {"5": 101}}, "logit_bias", ["101", "[-100, 100]"]),
        ({"logit_bias": {"5": "high"}}, "logit_bias", ["'high'"]),
        ({"logit_bias": {"five": 1}}, "logit_bias", ["'five'", "token id"]),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", ["301", "300"]),
        ({"logit_bias": {"49152": 1}}, "logit_bias", ["49152", "0..49151"]),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens", ["min_tokens=5", "max_tokens=3"]),
        ({"min_tokens": -1}, "min_tokens", ["min_tokens"]),
    ],
)
def test_server_refuses_bad_values_naming_the_param(served, fields, param, words):
    client = served[0]
    body = {"max_tokens": 4, **fields}
    logit_bias = body.pop("logit_bias", openai.NOT_GIVEN)
    max_tokens = body.pop("max_tokens")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tinychat", messages=[{"role": "user", "content": "Hi"}],
            max_tokens=max_tokens, logit_bias=logit_bias, extra_body=body,
        )  # fmt: skip
    error = caught.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert all(word in error["message"] for word in words), error["message"]


def test_server_stop_strings_wait_for_min_tokens_streamed_and_not(served):
    """A stop string met in the first min_tokens tokens does not cut the reply: the server's
    text (streamed and not) equals the library row's, which stopped later."""
    client, model, tokenizer = served
    prompt = tokenizer.encode("The cat sat on the")
    engine = gf.Engine(model, tokenizer=tokenizer)
    free = engine.generate(prompt, 12, temperature=0.0, eos_token_id=NO_EOS).token_ids
    text = tokenizer.decode(free)
    stop = next(c for c in text[1:] if c.strip())  # a character the free text holds
    params = dict(temperature=0.0, max_new_tokens=12, stop=(stop,), eos_token_id=NO_EOS)
    plain, held = (engine.add(prompt, SamplingParams(**params, min_tokens=m)) for m in (0, 8))
    list(engine.follow(plain)), list(engine.follow(held))
    assert len(held.text) > len(plain.text)  # min_tokens made a difference
    body = dict(model="tinychat", prompt=prompt, temperature=0, max_tokens=12, stop=[stop],
                extra_body={"min_tokens": 8, "ignore_eos": True})  # fmt: skip
    assert client.completions.create(**body).choices[0].text == held.text
    streamed = client.completions.create(**body, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == held.text
