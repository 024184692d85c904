"""Chunked prefill (infer/prefill.py): with a prefill_chunk budget each Engine.step decodes the
live rows and then prefills at most that many prompt tokens, so prompts join across steps.
References: a cache-less recompute of each row alone, the keys/values the same prompts write in
one pass, and the tokens the unchunked Engine gives on SmolLM2."""

from __future__ import annotations

import pytest
import torch
from test_continuous_batching import PROMPTS, SCHEDULE, recompute, run_schedule, tiny_model

import glassformer as gf
from glassformer.cli import build_parser
from glassformer.infer.prefill import PREFILL_CHUNK
from glassformer.infer.sampling import NO_EOS, SamplingParams
from glassformer.server.metrics import Metrics
from glassformer.server.scheduler import Scheduler


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, eos_token_id=NO_EOS)


def record_forwards(model) -> list[tuple[int, int]]:
    """The (rows, tokens) shape of every forward from now on (read at the token embedding)."""
    shapes: list[tuple[int, int]] = []
    model.tok_emb.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    return shapes


@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"position": "learned", "norm": "layer", "ffn": "gelu", "n_kv_heads": 4},
        {"position": "alibi", "attention_backend": "eager"},
        {"sliding_window": 5},  # the ring: a chunk of 7 overwrites keys an earlier query needs
        {"family": "rnn", "cell": "gru", "d_model": 16},
    ],
    ids=["rope-gqa", "learned", "alibi-eager", "ring", "rnn"],
)
def test_rows_prefilled_in_chunks_produce_what_they_produce_alone(overrides, chunk):
    """Rows join mid-generation (two in the same step, their chunks sharing a padded forward)
    and are prefilled `chunk` tokens a step: each row's tokens, greedy or seeded, equal the
    uncached recompute of it alone."""
    if overrides.get("family") == "rnn":
        torch.manual_seed(0)
        model = gf.build_model(gf.ModelConfig(vocab_size=40, n_layers=2, **overrides)).eval()
    else:
        model = tiny_model(**overrides)
    got = run_schedule(gf.Engine(model, max_rows=4, prefill_chunk=chunk))
    for i, (_, params) in enumerate(SCHEDULE):
        assert got[i] == recompute(model, PROMPTS[i], params), f"row {i}"


def test_the_cache_written_in_chunks_equals_the_cache_written_at_once():
    """Three prompts (11, 6 and 1 tokens) prefilled 4 tokens a step write the keys/values that
    one batched pass writes; each row, with one new token, parks with its prompt's positions."""
    model = tiny_model()
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1]]
    engines = {chunk: gf.Engine(model, max_rows=3, prefill_chunk=chunk) for chunk in (None, 4)}
    rows = {}
    for chunk, engine in engines.items():
        rows[chunk] = engine.add_many(prompts, [greedy(1)] * 3, keep_cache=True)
        steps = 0
        while not all(row.finished for row in rows[chunk]):
            engine.step()
            steps += 1
        assert steps == (0 if chunk is None else 5)  # 18 tokens, 4 a step
    for at_once, chunked in zip(rows[None], rows[4], strict=True):
        assert chunked.tokens == at_once.tokens
        held = slice(0, len(at_once.prompt))
        for name in ("k", "v"):
            whole = getattr(engines[None].cache, name)[:, at_once.slot, :, held]
            parts = getattr(engines[4].cache, name)[:, chunked.slot, :, held]
            torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-4)  # fp32, other shapes


def test_each_step_decodes_the_running_row_and_prefills_at_most_the_budget():
    """A 40-token prompt joins a running row with a budget of 8: five steps, each one decode
    forward (1, 1) and one chunk (1, 8); the running row gets a token every step, and the new
    row its first at the fifth."""
    model = tiny_model()
    engine = gf.Engine(model, max_rows=2, fast=False, prefill_chunk=8)  # fast: the fused step
    running = engine.add([4, 4, 9], greedy(20))
    engine.step()  # its prefill: its first token
    shapes = record_forwards(model)
    prompt = [i % model.cfg.vocab_size for i in range(3, 43)]
    joining = engine.add(prompt, greedy(4))
    got = []
    for _ in range(5):
        engine.step()
        got.append((len(running.tokens), len(joining.tokens)))
    assert shapes == [(1, 1), (1, 8)] * 5
    assert got == [(2, 0), (3, 0), (4, 0), (5, 0), (6, 1)]
    while not (running.finished and joining.finished):
        engine.step()
    assert running.tokens == recompute(model, [4, 4, 9], greedy(20))
    assert joining.tokens == recompute(model, prompt, greedy(4))


