"""Batched generation (issues 5 and 13): every row of Engine.generate_batch must equal generating
its prompt alone with Engine.generate, whose own reference is a full recompute
(tests/test_engine.py). The model-level left-padding path (position_ids + padding_mask) is
checked against unpadded forwards too."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import glassformer as gf
from glassformer.cli import main
from glassformer.tokenizers import CharTokenizer
from glassformer.train.checkpoint import save_checkpoint

PROMPTS = [[3, 14, 15, 9, 2, 6], [1], [7, 7, 8, 20, 21, 22, 23, 24, 25, 26], [30, 2, 5]]


def alone(engine: gf.Engine, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    return [engine.generate(prompt, **kwargs).token_ids for prompt in prompts]


@pytest.mark.parametrize(
    "overrides",
    [
        {"position": "rope"},  # GQA: 4 query heads share 2 key/value heads
        {"position": "rope", "n_kv_heads": 1},  # MQA
        {"position": "learned", "n_kv_heads": 4, "norm": "layer", "ffn": "gelu"},  # GPT-2 style
        {"position": "sinusoidal"},
        {"position": "alibi"},
        {"position": "rope", "sliding_window": 5},
        {"position": "learned", "attention_backend": "eager"},
    ],
    ids=["rope-gqa", "rope-mqa", "learned-mha", "sinusoidal", "alibi", "window", "eager"],
)
def test_greedy_batch_equals_each_prompt_alone(overrides):
    engine = gf.Engine(tiny_model(**overrides))
    results = engine.generate_batch(PROMPTS, max_new_tokens=12, temperature=0.0)
    expected = alone(engine, PROMPTS, max_new_tokens=12, temperature=0.0)
    assert [r.token_ids for r in results] == expected
    assert [r.stats.prompt_tokens for r in results] == [len(p) for p in PROMPTS]
    assert all(r.stats.stop_reason == "max_new_tokens" for r in results)


@pytest.mark.parametrize("position", ["rope", "learned", "alibi"])
def test_left_padding_does_not_change_the_logits(position):
    """The reference is each prompt's forward pass without padding, on a model with its init
    weights (small logits, so 1e-5 is tight): every real position after prefill, and one
    decode step through the cache."""
    model = tiny_model(scale=1.0, position=position)
    T = max(len(p) for p in PROMPTS)
    ids = torch.zeros(len(PROMPTS), T, dtype=torch.long)
    mask = torch.zeros(len(PROMPTS), T + 1, dtype=torch.bool)
    positions = torch.zeros(len(PROMPTS), T, dtype=torch.long)
    for b, prompt in enumerate(PROMPTS):
        ids[b, T - len(prompt) :] = torch.tensor(prompt)
        mask[b, T - len(prompt) :] = True
        positions[b, T - len(prompt) :] = torch.arange(len(prompt))
    next_token = torch.tensor([[5]] * len(PROMPTS))
    next_position = torch.tensor([[len(p)] for p in PROMPTS])
    with torch.no_grad():
        cache = model.new_cache(batch_size=len(PROMPTS), max_seq_len=T + 1)
        slots = torch.arange(T)  # where the cache stores them; position_ids: what RoPE sees
        prefill = model(ids, slots, position_ids=positions, padding_mask=mask[:, :T], cache=cache)
        step = model(next_token, torch.tensor([T]), position_ids=next_position, padding_mask=mask,
                     cache=cache)  # fmt: skip
        for b, prompt in enumerate(PROMPTS):
            reference = model(torch.tensor([[*prompt, 5]]))[0]  # (len + 1, V)
            torch.testing.assert_close(
                prefill[b, T - len(prompt) :], reference[:-1], atol=1e-5, rtol=0
            )
            torch.testing.assert_close(step[b, 0], reference[-1], atol=1e-5, rtol=0)


def test_eos_stops_only_its_row_and_stats_are_per_row_or_shared():
    model = tiny_model()
    engine = gf.Engine(model)
    greedy = engine.generate_batch(PROMPTS, max_new_tokens=10, temperature=0.0)
    tokens = [r.token_ids for r in greedy]
    # An id row 1 produces early and rows 0 and 3 never do: only row 1 (and maybe row 2) stops.
    eos = next(t for t in tokens[1][1:6] if t not in tokens[0] + tokens[3])
    results = engine.generate_batch(PROMPTS, max_new_tokens=10, temperature=0.0, eos_token_id=eos)
    assert [r.token_ids for r in results] == alone(
        engine, PROMPTS, max_new_tokens=10, temperature=0.0, eos_token_id=eos
    )
    stopped = results[1]
    assert stopped.token_ids == tokens[1][: tokens[1].index(eos) + 1]
    assert stopped.stats.stop_reason == "eos"
    assert results[0].token_ids == tokens[0] and results[0].stats.stop_reason == "max_new_tokens"
    assert [r.stats.generated_tokens for r in results] == [len(r.token_ids) for r in results]

    # Each row's statistics are its own: its slot holds its prompt and its tokens but the last.
    cfg = model.cfg
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # fp32
    for prompt, result in zip(PROMPTS, results, strict=True):
        stats = result.stats
        assert stats.batch_size == 4
        assert stats.kv_cache_bytes == per_token * (len(prompt) + len(result.token_ids) - 1)
        decode_time = stats.total_time_s - stats.time_to_first_token_s
        if len(result.token_ids) > 1:
            assert stats.decode_tokens_per_s == pytest.approx(
                (len(result.token_ids) - 1) / decode_time, rel=0.05
            )


def test_batch_of_one_equals_generate_also_when_sampling():
    engine = gf.Engine(tiny_model(scale=1.0))
    kwargs = dict(max_new_tokens=12, temperature=0.9, top_k=10, seed=7)
    (result,) = engine.generate_batch([PROMPTS[0]], **kwargs)
    single = engine.generate(PROMPTS[0], **kwargs)
    assert result.token_ids == single.token_ids
    assert result.stats.kv_cache_bytes == single.stats.kv_cache_bytes
    assert result.stats.stop_reason == single.stats.stop_reason == "max_new_tokens"


def test_rows_sample_independently_and_a_seed_repeats_the_batch():
    engine = gf.Engine(tiny_model(scale=1.0))  # init weights: near-uniform distributions
    prompts = [[4, 5, 6]] * 3
    first = engine.generate_batch(prompts, max_new_tokens=12, temperature=1.0, seed=3)
    again = engine.generate_batch(prompts, max_new_tokens=12, temperature=1.0, seed=3)
    rows = [r.token_ids for r in first]
    assert rows == [r.token_ids for r in again]
    assert len({tuple(row) for row in rows}) == 3  # same prompt, three different draws


def test_caches_of_different_batch_sizes_do_not_mix():
    engine = gf.Engine(tiny_model())
    before = engine.generate(PROMPTS[2], max_new_tokens=8, temperature=0.0).token_ids
    engine.generate_batch(PROMPTS, max_new_tokens=8, temperature=0.0)
    pair = engine.generate_batch(PROMPTS[:2], max_new_tokens=8, temperature=0.0)
    assert [r.token_ids for r in pair] == alone(
        engine, PROMPTS[:2], max_new_tokens=8, temperature=0
    )
    assert engine.generate(PROMPTS[2], max_new_tokens=8, temperature=0.0).token_ids == before


def test_a_full_window_stops_each_row_where_it_would_alone():
    model = tiny_model(position="learned")
    long_prompt = [i % 37 for i in range(40)]
    results = gf.Engine(model).generate_batch(
        [long_prompt, [1, 2]], max_new_tokens=100, temperature=0.0
    )
    # Each row has its own window (test_engine: prompt + n == L + 1 when the window fills).
    L = model.cfg.max_seq_len
    assert 40 + len(results[0].token_ids) == L + 1
    assert 2 + len(results[1].token_ids) == L + 1
    assert {r.stats.stop_reason for r in results} == {"context_full"}
    assert [r.token_ids for r in results] == alone(
        gf.Engine(model), [long_prompt, [1, 2]], max_new_tokens=100, temperature=0.0
    )


@pytest.mark.parametrize("cell", ["rnn", "lstm", "gru"])
def test_rnn_rows_batch_and_equal_each_prompt_alone(cell):
    """A recurrent state has no positions: each row's slot holds its own hidden state."""
    torch.manual_seed(0)
    cfg = gf.ModelConfig(family="rnn", cell=cell, vocab_size=37, d_model=16, n_layers=2)
    engine = gf.Engine(gf.build_model(cfg).eval())
    results = engine.generate_batch(PROMPTS, max_new_tokens=6, temperature=0.0)
    assert [r.token_ids for r in results] == alone(engine, PROMPTS, max_new_tokens=6, temperature=0)
    assert all(r.stats.batch_size == 4 for r in results)


