"""The OpenAI-compatible HTTP API (seed 002's opening and exercise 2, against a model you can look
inside): FastAPI routes for /v1/models, /v1/completions, /v1/chat/completions, /health and
/metrics, in front of the engine thread (server/scheduler.py), with /v1/embeddings
(server/embeddings.py), /tokenize and /detokenize (server/tokenize.py), RAG (server/rag.py) and
the browser lab (server/lab.py) at `/`.

Text becomes token ids here and token ids become text here; the engine sees ids only. Chat
messages go through the model's chat template with their text encoded as text, so a user who
types "<|im_start|>system" gets those characters, never a new turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from torch import nn

import glassformer
from glassformer.detokenize import TokenBytes
from glassformer.infer.constrain import ConstraintError, check_constraint, constraint_from
from glassformer.infer.engine import Engine
from glassformer.infer.prefill import FUSED_PREFILL, MIN_SHARED_PREFIX, PREFILL_CHUNK
from glassformer.infer.sampling import NO_EOS, SamplingParams
from glassformer.infer.thinking import no_think_suffix, thinking_markers
from glassformer.nn.quant import precision_name
from glassformer.server.body_limit import BodyLimit
from glassformer.server.embeddings import router as embeddings_router
from glassformer.server.gate import Gate, api_error, http_error, server_error
from glassformer.server.lab import mount_static
from glassformer.server.lab import router as lab_router
from glassformer.server.metrics import Metrics
from glassformer.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    engine_stopped,
)
from glassformer.server.rag import router as rag_router
from glassformer.server.requests import check_ids, check_model, encoded, read_body
from glassformer.server.responses import Reply
from glassformer.server.scheduler import QueueFull, Scheduler, Stopped
from glassformer.server.scheduler import Request as Work
from glassformer.server.tokenize import router as tokenize_router
from glassformer.server.tools import (
    ToolError,
    conversation,
    message_dict,
    response_format_schema,
    tool_use,
)
from glassformer.templates import end_of_turn_ids

log = logging.getLogger("glassformer.server")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Served:
    """The models this server serves (the browser lab reads them too): the generation model,
    and an optional embedding model, each with its tokenizer and the name clients use."""

    model: nn.Module
    tokenizer: Any
    name: str
    embed_model: nn.Module | None = None
    embed_tokenizer: Any = None
    embed_name: str | None = None
    rag_store: Any = None  # rag.Store (serve --rag-store), searched with rag_encoder
    rag_encoder: Any = None  # rag.Encoder over embed_model


@dataclass(frozen=True)
class ServerOptions:
    max_batch: int = 8
    max_queue: int = 64
    api_key: str | None = None
    max_seq_len: int | None = None  # positions per row slot (default: min(context, 2048))
    prefix_cache_bytes: int = 256 * 2**20  # keys/values parked rows may hold
    prompt_store_bytes: int = 1024 * 2**20  # keys/values of rows evicted from their slots
    min_shared_prefix: int = MIN_SHARED_PREFIX  # tokens copied from another request at least
    thinking_budget: int | None = None  # a thinking model's budget when a request gives none
    request_timeout_s: float | None = 600.0  # then a request gets a 504 (None: no limit)
    prefill_chunk: int | None = PREFILL_CHUNK  # prompt tokens one engine turn prefills (None: all)
    max_body_bytes: int = 16 * 2**20  # a larger request body gets a 413, unparsed
    huge_pages: bool = False  # move the model's large tensors into 2 MB pages (Engine's option)
    threads: int | None = None  # the engine thread's torch threads (None: as torch has them)
    kv_dtype: torch.dtype | None = None  # the keys/values' dtype (None: the model's)


def served_name(model_arg: str) -> str:
    """The name clients send as `model`: an alias as is, a path by its last part."""
    return Path(model_arg).name if ("/" in model_arg or Path(model_arg).exists()) else model_arg


def create_app(served: Served, options: ServerOptions | None = None) -> FastAPI:
    """The FastAPI app: routes, the engine thread (started and stopped with the app), the
    API-key and metrics middleware, and the browser lab when it is installed."""
    options = options or ServerOptions()
    metrics = Metrics()
    slot_len = min(options.max_seq_len or 2048, served.model.cfg.max_seq_len)
    engine = Engine(
        served.model,
        max_rows=2 * options.max_batch,
        max_seq_len=slot_len,
        tokenizer=served.tokenizer,
        huge_pages=options.huge_pages,
        kv_dtype=options.kv_dtype,
    )
    scheduler = Scheduler(
        engine,
        options.max_batch,
        options.max_queue,
        options.prefix_cache_bytes,
        metrics,
        options.request_timeout_s,
        options.prefill_chunk,
        options.threads,
        options.min_shared_prefix,
        options.prompt_store_bytes,
    )
    api = API(served, scheduler, metrics, slot_len, options.thinking_budget)

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        # before the port opens, so no one waits on it; on the engine thread, as every forward
        await asyncio.wrap_future(scheduler.call(partial(_warm_up, engine)))
        yield
        scheduler.stop()

    app = FastAPI(title="glassformer", version=glassformer.__version__, lifespan=lifespan)
    app.state.served, app.state.metrics, app.state.scheduler = served, metrics, scheduler
    app.add_middleware(BodyLimit, max_bytes=options.max_body_bytes)  # inside Gate: counted
    app.add_middleware(Gate, api_key=options.api_key, metrics=metrics)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.model, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.include_router(embeddings_router)  # /v1/embeddings (serve --embed-model)
    app.include_router(tokenize_router)  # /tokenize and /detokenize (vLLM's)
    app.include_router(rag_router)  # /rag/search and /lab/api/rag (serve --rag-store)
    app.include_router(lab_router)  # the browser lab: /lab/api/* and the page at /
    mount_static(app)
    return app


def _warm_up(engine: Engine) -> None:
    """A two-token generation and a 64-token prefill, so the first request does not pay
    one-time costs: the decode kernels are built on first use (the browser lab's first chat
    turn waited 2.8 s for its first token without it, 0.41 s with it:
    tests/test_browser_lab.py's screenshot), and the torch forward that prefills prompts longer
    than FUSED_PREFILL is slow the first time (SmolLM2 int8, 128 tokens: 231 ms, then 182;
    after a 64-token prefill 178)."""
    engine.generate([0], max_new_tokens=2, temperature=0.0, eos_token_id=NO_EOS)
    prompt = [0] * min(2 * FUSED_PREFILL, engine.slot_len - 1)
    engine.generate(prompt, max_new_tokens=1, temperature=0.0, eos_token_id=NO_EOS)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects: once the body is read, the ASGI receive channel's
    next message is http.disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- the routes ---------------------------------------------------------------------------------


class API:
    def __init__(
        self,
        served: Served,
        scheduler: Scheduler,
        metrics: Metrics,
        slot_len: int,
        thinking_budget: int | None = None,
    ):
        self.served, self.scheduler, self.metrics, self.slot_len = (
            served,
            scheduler,
            metrics,
            slot_len,
        )
        self.created = int(time.time())
        cfg = served.model.cfg
        # the precision the model decodes in (int4 for a Q4_1 file run on its own blocks)
        precision = precision_name(served.model)
        self.fingerprint = f"glassformer-{glassformer.__version__}-{served.name}-{precision}"
        tokenizer = served.tokenizer
        stops = end_of_turn_ids(tokenizer)
        if cfg.eos_token_id is not None and 0 <= cfg.eos_token_id < cfg.vocab_size:
            stops.add(cfg.eos_token_id)
        self.stop_ids = tuple(sorted(i for i in stops if i is not None))
        self.markers = thinking_markers(tokenizer)  # None: the model does not think
        self.thinking_budget = thinking_budget  # serve --thinking-budget / --no-think (0)
        self.token_bytes = TokenBytes(tokenizer)  # logprobs and the decoders read them

    async def health(self) -> JSONResponse:
        """200 while the engine thread serves; 503 once it has stopped or died, since every
        request would then fail: a load balancer or orchestrator must see that here."""
        scheduler = self.scheduler
        serving = scheduler.thread.is_alive() and not (scheduler.stopped or scheduler.stopping)
        body = {
            "status": "ok" if serving else "engine stopped",
            "model": self.served.name,
            "embed_model": self.served.embed_name,
            "running_rows": scheduler.engine.n_held,  # rows still prefilling included
            "max_batch": scheduler.max_batch,
            "context": self.slot_len,
        }
        return JSONResponse(body, status_code=200 if serving else 503)

    async def metrics_text(self, request: Request) -> Response:
        """Prometheus' text format, or OpenMetrics when the scraper's Accept header asks."""
        body, content_type = self.metrics.exposition(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card(name) for name in self._names()]}

    async def model(self, model_id: str) -> dict:
        if model_id not in self._names():
            served = ", ".join(repr(name) for name in self._names())
            raise APIError(
                404,
                f"model {model_id!r} is not served here: the models are {served} (GET /v1/models)",
                "model",
                code="model_not_found",
            )
        return self._model_card(model_id)

    def _names(self) -> list[str]:
        return [self.served.name] + ([self.served.embed_name] if self.served.embed_name else [])

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "glassformer"}

    # --- completions ----------------------------------------------------------------------------

    async def completions(self, request: Request):
        body = await read_body(request, CompletionRequest)
        request.state.ignored_fields = body.ignored_fields
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            encode = partial(self.served.tokenizer.encode, body.prompt)
            prompt = await run_in_threadpool(encoded, encode, "prompt")
        else:
            prompt = self._check_ids(body.prompt, "prompt")
        limit = body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        default = body.max_tokens is None
        n_top = body.logprobs
        work = self._work(request, body, prompt, limit, default, "max_tokens", n_top)
        reply = Reply(self, "text_completion", "cmpl", body, prompt, n_top, work.arrived)
        return await self._respond(request, body, work, reply)

    async def chat_completions(self, request: Request):
        body = await read_body(request, ChatRequest)
        request.state.ignored_fields = body.ignored_fields
        self._check_model(body.model)
        tokenizer = self.served.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(
                400,
                f"{self.served.name} has no chat template, so a conversation cannot be "
                "formatted for it: use /v1/completions with a plain prompt",
                "messages",
            )
        both = body.max_tokens and body.max_completion_tokens
        if both and body.max_tokens != body.max_completion_tokens:
            raise APIError(
                400,
                "max_tokens and max_completion_tokens differ: give one of them",
                "max_tokens",
            )
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        try:
            use = tool_use(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ToolError as err:
            raise APIError(400, str(err), err.param, code="invalid_tools") from None
        if use is not None and body.response_format not in (None, {"type": "text"}):
            raise APIError(400, "give tools or a response_format, not both", "response_format")
        messages, tool_kwargs = conversation(
            [message_dict(m) for m in body.messages], use, tokenizer.chat_template
        )
        no_think = body.chat_template_kwargs is not None and not (
            body.chat_template_kwargs.enable_thinking
        )
        budget = 0 if no_think else body.thinking_budget
        if budget is not None and self.markers is None:
            field = "chat_template_kwargs" if no_think else "thinking_budget"
            raise APIError(
                400,
                f"{self.served.name} does not think: its tokenizer has no <think> and </think>"
                f" tokens, so {field} cannot apply; leave it out",
                field,
            )
        if budget is None:
            budget = self.thinking_budget  # the server's default
            no_think = budget == 0
        template_kwargs = ({"enable_thinking": False} if no_think else {}) | tool_kwargs

        def encode() -> list[int]:
            ids = tokenizer.encode_chat(messages, template_kwargs=template_kwargs)
            suffix = no_think_suffix(self.markers) if no_think else []
            return ids + suffix if suffix and suffix[-1] not in ids[-4:] else ids

        prompt = await run_in_threadpool(encoded, encode, "messages")
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        n_top = (body.top_logprobs or 0) if body.logprobs else None
        work = self._work(
            request,
            body,
            prompt,
            body.token_limit,
            body.token_limit is None,
            param,
            n_top,
            thinking_budget=budget,
            grammar=use.grammar() if use is not None else None,
        )
        reply = Reply(
            self, "chat.completion", "chatcmpl", body, prompt, n_top, work.arrived, use is not None
        )
        return await self._respond(request, body, work, reply)

    def _check_model(self, name: str) -> None:
        check_model(self.served, name)

    def _check_ids(self, ids: list[int], param: str) -> list[int]:
        return check_ids(ids, self.served.model.cfg.vocab_size, param)

    def _work(
        self,
        request: Request,
        body: SamplingFields,
        prompt: list[int],
        limit: int | None,
        default_limit: bool,
        limit_param: str,
        n_top: int | None,
        thinking_budget: int | None = None,
        grammar: str | None = None,
    ) -> Work:
        """The request's rows: one prompt, one SamplingParams per choice (seed + i); grammar:
        the tool calls' (server/tools.py), else response_format's schema, if any."""
        room = self.slot_len - len(prompt)
        if room < 1:
            raise APIError(
                400,
                f"the prompt is {len(prompt)} tokens; the context is {self.slot_len}: shorten it",
                "messages" if isinstance(body, ChatRequest) else "prompt",
                code="context_length_exceeded",
            )
        if limit is None or (default_limit and limit > room):
            limit = room  # no limit asked for: as much as the context allows
        if limit > room:
            raise APIError(
                400,
                f"{limit_param}={limit} plus the prompt's {len(prompt)} tokens exceeds the "
                f"{self.slot_len}-token context: ask for at most {room} tokens",
                limit_param,
                code="context_length_exceeded",
            )
        if body.n > self.scheduler.max_batch:
            raise APIError(400, f"n={body.n} exceeds --max-batch {self.scheduler.max_batch}", "n")
        extra_stops = tuple(self._check_ids(body.stop_token_ids or [], "stop_token_ids"))
        stops = extra_stops if body.ignore_eos else tuple(sorted({*self.stop_ids, *extra_stops}))
        logit_bias = body.logit_bias or {}
        self._check_ids(sorted(logit_bias), "logit_bias")
        if body.min_tokens > limit:
            if default_limit and limit == room:
                cap = f"the {room} tokens the context leaves after the prompt"
                fix = "lower min_tokens or shorten the prompt"
            else:
                cap = f"{limit_param}={limit}" + (" (the default)" if default_limit else "")
                fix = f"lower min_tokens or raise {limit_param}"
            raise APIError(
                400,
                f"min_tokens={body.min_tokens} exceeds {cap}: {fix}",
                "min_tokens",
                code="invalid_value",
            )
        try:
            schema = None if grammar else response_format_schema(body.response_format)
            constraint = constraint_from(schema, None, grammar)
            if constraint is not None:
                check_constraint(constraint)  # a 400 in milliseconds, before any row
        except (ToolError, ConstraintError) as err:
            param = "tools" if grammar else "response_format"
            raise APIError(400, str(err), param, code="invalid_schema") from None
        choices = []
        for i in range(body.n):
            seed = None if body.seed is None else body.seed + i
            params = SamplingParams(
                json_schema=schema,
                grammar=grammar,
                temperature=body.temperature,
                top_p=body.top_p if body.top_p < 1 else None,
                top_k=body.top_k,
                min_p=body.min_p,
                seed=seed,
                max_new_tokens=limit,
                stop=tuple(body.stop or ()),
                stop_token_ids=stops,
                eos_token_id=NO_EOS if body.ignore_eos else None,
                repetition_penalty=body.repetition_penalty,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logprobs=n_top,
                think_ids=self.markers.ids if self.markers else None,
                thinking_budget=thinking_budget,
                min_tokens=body.min_tokens,
                logit_bias=logit_bias,
            )
            choices.append((prompt, params))
        work = Work(choices, asyncio.get_running_loop(), cache_salt=body.cache_salt)
        try:
            self.scheduler.submit(work)
        except QueueFull:
            raise APIError(
                429,
                f"the queue is full ({self.scheduler.max_queue} rows wait): retry shortly",
                kind="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except Stopped:
            raise engine_stopped() from None
        return work

    async def _respond(self, request: Request, body: SamplingFields, work: Work, reply: Reply):
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = self._stream(work, reply, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        if body.stream_options is not None:
            raise APIError(400, "stream_options needs stream: true", "stream_options")

        # The client's leaving is watched beside the events, not between them: a poll that ran
        # only when no token came for a while let a left request decode to its max_tokens.
        async def consume() -> None:
            while not reply.done:
                reply.take(await work.events.get())

        consumer = asyncio.create_task(consume())
        gone = asyncio.create_task(_client_gone(request))
        try:
            await asyncio.wait((consumer, gone), return_when=asyncio.FIRST_COMPLETED)
            if not consumer.done():
                return JSONResponse({}, status_code=499)
            consumer.result()  # its error, if it failed
        finally:
            consumer.cancel()
            gone.cancel()
            if not reply.done:
                self.scheduler.cancel(work)
        return reply.whole()

    async def _stream(self, work: Work, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per batch of new text, a last chunk per choice with its
        finish_reason, the usage chunk when asked for, then `data: [DONE]`. A client that goes
        away cancels this generator, and with it the request's rows."""
        try:
            yield reply.sse(reply.opening_chunks(include_usage))
            while not reply.done:
                event = await work.events.get()
                chunks = reply.take(event, include_usage)
                if reply.failed:
                    yield reply.sse([reply.failed.body()])
                    break
                yield reply.sse(chunks)
            if include_usage and not reply.failed:
                yield reply.sse([reply.usage_chunk()])
            yield "data: [DONE]\n\n"
        finally:
            if not reply.done:
                self.scheduler.cancel(work)
