"""Continuous batching for the server (llama.cpp's slots, vLLM's scheduler in miniature): one
engine thread owns the Engine and runs its loop; HTTP handlers only queue work and read events.

Each turn of the loop: drop the rows whose clients went away (their slots free at once), admit
waiting rows while fewer than max_batch are running (new prompts by Engine.add_many, a next
turn by Engine.add continuing its parked row), then one Engine.step: a token for every running
row, then at most prefill_chunk tokens of the admitted prompts, oldest first, several short
ones in one forward (vLLM's chunked prefill, llama.cpp's n_batch). So a long prompt, or many
at once, is prefilled across turns and the running streams keep their pace meanwhile; a row
gets its first token in the turn its last chunk runs. prefill_chunk=None prefills every
admitted prompt whole before the step (the running rows wait for it). New tokens go back
to each request's asyncio queue through its event loop (call_soon_threadsafe), so the engine
never waits for a client.

The prefix cache (server/prefix_cache.py): every finished row is parked with its keys/values
(keep_cache), and a new prompt continues a parked conversation or copies the keys/values it
shares with any row the engine holds, prefilling only the rest; prompts sent together that
share a long head wait for the first one's prefill.

Every admitted request ends with tokens and Finished, or one Failed: a bad prompt (400), a
request past --request-timeout (504, its rows cancelled), an engine failure (500, for every row
the scheduler holds), or the scheduler stopping (503).

Other work on the served model (the lab's attention capture, which hooks its modules) is handed
to the engine thread with call(): it runs between two steps, so no other request's forward can
reach the hooks, and its answer comes back through a Future. Nothing else touches the model, so
the engine thread's steps check it only after such work (Engine.model_unchanged; why, and
what the check costs: FusedStep.unchanged in infer/fused.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from glassformer.infer.engine import Engine, Row
from glassformer.infer.prefill import MIN_SHARED_PREFIX, PREFILL_CHUNK
from glassformer.infer.reuse import SavedPrefix
from glassformer.infer.sampling import SamplingParams, TokenLogprob
from glassformer.server.metrics import Metrics
from glassformer.server.prefix_cache import PrefixCache

log = logging.getLogger("glassformer.server")

# When the engine was idle, the first request waits for others sent at the same moment, so
# that one batched prefill serves them all (8 prompts of 128 tokens prefilled together take
# 1.7 s on 2 cores, one by one 8 x 0.3 s): while they keep coming, each within ADMIT_QUIET_S
# of the last, and ADMIT_WINDOW_S at most. The requests of a 32-client burst (the openai
# client, serve_peer.py) reached the scheduler 0.1-0.3 ms apart, a few 1-3.5 ms; a lone
# request waits 2 ms, not the whole 10: a lone 128-token prompt's first token through the
# fp32 server came in 137-142 ms, 143-147 with the fixed 10 ms (medians of 10, 3 pairs).
ADMIT_WINDOW_S = 0.01
ADMIT_QUIET_S = 0.002


# --- what the engine thread tells a request ----------------------------------------------------


@dataclass
class Tokens:
    """New tokens of choice `index` (with their logprobs when asked for)."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob]


@dataclass
class Finished:
    """Choice `index` is done: why, and its row (tokens, stats) for usage."""

    index: int
    row: Row


@dataclass
class Failed:
    """The request cannot be served; status and message for the client."""

    status: int
    message: str
    code: str | None = None  # OpenAI's error code, e.g. "request_timeout"


# --- a request and its rows ----------------------------------------------------------------------


@dataclass
class Job:
    """One row to generate: a choice of a request."""

    request: Request
    index: int
    prompt: list[int]
    params: SamplingParams
    row: Row | None = None
    sent: int = 0  # tokens already published
    last_time: float = 0.0