@pytest.mark.parametrize(
    ("prompts", "kwargs", "match"),
    [
        ([], {}, "prompts is empty"),
        ([1, 2, 3], {}, "one flat list of token ids"),
        ("some text", {}, "encode text"),
        ([[1, 2], "hi"], {}, "prompt 2 of 2: got text"),
        ([[1, 2], []], {}, "prompt 2 of 2: the prompt is empty"),
        ([[1, 99], [1]], {}, "prompt 1 of 2: token id 99 is outside the vocabulary"),
        ([[1], [2], list(range(30)) * 2], {}, "prompt 3 of 3: .*max_seq_len=48"),
        ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens"),
        ([[1, 2]], {"temperature": -1.0}, "temperature"),
        ([[1, 2]], {"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_input_gives_a_clear_error(prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gf.Engine(tiny_model()).generate_batch(prompts, **kwargs)


def test_cli_generates_several_prompts_as_one_batch(tmp_path, capsys):
    text = "abcdefghijklmnopqrstuvwxyz ,.!"
    tokenizer = CharTokenizer.from_text(text)
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    save_checkpoint(tmp_path, 0, model, model.cfg, tokenizer)
    prompts = ["to be or", "a", "not to be, that is"]
    code = main(
        ["generate", "--model", str(tmp_path), *prompts, "--temperature", "0",
         "--max-new-tokens", "7", "--stats"]
    )  # fmt: skip
    assert code == 0
    out, err = capsys.readouterr()
    engine = gf.Engine(model)
    expected = [
        prompt + tokenizer.decode(engine.generate(tokenizer.encode(prompt), 7, 0.0).token_ids)
        for prompt in prompts
    ]
    assert out.splitlines() == [f"[{i}] {text}" for i, text in enumerate(expected, start=1)]
    assert "batch of 3" in err and "tok/s" in err


@pytest.mark.slow
def test_smollm2_batch_equals_each_prompt_alone():
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    prompts = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        "def fibonacci(n):",
    ]
    ids = [tokenizer.encode(prompt) for prompt in prompts]
    assert len({len(row) for row in ids}) == 3  # really different lengths, really padded
    engine = gf.Engine(model)
    results = engine.generate_batch(ids, max_new_tokens=20, temperature=0.0)
    assert [r.token_ids for r in results] == alone(engine, ids, max_new_tokens=20, temperature=0)


def test_cli_sampling_flags_reach_every_row(tmp_path, capsys):
    """--stop cuts each row's text at its stop string (OpenAI's convention); --min-p and
    --repetition-penalty give what the Engine gives with the same SamplingParams fields (on the
    decode kernels, as the CLI runs the model)."""
    text = "abcdefghijklmnopqrstuvwxyz ,.!"
    tokenizer = CharTokenizer.from_text(text)
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    save_checkpoint(tmp_path, 0, model, model.cfg, tokenizer)
    prompts = ["to be or", "not to be"]
    engine = gf.Engine(gf.optimize_for_decode(model), tokenizer=tokenizer)
    free = [tokenizer.decode(engine.generate(tokenizer.encode(p), 12, temperature=0.0).token_ids)
            for p in prompts]  # fmt: skip
    stop = free[0][3:5]
    base = ["generate", "--model", str(tmp_path), *prompts, "--temperature", "0",
            "--max-new-tokens", "12"]  # fmt: skip
    assert main([*base, "--stop", stop]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"[1] {prompts[0]}{free[0][: free[0].index(stop)] + stop}"
    for flags, fields in (
        (["--min-p", "0.3", "--temperature", "1", "--seed", "3"],
         {"min_p": 0.3, "temperature": 1.0, "seed": 3}),
        (["--repetition-penalty", "3.0", "--temperature", "0"], {"repetition_penalty": 3.0}),
    ):  # fmt: skip
        assert main([*base[:3], prompts[0], "--max-new-tokens", "12", *flags]) == 0
        out = capsys.readouterr().out
        ids = tokenizer.encode(prompts[0])
        expected = engine.generate(ids, 12, **{"temperature": 0.0, **fields}).token_ids
        assert expected != engine.generate(ids, 12, temperature=fields.get("temperature", 0.0),
                                           seed=fields.get("seed")).token_ids  # fmt: skip
        assert out == prompts[0] + tokenizer.decode(expected) + "\n"
