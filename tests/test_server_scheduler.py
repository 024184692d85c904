"""The server's engine thread (server/scheduler.py) without HTTP, and the sampling pieces it adds
(presence/frequency penalties, logprobs). References: Engine.generate alone, and a cache-less
recompute of the penalties."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from conftest import tiny_model
from processes import DEADLINE_S

import glassformer as gf
from glassformer.infer.prefill import PREFILL_CHUNK
from glassformer.infer.sampling import NO_EOS, SamplingParams, penalize_counts, token_logprobs
from glassformer.server.metrics import Metrics
from glassformer.server.scheduler import (
    Failed,
    Finished,
    QueueFull,
    Request,
    Scheduler,
    Stopped,
    Tokens,
)


def make_scheduler(
    model,
    max_batch=4,
    max_queue=16,
    cache_bytes=1 << 30,
    request_timeout_s=None,
    prefill_chunk=PREFILL_CHUNK,
) -> Scheduler:
    engine = gf.Engine(model, max_rows=2 * max_batch)
    metrics = Metrics()
    return Scheduler(
        engine, max_batch, max_queue, cache_bytes, metrics, request_timeout_s, prefill_chunk
    )


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, eos_token_id=NO_EOS, **kw)


async def serve(scheduler: Scheduler, jobs: list[tuple[list[int], SamplingParams]]):
    """Submit each (prompt, params) as a request at once; returns each one's tokens and row."""
    loop = asyncio.get_running_loop()
    requests = [Request([job], loop) for job in jobs]
    for request in requests:
        scheduler.submit(request)

    async def collect(request: Request):
        tokens = []
        while True:
            event = await asyncio.wait_for(request.events.get(), 30)
            if isinstance(event, Tokens):
                tokens += event.token_ids
            elif isinstance(event, Finished):
                return tokens, event.row
            else:
                raise AssertionError(event)

    return await asyncio.gather(*(collect(r) for r in requests))


@pytest.fixture
def model():
    return tiny_model(max_seq_len=64)


@pytest.mark.parametrize("prefill_chunk", [None, 2, PREFILL_CHUNK])
def test_concurrent_rows_equal_engine_generate_alone(model, prefill_chunk):
    prompts = [[3, 14, 15, 9, 2, 6], [1], [7, 7, 8, 20, 21, 22, 23, 24, 25], [30, 2, 5], [4, 4]]
    params = [greedy(6 + 3 * i) for i in range(len(prompts))]
    params[1] = SamplingParams(temperature=0.9, seed=5, max_new_tokens=9, eos_token_id=NO_EOS)
    scheduler = make_scheduler(model, max_batch=3, prefill_chunk=prefill_chunk)  # two wait
    scheduler.start()
    try:
        results = asyncio.run(serve(scheduler, list(zip(prompts, params, strict=True))))
    finally:
        scheduler.stop()
    for prompt, p, (tokens, _row) in zip(prompts, params, results, strict=True):
        alone = gf.Engine(model).generate(
            prompt, p.max_new_tokens, temperature=p.temperature, seed=p.seed, eos_token_id=NO_EOS
        )
        assert tokens == alone.token_ids
    assert max(row.stats.batch_size for _, row in results) == 3


@pytest.mark.parametrize("prefill_chunk", [None, 2])
def test_a_prompt_extending_a_parked_row_prefills_only_the_new_part(model, prefill_chunk):
    scheduler = make_scheduler(model, prefill_chunk=prefill_chunk)
    scheduler.start()
    try:
        [(first, _)] = asyncio.run(serve(scheduler, [([3, 14, 15, 9], greedy(5))]))
        follow_up = [3, 14, 15, 9, *first, 11, 12]
        [(second, row)] = asyncio.run(serve(scheduler, [(follow_up, greedy(5))]))
    finally:
        scheduler.stop()
    assert row.stats.cached_prompt_tokens == 4 + len(first) - 1  # the last sampled was not fed
    assert (
        second
        == gf.Engine(model).generate(follow_up, 5, temperature=0.0, eos_token_id=NO_EOS).token_ids
    )