def test_short_prompts_share_one_forward_and_the_budget_cuts_the_last():
    """Three 4-token prompts with a budget of 10: one forward (3, 4) takes the first two whole
    and half the third (padded); the next step decodes the two and prefills the rest, (1, 2)."""
    model = tiny_model()
    engine = gf.Engine(model, max_rows=3, fast=False, prefill_chunk=10)
    prompts = [[3, 14, 15, 9], [1, 2, 3, 4], [30, 2, 5, 6]]
    shapes = record_forwards(model)
    rows = engine.add_many(prompts, [greedy(5)] * 3)
    engine.step()
    assert shapes == [(3, 4)] and [len(row.tokens) for row in rows] == [1, 1, 0]
    engine.step()
    assert shapes[1:] == [(2, 1), (1, 2)] and [len(row.tokens) for row in rows] == [2, 2, 1]
    while not all(row.finished for row in rows):
        engine.step()
    for prompt, row in zip(prompts, rows, strict=True):
        assert row.tokens == recompute(model, prompt, greedy(5))


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 5}], ids=["rope", "ring"])
def test_a_continued_conversation_prefills_its_new_tokens_in_chunks(overrides):
    model = tiny_model(**overrides)
    engine = gf.Engine(model, max_rows=2, prefill_chunk=3)
    first = engine.add(PROMPTS[0], greedy(6), keep_cache=True)
    while not first.finished:
        engine.step()
    follow_up = [*first.context, 11, 12, 13, 14, 15, 16, 17]
    second = engine.add(follow_up, greedy(6), continues=first)
    steps_to_first_token = 0
    while not second.tokens:
        engine.step()
        steps_to_first_token += 1
    while not second.finished:
        engine.step()
    assert second.stats.cached_prompt_tokens == len(first.context) - 1
    assert steps_to_first_token == 3  # 8 new tokens, 3 a step
    assert second.tokens == recompute(model, follow_up, greedy(6))


def test_a_row_cancelled_mid_prefill_frees_its_slot_and_spares_the_others():
    model = tiny_model()
    engine = gf.Engine(model, max_rows=2, prefill_chunk=2)
    running = engine.add([4, 4, 9], greedy(12), keep_cache=True)
    engine.step()
    long = engine.add(PROMPTS[2], greedy(3), keep_cache=True)
    engine.step()
    engine.cancel(long)
    assert long.stop_reason == "cancelled" and long.slot == -1  # freed, not parked: half-filled
    assert engine.rows == [running] and engine.pending == []
    short = engine.add(PROMPTS[3], greedy(4))
    while not (running.finished and short.finished):
        engine.step()
    assert running.tokens == recompute(model, [4, 4, 9], greedy(12))
    assert short.tokens == recompute(model, PROMPTS[3], greedy(4))


def test_generate_batch_with_more_prompts_than_slots_waits_for_prefills():
    """Every slot holds a row still prefilling (no row got a token this step): generate_batch
    keeps stepping instead of taking the step for a stall."""
    model = tiny_model()
    prompts = [PROMPTS[2], PROMPTS[0], [4, 4, 4, 2]]
    results = gf.Engine(model, max_rows=2, prefill_chunk=1).generate_batch(
        prompts, 5, temperature=0.0, eos_token_id=NO_EOS
    )
    assert [r.token_ids for r in results] == [recompute(model, p, greedy(5)) for p in prompts]


def test_a_bad_prefill_chunk_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"prefill_chunk=0 must be a whole number of tokens >= 1"):
        gf.Engine(model, prefill_chunk=0)
    engine = gf.Engine(model, max_rows=2)
    with pytest.raises(ValueError, match=r"prefill_chunk=2.5 must be a whole number"):
        engine.prefill_chunk = 2.5
    with pytest.raises(ValueError, match=r"prefill_chunk=-1 must be a whole number"):
        Scheduler(engine, 1, 4, 0, Metrics(), prefill_chunk=-1)
    assert Scheduler(engine, 1, 4, 0, Metrics()).engine.prefill_chunk == PREFILL_CHUNK


def test_serve_takes_prefill_chunk_with_zero_for_whole_prompts(capsys):
    parser = build_parser()
    assert parser.parse_args(["serve", "--model", "m"]).prefill_chunk == PREFILL_CHUNK
    assert parser.parse_args(["serve", "--model", "m", "--prefill-chunk", "0"]).prefill_chunk == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--prefill-chunk", "-5"])
    assert "argument --prefill-chunk: -5 must be >= 0" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_chunked_prefill_equals_whole_prefill():
    """A real model: a 160-token passage prefilled 48 tokens a step (beside a running row, and
    two short prompts sharing a chunk) gives the greedy tokens of the whole prompts at once."""
    from glassformer.data import shakespeare_plays
    from glassformer.interop.pretrained import from_pretrained

    model, tokenizer = from_pretrained("smollm2")
    text = next(iter(shakespeare_plays("modern").values()))[:4000]
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompts = [ids[:160], ids[500:530], ids[700:720]]
    assert len(prompts[0]) == 160

    def run(chunk: int | None) -> list[list[int]]:
        engine = gf.Engine(model, max_rows=4, prefill_chunk=chunk)
        running = engine.add(ids[1000:1010], greedy(8))
        engine.step()
        rows = [engine.add(prompts[0], greedy(4)), *engine.add_many(prompts[1:], [greedy(4)] * 2)]
        while not all(row.finished for row in [running, *rows]):
            engine.step()
        return [running.tokens] + [row.tokens for row in rows]

    assert run(48) == run(None)
