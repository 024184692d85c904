"""Scheduler.call: work on the served model (the lab's hooked forwards) runs on the engine
thread between two decode steps, never beside one; its result or exception comes back, and a
stopped engine refuses it. The decoding rows are unchanged by it (Engine.generate alone), and
the steps after it see what it changed."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from conftest import needs_kernels, tiny_model
from processes import DEADLINE_S
from test_server_scheduler import greedy, make_scheduler, serve

import glassformer as gf
from glassformer.infer.sampling import NO_EOS
from glassformer.server.scheduler import Stopped


def test_calls_run_on_the_engine_thread_between_steps_and_leave_the_rows_alone() -> None:
    model = tiny_model(max_seq_len=64)
    scheduler = make_scheduler(model)
    engine = scheduler.engine
    stepping = threading.Event()
    real_step = engine.step

    def step():
        stepping.set()
        try:
            return real_step()
        finally:
            stepping.clear()

    engine.step = step
    seen = []

    def work(i: int):
        seen.append((threading.current_thread().name, stepping.is_set()))
        if i == 3:
            raise ValueError("bad lab input")
        return i * i

    jobs = [([3, 14, 15, 9], greedy(40)), ([7, 8, 20], greedy(30))]
    scheduler.start()
    try:

        async def both():
            async def calls():
                await asyncio.sleep(0.02)  # the rows are decoding by now
                futures = [scheduler.call(lambda i=i: work(i)) for i in range(5)]
                return [await asyncio.wrap_future(f) for f in futures[:3]], futures

            return await asyncio.gather(serve(scheduler, jobs), calls())

        served, (results, futures) = asyncio.run(both())
        assert results == [0, 1, 4]
        with pytest.raises(ValueError, match="bad lab input"):
            futures[3].result(timeout=DEADLINE_S)
        assert futures[4].result(timeout=DEADLINE_S) == 16
        assert seen == [("glassformer-engine", False)] * 5
    finally:
        scheduler.stop()
    for (prompt, params), (tokens, _) in zip(jobs, served, strict=True):
        alone = gf.Engine(model).generate(
            prompt, params.max_new_tokens, temperature=0.0, eos_token_id=NO_EOS
        )
        assert tokens == alone.token_ids
    with pytest.raises(Stopped):
        scheduler.call(lambda: None)


@needs_kernels
def test_weights_a_call_gives_new_storage_reach_the_next_decode_steps() -> None:
    # The engine thread checks the model before its steps only after call()'s work
    # (Engine.model_unchanged, recheck_model): weights given new storage inside a call reach
    # the fused step of the next request, which decodes as the changed model does.
    model, other = tiny_model(max_seq_len=64), tiny_model(max_seq_len=64, seed=1)
    scheduler = make_scheduler(model)
    assert scheduler.engine.fused is not None  # the path under test: the C step
    jobs = [([3, 14, 15, 9], greedy(20))]

    def swap():
        with torch.no_grad():
            for p, q in zip(model.parameters(), other.parameters(), strict=True):
                p.data = q.detach().clone()

    scheduler.start()
    try:
        ((before, _),) = asyncio.run(serve(scheduler, jobs))
        scheduler.call(swap).result(timeout=DEADLINE_S)
        ((after, _),) = asyncio.run(serve(scheduler, jobs))
    finally:
        scheduler.stop()
    want = gf.Engine(other).generate([3, 14, 15, 9], 20, temperature=0.0, eos_token_id=NO_EOS)
    assert after == want.token_ids != before