def test_running_streams_keep_decoding_while_a_long_prompt_is_prefilled_in_chunks(model):
    """A 30-token prompt joins a running stream with a budget of 4 tokens a turn: it takes 8
    turns to its first token, and in each of them the running row gets its token; both
    produce what Engine.generate gives alone."""
    scheduler = make_scheduler(model, prefill_chunk=4)
    engine = scheduler.engine
    long_prompt = [(5 * i) % 40 for i in range(1, 31)]
    turns = []  # after each step: (running row's tokens, long row's tokens or None)
    step = engine.step

    def recorded_step():
        time.sleep(0.005)  # the running row lasts while the long prompt arrives
        got = step()
        by_prompt = {len(row.prompt): len(row.tokens) for row in engine.rows[: engine.n_held]}
        turns.append((by_prompt.get(3), by_prompt.get(30)))
        return got

    engine.step = recorded_step

    async def run():
        loop = asyncio.get_running_loop()
        running = Request([([1, 2, 3], greedy(40))], loop)
        scheduler.submit(running)
        await asyncio.wait_for(running.events.get(), 5)  # it streams
        collected = serve(scheduler, [(long_prompt, greedy(3))])
        return await collected

    scheduler.start()
    try:
        [(tokens, _)] = asyncio.run(run())
    finally:
        scheduler.stop()
    prefilling = [i for i, (_, long) in enumerate(turns) if long == 0]
    assert len(prefilling) == 7  # chunks 1-7 of 8: the 8th gives the first token
    first_of_long = prefilling[-1] + 1
    assert turns[first_of_long][1] == 1
    for before, after in zip(prefilling, [*prefilling[1:], first_of_long], strict=True):
        assert turns[after][0] == turns[before][0] + 1  # the running row kept its pace
    alone = gf.Engine(model).generate(long_prompt, 3, temperature=0.0, eos_token_id=NO_EOS)
    assert tokens == alone.token_ids


def test_requests_sent_together_are_gathered_into_one_prefill_and_a_lone_one_waits_little(model):
    """After an idle spell the scheduler waits while requests keep arriving, each within
    admit_quiet_s of the last (here 0.3 s, 0.05 s apart: one add_many of all four), and a lone
    request only admit_quiet_s, not the whole window (here 3 s)."""
    scheduler = make_scheduler(model, max_batch=4)
    scheduler.admit_window_s, scheduler.admit_quiet_s = 3.0, 0.3
    engine = scheduler.engine
    batches = []  # the prompts of each add_many
    add_many = engine.add_many

    def recorded_add_many(prompts, *args, **kwargs):
        batches.append(len(prompts))
        return add_many(prompts, *args, **kwargs)

    engine.add_many = recorded_add_many

    async def together():
        loop = asyncio.get_running_loop()
        requests = [Request([([3 + i, 4], greedy(2))], loop) for i in range(4)]
        for request in requests:
            scheduler.submit(request)
            await asyncio.sleep(0.05)
        for request in requests:
            while not isinstance(await asyncio.wait_for(request.events.get(), 30), Finished):
                pass

    async def alone(token: int):
        request = Request([([token, 9, 9], greedy(1))], asyncio.get_running_loop())
        sent = time.perf_counter()
        scheduler.submit(request)
        await asyncio.wait_for(request.events.get(), 30)
        first = time.perf_counter() - sent
        while not isinstance(await asyncio.wait_for(request.events.get(), 30), Finished):
            pass
        return first

    scheduler.start()
    try:
        asyncio.run(alone(20))  # the engine thread is in its loop, idle again after this one
        time.sleep(0.5)  # (a request queued before its next turn begins is not gathered)
        waited = asyncio.run(alone(21))
        time.sleep(0.5)
        asyncio.run(together())
    finally:
        scheduler.stop()
    assert batches == [4]  # a lone request's one prompt takes Engine.add
    assert 0.3 <= waited < 2.0


