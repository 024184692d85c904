"""Continuous batching (issue 13): rows join the Engine between steps, each at its own
position with its own sampling parameters, and leave when they stop. The reference for every
row is a cache-less recompute of that row alone (the whole sequence through the model at each
step), sampled with the same sampler and a generator seeded the same way."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import glassformer as gf
from glassformer.infer.sampling import NO_EOS, SamplingParams, make_generator, sample
from glassformer.tokenizers import CharTokenizer


def recompute(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """The row alone, without any cache: every step runs the whole sequence again."""
    generator = make_generator(params.seed)
    ids, new = list(prompt), []
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            logits = model(torch.tensor([ids]))[:, -1]  # (1, V)
            token = int(sample(logits, params, generator))
            new.append(token)
            ids.append(token)
    return new


PROMPTS = [[3, 14, 15, 9, 2, 6], [1], [7, 7, 8, 20, 21, 22, 23, 24, 25, 26, 5], [30, 2, 5]]
# (step at which the row joins, its sampling parameters): greedy and seeded rows side by side,
# each with its own max_new_tokens, so rows also leave at different steps.
SCHEDULE = [
    (0, SamplingParams(temperature=0.0, max_new_tokens=14, eos_token_id=NO_EOS)),
    (3, SamplingParams(temperature=0.9, top_k=12, seed=11, max_new_tokens=9, eos_token_id=NO_EOS)),
    (3, SamplingParams(temperature=0.0, max_new_tokens=12, eos_token_id=NO_EOS)),
    (7, SamplingParams(temperature=1.1, top_p=0.9, seed=5, max_new_tokens=10, eos_token_id=NO_EOS)),
]


def run_schedule(engine: gf.Engine) -> list[list[int]]:
    rows, step = [None] * len(PROMPTS), 0
    while any(row is None or not row.finished for row in rows):
        for i, (join_at, params) in enumerate(SCHEDULE):
            if join_at == step:
                rows[i] = engine.add(PROMPTS[i], params)
        engine.step()
        step += 1
    return [row.tokens for row in rows]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"position": "learned", "norm": "layer", "ffn": "gelu", "n_kv_heads": 4},
        {"position": "alibi"},
        {"sliding_window": 5},  # the ring cache, each row at its own slot p % W
        {"position": "learned", "attention_backend": "eager"},
    ],
    ids=["rope-gqa", "learned", "alibi", "ring", "eager"],
)
def test_rows_joining_mid_generation_produce_what_they_produce_alone(overrides):
    model = tiny_model(**overrides)
    got = run_schedule(gf.Engine(model, max_rows=4))
    for i, (_, params) in enumerate(SCHEDULE):
        assert got[i] == recompute(model, PROMPTS[i], params), f"row {i}"


def test_greedy_rows_with_processors_sample_alone_beside_plain_greedy_rows():
    # A step takes its plain greedy rows' tokens from one argmax over the batch; a greedy row
    # with a logit bias, a repetition penalty or a min_tokens ban is not plain and keeps its
    # own sampling: each row's tokens are those it gets alone.
    model = tiny_model()
    base = dict(temperature=0.0, max_new_tokens=8, eos_token_id=NO_EOS)
    params = [
        SamplingParams(**base),
        SamplingParams(**base, logit_bias={5: 100.0}),
        SamplingParams(**base),
        SamplingParams(**base, repetition_penalty=1.8),
        SamplingParams(**{**base, "eos_token_id": 4}, min_tokens=6),
    ]
    prompts = [*PROMPTS, [9, 4]]
    engine = gf.Engine(model, max_rows=5)
    rows = [engine.add(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    while not all(row.finished for row in rows):
        engine.step()
    for prompt, p, row in zip(prompts, params, rows, strict=True):
        alone = gf.Engine(model, max_rows=1)
        want = alone.add(prompt, p)
        while not want.finished:
            alone.step()
        assert row.tokens == want.tokens
    assert rows[0].tokens == recompute(model, prompts[0], params[0])
    assert rows[1].tokens == [5] * 8  # the bias wins every step
    assert 4 not in rows[4].tokens[:6]


@pytest.mark.parametrize(
    "overrides",
    [{}, {"position": "alibi", "attention_backend": "eager"}, {"sliding_window": 5}],
    ids=["rope-gqa", "alibi-eager", "ring (one row at a time)"],
)
def test_prompts_prefilled_together_produce_what_they_produce_alone(overrides):
    """add_many pads the prompts (1 to 11 tokens) into one forward beside a row already
    decoding; every row's tokens equal the uncached recomputation of it alone, so neither
    the padding nor the batch leaks into any row."""
    model = tiny_model(**overrides)
    engine = gf.Engine(model, max_rows=5)
    early = SamplingParams(temperature=0.0, max_new_tokens=9, eos_token_id=NO_EOS)
    first = engine.add([4, 4, 9], early)
    engine.step()
    params = [schedule_params for _, schedule_params in SCHEDULE]
    rows = engine.add_many(PROMPTS, params)
    assert [len(row.tokens) for row in rows] == [1] * len(rows)
    while not all(row.finished for row in [first, *rows]):
        engine.step()
    assert first.tokens == recompute(model, [4, 4, 9], early)
    for i, row in enumerate(rows):
        assert row.tokens == recompute(model, PROMPTS[i], params[i]), f"row {i}"
    with pytest.raises(ValueError, match="6 prompts but 5 free row slots"):
        engine.add_many([[1]] * 6, [early] * 6)
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        engine.add_many([[1], [2]], [early])


def test_rnn_rows_joining_mid_generation_equal_alone():
    torch.manual_seed(0)
    cfg = gf.ModelConfig(family="rnn", cell="gru", vocab_size=40, d_model=16, n_layers=2)
    model = gf.build_model(cfg).eval()
    got = run_schedule(gf.Engine(model, max_rows=4))
    for i, (_, params) in enumerate(SCHEDULE):
        assert got[i] == recompute(model, PROMPTS[i], params), f"row {i}"


def test_a_freed_slot_takes_a_new_row_and_live_rows_stay_exact():
    """Two slots, four rows: each new row waits for a slot, joins the one a finished row left
    (live rows move to the front), and still equals its recompute."""
    model = tiny_model()
    engine = gf.Engine(model, max_rows=2)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, eos_token_id=NO_EOS)
              for n in (3, 8, 5, 4)]  # fmt: skip
    waiting, rows = list(range(4)), {}
    while waiting or any(not row.finished for row in rows.values()):
        while waiting and len(engine.rows) < 2:
            i = waiting.pop(0)
            rows[i] = engine.add(PROMPTS[i], params[i])
        engine.step()
    for i in range(4):
        assert rows[i].tokens == recompute(model, PROMPTS[i], params[i]), f"row {i}"
    assert engine.rows == [] and engine.n_live == 0


def test_cancel_frees_the_slot_at_once_and_an_abandoned_stream_cancels_its_row():
    engine = gf.Engine(tiny_model(), max_rows=1)
    row = engine.add([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=20))
    engine.cancel(row)
    assert row.stop_reason == "cancelled" and engine.rows == []
    stream = engine.stream([1, 2, 3], max_new_tokens=20, temperature=0.0)
    next(stream)
    assert len(engine.rows) == 1 and not torch.is_inference_mode_enabled()
    stream._tokens.close()  # what garbage collection does to an abandoned generator
    assert engine.rows == [] and stream.stats.stop_reason == "cancelled"


# --- stops ------------------------------------------------------------------------------------


def test_stop_token_ids_and_stop_strings_end_a_row():
    model = tiny_model(vocab_size=40)
    tokenizer = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz0123456789 .,!")
    engine = gf.Engine(model, tokenizer=tokenizer)
    prompt = tokenizer.encode("hello there")
    free = engine.generate(prompt, 16, temperature=0.0, eos_token_id=NO_EOS).token_ids
    text = tokenizer.decode(free)

    by_id = engine.generate(
        prompt, 16, temperature=0.0, eos_token_id=NO_EOS, stop_token_ids=[free[5]]
    )
    assert by_id.token_ids == free[: free.index(free[5]) + 1]
    assert by_id.stats.stop_reason == "stop"

    stop = text[6:8]  # two characters the reply spells: the row ends once its text has them
    row = engine.add(prompt, SamplingParams(temperature=0.0, max_new_tokens=16, stop=[stop],
                                            eos_token_id=NO_EOS))  # fmt: skip
    while not row.finished:
        engine.step()
    end = text.index(stop)
    assert row.stop_reason == "stop" and row.text == text[:end]
    assert tokenizer.decode(row.tokens).startswith(text[:end] + stop)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (
            {"stop": [3]},
            r"stop entry 3 \(int\) is not a stop string: put token ids in stop_token_ids",
        ),
        ({"stop": 1.5}, r"stop=1.5 is not allowed: give a string or a list of strings"),
        ({"stop": [""]}, "would stop at once"),
        ({"stop_token_ids": ["</s>"]}, "stop_token_ids=.* is not allowed.*stop strings go in stop"),
        ({"min_p": 2.0}, "min_p=2.0 is not allowed"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 is not allowed"),
        ({"seed": -1}, "seed=-1 is not allowed"),
        ({"max_new_tokens": 0}, "max_new_tokens=0 is not allowed"),
    ],
)
def test_bad_sampling_params_are_clear_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


def test_engine_api_errors_name_the_value_and_the_fix():
    model = tiny_model()
    with pytest.raises(
        ValueError, match=r"stop=\['x'\] needs the text: create the Engine with tokenizer"
    ):
        gf.Engine(model).add([1, 2], SamplingParams(stop=["x"]))
    engine = gf.Engine(model, max_rows=2, max_seq_len=8)
    with pytest.raises(
        ValueError, match="the prompt has 10 tokens but a row slot holds 8 positions"
    ):
        engine.add(list(range(10)))
    engine.add([1, 2], SamplingParams(max_new_tokens=5))
    engine.add([3, 4], SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match=r"all 2 row slots are busy .*larger max_rows"):
        engine.add([5, 6])
    with pytest.raises(ValueError, match="on_full_context='wrap': pick 'stop' or 'shift'"):
        engine.add([5, 6], on_full_context="wrap")
    with pytest.raises(ValueError, match="max_rows=0 must be a whole number >= 1"):
        gf.Engine(model, max_rows=0)


# --- prefix reuse across turns ----------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"position": "alibi"}, {"sliding_window": 5}],
                         ids=["rope", "alibi", "ring"])  # fmt: skip
def test_a_continued_row_prefills_only_the_new_tokens_and_equals_a_full_prefill(overrides):
    model = tiny_model(**overrides)
    engine = gf.Engine(model, max_rows=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, eos_token_id=NO_EOS)
    first = engine.add(PROMPTS[0], params, keep_cache=True)
    while not first.finished:
        engine.step()
    assert first in engine.rows and engine.n_live == 0  # parked, its slot kept
    follow_up = [*first.context, 11, 12, 13]  # turn 1 + its reply + the new message
    second = engine.add(follow_up, params, continues=first)
    while not second.finished:
        engine.step()
    assert second.stats.cached_prompt_tokens == len(first.context) - 1
    assert second.tokens == recompute(model, follow_up, params)
    with pytest.raises(ValueError, match="continues= must be a finished row added with keep_cache"):
        engine.add(follow_up, params, continues=first)  # its slot went to `second`


def test_a_prompt_that_shares_only_part_of_the_parked_context_reuses_that_part():
    """The next prompt may render the last reply in other tokens: the slot keeps the longest
    shared prefix and prefills the rest; a prompt sharing nothing prefills everything."""
    model = tiny_model()
    engine = gf.Engine(model, max_rows=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=4, eos_token_id=NO_EOS)
    first = engine.add(PROMPTS[2], params, keep_cache=True)
    while not first.finished:
        engine.step()
    for prompt, shared in (([*PROMPTS[2][:7], 1, 2], 7), ([9, 9, 9], 0)):
        row = engine.add(prompt, params, continues=first, keep_cache=True)
        while not row.finished:
            engine.step()
        assert row.stats.cached_prompt_tokens == shared
        assert row.tokens == recompute(model, prompt, params)
        first = row
    engine.release(first)
    assert engine.rows == []


def test_a_batch_larger_than_the_slots_waits_for_free_slots():
    """generate_batch on an Engine of 2 slots with 5 prompts: rows join as others finish, and
    each row (seeded: row i gets seed + i) equals its recompute alone."""
    model = tiny_model()
    prompts = [*PROMPTS, [4, 4, 4, 2]]
    results = gf.Engine(model, max_rows=2).generate_batch(
        prompts, 7, temperature=0.8, seed=10, eos_token_id=NO_EOS
    )
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        params = SamplingParams(temperature=0.8, seed=10 + i, max_new_tokens=7, eos_token_id=NO_EOS)
        assert result.token_ids == recompute(model, prompt, params), f"row {i}"
    assert max(r.stats.batch_size for r in results) == 2