@dataclass
class Request:
    """One HTTP request's rows and the queue its handler reads events from."""

    prompts: list[tuple[list[int], SamplingParams]]  # one (prompt, params) per choice
    loop: asyncio.AbstractEventLoop
    cache_salt: str | None = None  # its rows share keys/values only with rows of this salt
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # its rows leave at the next turn (the client went, or it failed)
    failed: Failed | None = None  # the one Failed it was sent

    def publish(self, event: Tokens | Finished | Failed) -> None:
        """Hand an event to the handler's event loop (from the engine thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancelled = True


class QueueFull(Exception):
    """More rows wait than max_queue allows."""


class Stopped(Exception):
    """The engine thread has stopped: nothing would serve the request."""


class Scheduler:
    """The engine thread. submit() queues a Request's rows; cancel() drops them.

    max_batch: rows decoded together; max_queue: rows that may wait for a slot;
    prefix_cache_bytes: the most keys/values parked rows may hold (their slots are the
    engine's rows beyond max_batch); request_timeout_s: how long a request may take from
    submit() to its last token, queue included (None: no limit); prefill_chunk: the most
    prompt tokens a turn prefills (set on the engine; None: every admitted prompt whole);
    threads: the engine thread's torch threads (None: the process's default);
    min_shared_prefix: the fewest tokens a new row copies from another (0: only a chat's next
    turn reuses its own parked row; PrefixCache); prompt_store_bytes: keys/values of rows
    evicted from their parked slots kept for later prompts (0: none; PrefixCache).

    The engine thread runs every forward of the server (call() hands it the others), so one
    OpenMP team runs the models: libgomp counts the threads of every team in the process, and
    once they outnumber the cores it stops spinning at barriers and sleeps instead, which
    halved the fused decode step's rate on 2 cores when a worker thread had a team of its own.

    waiting, starting and running are shared with the HTTP side: written under self.wake only.
    """

    def __init__(
        self,
        engine: Engine,
        max_batch: int,
        max_queue: int,
        prefix_cache_bytes: int,
        metrics: Metrics,
        request_timeout_s: float | None = None,
        prefill_chunk: int | None = PREFILL_CHUNK,
        threads: int | None = None,
        min_shared_prefix: int = MIN_SHARED_PREFIX,
        prompt_store_bytes: int = 0,
    ) -> None:
        if engine.max_rows is None or engine.max_rows < max_batch:
            raise ValueError("the Engine needs max_rows >= max_batch (the extra rows park)")
        engine.prefill_chunk = prefill_chunk  # checked there; the engine thread owns the engine
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.threads = threads
        self.admit_window_s, self.admit_quiet_s = ADMIT_WINDOW_S, ADMIT_QUIET_S  # see _gather
        max_parked = engine.max_rows - max_batch  # the slots beyond the running rows
        self.prefix = PrefixCache(
            engine, prefix_cache_bytes, max_parked, min_shared_prefix, prompt_store_bytes
        )
        self.waiting: deque[Job] = deque()
        self.starting: list[Job] = []  # taken off the queue, not yet running
        self.running: dict[int, Job] = {}  # id(row) -> job
        self.calls: deque[tuple[Callable[[], Any], Future]] = deque()  # work for between steps
        self.wake = threading.Condition()
        self.stopping = False
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="glassformer-engine", daemon=True)

    # --- the HTTP side --------------------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.wake:
            self.stopping = True
            self.wake.notify()
        self.thread.join(timeout=10)

    def submit(self, request: Request) -> None:
        """Queue every choice of the request, or raise QueueFull or Stopped (nothing queued)."""
        jobs = [
            Job(request, i, prompt, params) for i, (prompt, params) in enumerate(request.prompts)
        ]
        with self.wake:
            if self.stopping or self.stopped:
                raise Stopped
            free = max(0, self.max_batch - len(self.running))  # rows the next turn admits at once
            if len(self.waiting) + len(jobs) > self.max_queue + free:
                raise QueueFull
            self.waiting.extend(jobs)
            self.metrics.set_gauges(queued_rows=len(self.waiting))
            self.wake.notify()

    def call(self, work: Callable[[], Any]) -> Future:
        """Run `work()` on the engine thread between two steps, where no decode step can overlap
        it; the Future holds its result or its exception. Raises Stopped if the scheduler is
        stopping (a Future still pending then gets Stopped as its exception)."""
        future: Future = Future()
        with self.wake:
            if self.stopping or self.stopped:
                raise Stopped
            self.calls.append((work, future))
            self.wake.notify()
        return future

    def _run_calls(self) -> None:
        with self.wake:
            calls, self.calls = list(self.calls), deque()
        for work, future in calls:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except Exception as err:  # the caller re-raises it; the engine goes on
                future.set_exception(err)
            finally:
                self.engine.recheck_model()

    def cancel(self, request: Request) -> None:
        """The client went away: its rows leave at the start of the next loop turn."""
        with self.wake:
            request.cancelled = True
            self.wake.notify()

    # --- the engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        if self.threads:  # OpenMP's thread count is each thread's own: set it for this one
            torch.set_num_threads(self.threads)
        try:
            engine = self.engine  # every slot's keys/values, up front (the prefix cache's too)
            engine.reserve(engine.max_rows, engine.slot_len)
            with engine.model_unchanged():  # but for call()'s work: _run_calls
                while self._turn():
                    pass
        finally:  # stopping, or something no turn caught: no handler may wait on this thread
            with self.wake:
                self.stopped = True
                calls, self.calls = list(self.calls), deque()
            for _, future in calls:
                if future.set_running_or_notify_cancel():
                    future.set_exception(Stopped())
            self._fail_held(Failed(503, "the server is stopping: retry on a running server"))

    def _turn(self) -> bool:
        """One turn: expire and drop rows, admit waiting ones, one engine step (decode, then a
        budget of prefill). False: stop."""
        with self.wake:
            idle = not (self.waiting or self.running)
            while not (self.stopping or self.waiting or self.running or self.calls):
                self.wake.wait()
        self._run_calls()
        if idle:  # requests sent together (a client fanning out) arrive a few ms apart
            self._gather()
        try:
            with self.wake:
                if self.stopping:
                    return False
                self._expire(time.perf_counter())
                self._drop_cancelled()
                while self.waiting and len(self.running) + len(self.starting) < self.max_batch:
                    self.starting.append(self.waiting.popleft())
            self._start_all(list(self.starting))
            with self.wake:
                self.starting.clear()
            if self.running:
                self.engine.step()
                self._publish_all()
            self.prefix.forget_gone()
            self._update_gauges()
        except Exception:  # a bug must not kill the server: fail what it holds, start clean
            log.exception("the engine failed; failing the requests it was serving")
            self._recover()
        return True

    def _gather(self) -> None:
        """After an idle spell: let the requests sent together queue, to prefill them as one
        batch. Waits while they keep arriving (each within admit_quiet_s of the last), for
        admit_window_s at most."""
        deadline = time.perf_counter() + self.admit_window_s
        with self.wake:
            seen = len(self.waiting)
            while not self.stopping:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return
                self.wake.wait(min(self.admit_quiet_s, left))  # a submit() wakes it at once
                if len(self.waiting) == seen:
                    return
                seen = len(self.waiting)

    def _fail(self, request: Request, event: Failed) -> None:
        """Send the request its one Failed; its other rows leave at the next turn."""
        with self.wake:
            request.cancelled = True
            if request.failed is None:
                request.failed = event
                request.publish(event)

    def _expire(self, now: float) -> None:
        """Fail the requests past their deadline (their rows are dropped right after)."""
        limit = self.request_timeout_s
        if limit is None:
            return
        event = Failed(
            504,
            f"the request did not finish within the server's --request-timeout of {limit:g} s "
            "(queue included): ask for fewer tokens (max_tokens), or retry when it is less busy",
            code="request_timeout",
        )
        for job in [*self.waiting, *self.running.values()]:
            if now - job.request.arrived > limit:
                self._fail(job.request, event)

    def _drop_cancelled(self) -> None:
        with self.wake:
            self.waiting = deque(job for job in self.waiting if not job.request.cancelled)
            for key, job in list(self.running.items()):
                if job.request.cancelled:
                    self.engine.cancel(job.row)
                    self.engine.release(job.row)
                    del self.running[key]

    def _start_all(self, jobs: list[Job]) -> None:
        """Give the admitted jobs their rows: each whose prompt the prefix cache has a source
        for on its own (only the rest of its prompt is prefilled), the new ones together
        (Engine.add_many), so their prompts share forwards: one pass for all without a
        prefill budget, else the budget's chunks over the next steps. A job that would share
        a long head with a prompt not yet prefilled that far goes back to the queue's front."""
        prefix, new, waits = self.prefix, [], []
        for job in jobs:
            if job.request.cancelled:
                continue
            salt = job.request.cache_salt
            source, shared = prefix.source(job.prompt, salt)
            starting = [(other.prompt, other.request.cache_salt) for other in new]
            if prefix.should_wait(job.prompt, salt, shared, starting):
                waits.append(job)
            elif source is None:
                new.append(job)
            else:
                self._start(job, source)
        if waits:
            with self.wake:
                self.waiting.extendleft(reversed(waits))
        if len(new) > 1:
            prefix.make_room(len(new))
            try:
                rows = self.engine.add_many(
                    [job.prompt for job in new], [job.params for job in new], keep_cache=True
                )
            except ValueError:  # one bad prompt: start them one by one, failing only that one
                rows = None
            if rows is not None:
                for job, row in zip(new, rows, strict=True):
                    self._run(job, row)
                return
        for job in new:
            self._start(job, None)

    def _start(self, job: Job, source: Row | SavedPrefix | None) -> None:
        """Put a job's prompt into a slot: continuing `source` if it is the parked row of the
        job's conversation, else copying the keys/values the two begin with (from a row or
        from the prompt store)."""
        continued = source is not None and self.prefix.continues(job.prompt, source)
        if not continued:
            self.prefix.make_room(keep=source)
        saved = source if isinstance(source, SavedPrefix) else None
        try:
            row = self.engine.add(
                job.prompt,
                job.params,
                keep_cache=True,
                continues=source if continued else None,
                prefix_from=None if continued or saved else source,
                prefix_saved=saved,
            )
        except ValueError as err:  # checked at the edge already; a last line of defence
            self._fail(job.request, Failed(400, str(err)))
            return
        self._run(job, row, source, continued)

    def _run(
        self, job: Job, row: Row, source: Row | SavedPrefix | None = None, continued: bool = False
    ) -> None:
        job.row = row
        self.prefix.started(row, job.request.cache_salt, source, continued)
        with self.wake:
            self.running[id(row)] = job
        self._publish(job)

    def _publish_all(self) -> None:
        for job in list(self.running.values()):
            self._publish(job)

    def _publish(self, job: Job) -> None:
        """Send a job's new tokens; when its row is done, send Finished and park the row."""
        row, now = job.row, time.perf_counter()
        new = row.tokens[job.sent :]
        if new:
            first = job.sent == 0
            if first:
                cached = row.stats.cached_prompt_tokens
                self.metrics.first_token(now - job.request.arrived, len(job.prompt), cached)
            each = None if first else (now - job.last_time) / len(new)
            self.metrics.tokens(len(new), each)
            logprobs = row.logprobs[job.sent : job.sent + len(new)]
            job.request.publish(Tokens(job.index, list(new), logprobs))
            job.sent, job.last_time = len(row.tokens), now
        if row.finished:
            with self.wake:
                self.running.pop(id(row), None)
            job.request.publish(Finished(job.index, row))
            self.prefix.park(row)

    def _recover(self) -> None:
        """After an engine failure: fail the rows being started and running (the queued ones
        start next turn), and free every slot."""
        failed = Failed(500, "the engine failed on this batch; try again")
        with self.wake:
            for job in [*self.starting, *self.running.values()]:
                if job.row is None or not job.row.finished:
                    self._fail(job.request, failed)
            self.starting.clear()
            self.running.clear()
        self.prefix.clear()
        self.engine.clear()  # every slot free again

    def _fail_held(self, event: Failed) -> None:
        """Fail every request the scheduler holds: queued, being started, running."""
        with self.wake:
            for job in [*self.waiting, *self.starting, *self.running.values()]:
                self._fail(job.request, event)
            self.waiting.clear()
            self.starting.clear()
            self.running.clear()

    def _update_gauges(self) -> None:
        with self.wake:
            queued = len(self.waiting)
        cache = self.engine.cache
        held = sum(cache.row_bytes(row.length) for row in self.engine.rows) if cache else 0
        self.metrics.set_gauges(
            running_rows=self.engine.n_held,  # decoding or still prefilling
            queued_rows=queued,
            parked_rows=len(self.prefix.parked),
            kv_cache_bytes=held,
            prompt_store_bytes=self.prefix.stored_bytes,
            prompt_store_entries=len(self.prefix.stored),
        )