def test_parked_rows_stay_within_their_byte_budget(model):
    per_token = gf.Engine(model, max_rows=1).model.new_cache(1, 64).row_bytes(1)
    scheduler = make_scheduler(model, cache_bytes=8 * per_token)  # one row of 6 positions
    scheduler.start()
    try:
        asyncio.run(serve(scheduler, [([1, 2, 3], greedy(4)), ([5, 6, 7], greedy(4))]))
    finally:
        scheduler.stop()
    assert len(scheduler.prefix.parked) == 1
    assert scheduler.prefix.parked_bytes() == 6 * per_token


def test_a_cancelled_request_frees_its_slot(model):
    scheduler = make_scheduler(model, max_batch=1)

    async def run() -> int:
        loop = asyncio.get_running_loop()
        long = Request([([1, 2, 3], greedy(60))], loop)
        scheduler.submit(long)
        await long.events.get()  # it runs
        scheduler.cancel(long)
        short = await serve(scheduler, [([4, 5], greedy(3))])  # needs the only row
        return len(short[0][0])

    scheduler.start()
    try:
        assert asyncio.run(run()) == 3
    finally:
        scheduler.stop()
    assert scheduler.engine.n_held == 0


def test_a_full_queue_refuses_and_queues_nothing(model):
    """max_queue counts the rows that must wait for a slot: with 2 free rows and a queue of 2,
    four rows are taken (two start at the next turn) and a fifth is refused."""
    scheduler = make_scheduler(model, max_batch=2, max_queue=2)  # not started: nothing leaves

    async def run() -> None:
        loop = asyncio.get_running_loop()
        scheduler.submit(Request([([1], greedy(2))] * 4, loop))
        with pytest.raises(QueueFull):
            scheduler.submit(Request([([1], greedy(2))], loop))

    asyncio.run(run())
    assert len(scheduler.waiting) == 4


def test_a_prompt_the_engine_refuses_fails_only_its_request(model):
    scheduler = make_scheduler(model)
    scheduler.start()

    async def run():
        loop = asyncio.get_running_loop()
        bad = Request([([99], greedy(2))], loop)  # outside the 40-token vocabulary
        scheduler.submit(bad)
        event = await asyncio.wait_for(bad.events.get(), 30)
        good = await serve(scheduler, [([1, 2], greedy(2))])
        return event, good

    try:
        event, good = asyncio.run(run())
    finally:
        scheduler.stop()
    assert isinstance(event, Failed) and event.status == 400
    assert len(good[0][0]) == 2


def slow_steps(engine: gf.Engine, monkeypatch, seconds: float = 0.01) -> None:
    """Each decode step takes at least `seconds`, so a 60-token row runs for a while."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


async def failure(request: Request, timeout_s: float = 5) -> Failed:
    """The request's Failed event, skipping the tokens it got before it."""
    while True:
        event = await asyncio.wait_for(request.events.get(), timeout_s)
        if isinstance(event, Failed):
            return event
        assert isinstance(event, Tokens), event


def test_an_engine_failure_while_starting_fails_every_job_it_holds(model, monkeypatch):
    """A RuntimeError while prefilling admitted rows: the running row, the rows taken off the
    queue with it and the rows still queued all get an error, and the scheduler serves the next
    request on a clean engine."""
    scheduler = make_scheduler(model, max_batch=3)
    engine = scheduler.engine
    slow_steps(engine, monkeypatch)  # the running row is still running when the others come

    def broken(*args, **kwargs):
        raise RuntimeError("a kernel broke")

    async def run():
        loop = asyncio.get_running_loop()
        running = Request([([1, 2, 3], greedy(60))], loop)
        scheduler.submit(running)
        await asyncio.wait_for(running.events.get(), 5)  # it runs
        monkeypatch.setattr(engine, "add", broken)
        monkeypatch.setattr(engine, "add_many", broken)
        others = [Request([([4 + i, 5], greedy(4))], loop) for i in range(4)]  # two wait
        for request in others:
            scheduler.submit(request)
        events = [await failure(running)] + [await failure(r) for r in others]
        monkeypatch.undo()
        after = await serve(scheduler, [([6, 7], greedy(3))])
        return events, after

    scheduler.start()
    try:
        events, after = asyncio.run(run())
    finally:
        scheduler.stop()
    assert [e.status for e in events] == [500] * 5
    assert len(after[0][0]) == 3
    assert not (scheduler.running or scheduler.waiting or scheduler.starting)
    assert engine.n_held == 0


