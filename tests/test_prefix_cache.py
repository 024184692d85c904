"""The prefix cache across requests: a new row copies the keys/values another row holds for the
tokens both prompts begin with (Engine.add's prefix_from), and the server's scheduler finds
that row, makes prompts sent together wait for the first one's prefill, and keeps clients of
different cache_salt apart. References: each prompt decoded alone without any cache
(test_continuous_batching.recompute), and the longest common prefix counted here."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import tiny_model
from test_continuous_batching import recompute
from test_server_scheduler import greedy, serve

import glassformer as gf
from glassformer.infer.rows import common_prefix_length
from glassformer.nn.kv_cache import KVCache
from glassformer.server.metrics import Metrics
from glassformer.server.scheduler import Finished, Request, Scheduler, Tokens

SHARED = [3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6]  # 20 tokens


def finish(engine: gf.Engine, *rows) -> None:
    while not all(row.finished for row in rows):
        engine.step()


def test_copy_positions_copies_the_first_positions_of_one_row_and_nothing_else():
    cache = KVCache(n_layers=2, batch_size=3, n_kv_heads=2, max_seq_len=8, head_dim=4)
    for buffer in (cache.k, cache.v):
        buffer.copy_(torch.randn(buffer.shape))
    k, v = cache.k.clone(), cache.v.clone()
    cache.copy_positions(source=2, target=0, n_positions=5)
    for before, after in ((k, cache.k), (v, cache.v)):
        expected = before.clone()
        expected[:, 0, :, :5] = before[:, 2, :, :5]
        assert torch.equal(after, expected)


@pytest.mark.parametrize("source_state", ["live", "parked", "prefilling"])
def test_a_row_copying_a_shared_prefix_decodes_what_it_decodes_alone(source_state):
    """The source is mid-generation, parked, or still prefilling (a 4-token budget: 12 of its
    prompt's 23 positions are in its slot): the new row copies what both prompts share and
    the slot holds, prefills the rest, and both rows give the tokens they give alone."""
    model = tiny_model()
    chunk = 4 if source_state == "prefilling" else None
    engine = gf.Engine(model, max_rows=3, prefill_chunk=chunk)
    params = greedy(6)
    first_prompt, second_prompt = [*SHARED, 1, 2, 3], [*SHARED, 4, 5]
    first = engine.add(first_prompt, params, keep_cache=True)
    if source_state == "live":
        engine.step()
    elif source_state == "parked":
        finish(engine, first)
    else:
        for _ in range(3):
            engine.step()
    held = len(engine.held_tokens(first))
    assert held == {"live": 24, "parked": 28, "prefilling": 12}[source_state]
    second = engine.add(second_prompt, params, prefix_from=first)
    assert second.stats.cached_prompt_tokens == min(held, len(SHARED))
    finish(engine, first, second)
    assert second.tokens == recompute(model, second_prompt, params)
    assert first.tokens == recompute(model, first_prompt, params)


def test_saved_positions_load_into_another_row_and_nothing_else():
    cache = KVCache(n_layers=2, batch_size=3, n_kv_heads=2, max_seq_len=8, head_dim=4)
    for buffer in (cache.k, cache.v):
        buffer.copy_(torch.randn(buffer.shape))
    k, v = cache.k.clone(), cache.v.clone()
    saved = cache.save_positions(row=2, n_positions=6)
    cache.k[:, 2].zero_()  # the row's slot is someone else's now: the copy keeps its numbers
    cache.load_positions(saved, target=0, n_positions=5)
    for before, after in ((k, cache.k), (v, cache.v)):
        expected = before.clone()
        expected[:, 0, :, :5] = before[:, 2, :, :5]
        assert torch.equal(after[:, :2], expected[:, :2])


def test_a_row_loading_a_saved_prefix_decodes_what_it_decodes_alone():
    """A finished row's keys/values saved out of its slot, the slot released and taken by
    another prompt: a third prompt that begins like the first loads the shared prefix from the
    copy and decodes what it decodes alone."""
    model = tiny_model()
    engine = gf.Engine(model, max_rows=1)
    params = greedy(6)
    first = engine.add([*SHARED, 1, 2, 3], params, keep_cache=True)
    finish(engine, first)
    saved = engine.save_prefix(first)
    assert saved.tokens == engine.held_tokens(first)
    engine.release(first)
    other = engine.add([30, 31, 32, *SHARED], params)  # overwrites the slot
    finish(engine, other)
    later = [*SHARED, 4, 5]
    row = engine.add(later, params, prefix_saved=saved)
    assert row.stats.cached_prompt_tokens == len(SHARED)
    finish(engine, row)
    assert row.tokens == recompute(model, later, params)


def test_a_ring_cache_does_not_copy_and_says_why():
    model = tiny_model(sliding_window=5)
    engine = gf.Engine(model, max_rows=2)
    first = engine.add([*SHARED, 1], greedy(2), keep_cache=True)
    assert not engine.shares_prefixes
    with pytest.raises(ValueError, match="prefix_from= needs a cache that holds position p"):
        engine.add([*SHARED, 2], greedy(2), prefix_from=first)
    finish(engine, first)


def make_scheduler(model, min_shared_prefix=4, prefill_chunk=8, store=0) -> Scheduler:
    engine = gf.Engine(model, max_rows=8)
    return Scheduler(
        engine, 4, 16, 1 << 30, Metrics(), prefill_chunk=prefill_chunk,
        min_shared_prefix=min_shared_prefix, prompt_store_bytes=store,
    )  # fmt: skip


def run(scheduler: Scheduler, jobs):
    scheduler.start()
    try:
        return asyncio.run(serve(scheduler, jobs))
    finally:
        scheduler.stop()


@pytest.mark.parametrize("prefill_chunk", [None, 8])
def test_prompts_sent_together_prefill_their_shared_prefix_once(prefill_chunk):
    """Four prompts with a 20-token head and their own tails arrive at once: the first is
    prefilled, the other three wait for it (they would share 16+ tokens: min_wait at a
    min_shared_prefix of 4), then copy the head; every row decodes what it decodes alone."""
    model = tiny_model()
    prompts = [[*SHARED, 10 + i, 20 + i] for i in range(4)]
    results = run(
        make_scheduler(model, prefill_chunk=prefill_chunk), [(p, greedy(5)) for p in prompts]
    )
    cached = [row.stats.cached_prompt_tokens for _, row in results]
    assert cached == [0, 20, 20, 20]
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == recompute(model, prompt, greedy(5))


def test_without_sharing_the_prompts_are_prefilled_side_by_side():
    model = tiny_model()
    prompts = [[*SHARED, 10 + i] for i in range(3)]
    results = run(make_scheduler(model, min_shared_prefix=0), [(p, greedy(3)) for p in prompts])
    assert [row.stats.cached_prompt_tokens for _, row in results] == [0, 0, 0]


def test_a_later_prompt_copies_from_a_parked_row_of_another_conversation():
    model = tiny_model()
    scheduler = make_scheduler(model)
    first, later = [*SHARED, 1, 2], [*SHARED[:12], 30, 31, 32]
    scheduler.start()
    try:
        asyncio.run(serve(scheduler, [(first, greedy(4))]))
        [(tokens, row)] = asyncio.run(serve(scheduler, [(later, greedy(4))]))
    finally:
        scheduler.stop()
    assert row.stats.cached_prompt_tokens == common_prefix_length(first, later) == 12
    assert tokens == recompute(model, later, greedy(4))
    assert len(scheduler.prefix.parked) == 2  # the source stays parked for the next one


async def cached_tokens(scheduler: Scheduler, prompt: list[int], salt: str | None) -> int:
    """One request of `salt`, to its end: how many of its prompt tokens were copied."""
    request = Request([(prompt, greedy(3))], asyncio.get_running_loop(), cache_salt=salt)
    scheduler.submit(request)
    while True:
        event = await asyncio.wait_for(request.events.get(), 30)
        if isinstance(event, Finished):
            return event.row.stats.cached_prompt_tokens
        assert isinstance(event, Tokens), event


def test_rows_share_keys_only_with_rows_of_the_same_cache_salt():
    model = tiny_model()
    scheduler = make_scheduler(model)

    async def requests():
        return [
            await cached_tokens(scheduler, [*SHARED, 1], None),
            await cached_tokens(scheduler, [*SHARED, 2], "alice"),  # the unsalted row: not hers
            await cached_tokens(scheduler, [*SHARED, 3], "alice"),
            await cached_tokens(scheduler, [*SHARED, 4], "bob"),
            await cached_tokens(scheduler, [*SHARED, 5], None),
        ]

    scheduler.start()
    try:
        cached = asyncio.run(requests())
    finally:
        scheduler.stop()
    assert cached == [0, 0, 20, 0, 20]


@pytest.mark.parametrize("store", [0, 1 << 20])
def test_a_row_evicted_from_its_parked_slot_leaves_its_prefix_in_the_prompt_store(store):
    """Four parked slots (8 rows, 4 running): the first prompt's row is parked, then evicted
    by four more. With a prompt store its keys/values stay there, and a later prompt that
    begins like it copies the 20 tokens they share from the store; without one it prefills
    them. A prompt of another cache_salt copies nothing either way."""
    model = tiny_model()
    scheduler = make_scheduler(model, store=store)
    first, later = [*SHARED, 1, 2], [*SHARED, 30, 31]
    others = [[20 + i, 21 + i, 22 + i, 23 + i, 24 + i] for i in range(4)]

    scheduler.start()
    try:
        asyncio.run(serve(scheduler, [(first, greedy(4))]))
        for other in others:  # one at a time: each parks, the oldest parked row leaves
            asyncio.run(serve(scheduler, [(other, greedy(4))]))
        # on the engine thread, between steps: after the last row's Finished, it parks
        parked, stored = scheduler.call(
            lambda: ([row.prompt for row in scheduler.prefix.parked.values()],
                     len(scheduler.prefix.stored))
        ).result(timeout=30)  # fmt: skip
        assert first not in parked and stored == (1 if store else 0)
        cached_elsewhere = asyncio.run(cached_tokens(scheduler, [*SHARED, 36], "alice"))
        [(tokens, row)] = asyncio.run(serve(scheduler, [(later, greedy(4))]))
    finally:
        scheduler.stop()
    assert cached_elsewhere == 0
    assert row.stats.cached_prompt_tokens == (len(SHARED) if store else 0)
    assert tokens == recompute(model, later, greedy(4))


def test_the_prompt_store_keeps_within_its_bytes_the_most_recently_used():
    """A store with room for two rows' keys/values: three evicted rows leave the two most
    recent; the oldest one's prompt then copies nothing."""
    model = tiny_model()
    scheduler = make_scheduler(model)
    heads = [[30 + i, *SHARED[1:]] for i in range(3)]
    scheduler.start()
    try:
        for head in heads:
            asyncio.run(serve(scheduler, [([*head, 1, 2], greedy(4))]))
        per_row = scheduler.engine.cache.row_bytes(22 + 4 - 1)  # 22-token prompts, 4 tokens

        def evict_all():  # on the engine thread, between steps: every row has parked by then
            scheduler.prefix.store_bytes = 2 * per_row
            while scheduler.prefix.evict_oldest():
                pass
            return len(scheduler.prefix.stored), scheduler.prefix.stored_bytes

        assert scheduler.call(evict_all).result(timeout=30) == (2, 2 * per_row)
        [(_, oldest)] = asyncio.run(serve(scheduler, [([*heads[0], 7], greedy(2))]))
        [(_, newest)] = asyncio.run(serve(scheduler, [([*heads[2], 7], greedy(2))]))
    finally:
        scheduler.stop()
    assert oldest.stats.cached_prompt_tokens == 0
    assert newest.stats.cached_prompt_tokens == len(heads[2])