def test_a_request_past_its_deadline_gets_504_and_frees_its_slot(model, monkeypatch):
    """--request-timeout: the running row and the row queued behind it both end with a 504
    (code request_timeout) and the engine runs no rows after."""
    scheduler = make_scheduler(model, max_batch=1, request_timeout_s=0.2)
    engine = scheduler.engine
    slow_steps(engine, monkeypatch)  # 60 tokens take 0.6 s: three times the deadline

    async def run():
        loop = asyncio.get_running_loop()
        running, queued = (Request([([1, 2, 3], greedy(60))], loop) for _ in range(2))
        scheduler.submit(running)
        scheduler.submit(queued)
        return [await failure(running), await failure(queued)]

    scheduler.start()
    try:
        events = asyncio.run(run())
        deadline = time.monotonic() + DEADLINE_S
        while (engine.n_held or scheduler.running) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.stop()
    assert [(e.status, e.code) for e in events] == [(504, "request_timeout")] * 2
    assert "--request-timeout" in events[0].message
    assert engine.n_held == 0 and not scheduler.running and not scheduler.waiting


def test_stopping_the_scheduler_fails_what_it_holds(model, monkeypatch):
    scheduler = make_scheduler(model, max_batch=1)
    slow_steps(scheduler.engine, monkeypatch)

    async def run():
        loop = asyncio.get_running_loop()
        running, queued = (Request([([1, 2, 3], greedy(60))], loop) for _ in range(2))
        scheduler.submit(running)
        scheduler.submit(queued)
        await asyncio.wait_for(running.events.get(), 5)  # it runs; the other waits
        await loop.run_in_executor(None, scheduler.stop)
        return [await failure(running), await failure(queued)]

    scheduler.start()
    events = asyncio.run(run())
    assert [e.status for e in events] == [503] * 2
    with pytest.raises(Stopped):
        scheduler.submit(Request([([1], greedy(1))], asyncio.new_event_loop()))


# --- the sampling pieces the server uses ----------------------------------------------------


def test_penalize_counts_subtracts_presence_once_and_frequency_per_use():
    logits = torch.zeros(1, 5)
    out = penalize_counts(logits, torch.tensor([1, 1, 3]), presence=0.5, frequency=2.0)
    assert out.tolist() == [[0.0, -4.5, 0.0, -2.5, 0.0]]


def test_token_logprobs_are_log_softmax_with_the_top_candidates():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    entry = token_logprobs(logits, token_id=2, n_top=2)
    expected = torch.log_softmax(logits, dim=-1)[0]
    assert entry.logprob == pytest.approx(float(expected[2]))
    assert [t for t, _ in entry.top] == [1, 2]
    assert entry.top[0][1] == pytest.approx(float(expected[1]))


def test_engine_rows_record_logprobs_of_the_chosen_tokens(model):
    engine = gf.Engine(model)
    row = engine.add([3, 4, 5], greedy(4, logprobs=3))
    tokens = list(engine.follow(row))
    assert [e.token_id for e in row.logprobs] == tokens
    assert all(e.top[0][0] == e.token_id for e in row.logprobs)  # greedy picks the top one


def test_sampling_params_refuse_bad_penalties_and_logprobs():
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=float("nan"))
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
