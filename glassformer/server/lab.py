"""The lab in a browser (seed 002 练习 1 and 2): the JSON endpoints behind the page at `/`.

The page (glassformer/server/static/, plain JS, no build step) has six views; each asks one
endpoint here, which calls the library's own code, so what the page shows is what the library
computes:

    chat        POST /v1/chat/completions (the API itself), then /lab/api/turn_cost: KV bytes
    sampling    /lab/api/next_tokens, /lab/api/sample   infer.sampling's distribution and draw
    attention   /lab/api/attention                      inspect.attention_view's weights
    猫/累/它     /lab/api/worked_example                 numpy_ref.attention, as worked_example
    tokens      /lab/api/tokenize                       glassformer.tokenize
    RAG         /lab/api/rag (server/rag.py), then /v1/chat/completions twice: with the
                retrieved sources, and stuffed (serve --rag-store)

The models come from `request.app.state.served` (model, tokenizer, name, embed_model,
embed_tokenizer, embed_name); the app factory includes `router` and calls `mount_static(app)`.
Bodies, limits and errors are /v1's (server/lab_edge.py): a 400 with OpenAI's error object.

Every forward of the served model runs on the engine thread, between two decode steps
(Scheduler.call): a capture sets weights sinks and hooks on the very modules the engine decodes
with, so a step beside it would land in the capture (another user's prompt in the view), and a
plain forward beside a capture would land there too. The embedding model's forwards (its
capture, /v1/embeddings, the RAG question) run there too: one thread runs every model, so one
OpenMP team serves them all (a second team in a worker thread made libgomp throttle its
spinning for every step, halving the decode rate on 2 cores).
"""

from __future__ import annotations

import math
from functools import lru_cache, partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import Field

from glassformer import numpy_ref
from glassformer.calc import kv_bytes_per_token, kv_cache_bytes
from glassformer.inspect import attention_view
from glassformer.inspect.capture import _encode as encode_for_view
from glassformer.server import lab_sampling
from glassformer.server.lab_edge import (
    LabBody,
    bad,
    check_context,
    finite,
    on_engine_thread,
    read_body,
    served_context,
    served_models,
    worked_attention,
)
from glassformer.server.lab_tokens import kinds_note, token_kinds
from glassformer.tokenize import available_vocabularies, load_vocabulary, model_vocabulary, tokenize

STATIC_DIR = Path(__file__).parent / "static"
MAX_TEXT_CHARS = 20_000  # the token counter; more is a paste accident, not a question
MAX_ATTENTION_TOKENS = 64  # a grid of L x H matrices of T x T numbers has to reach the page
WORKED_EXAMPLE_TOKENS = ("猫", "累", "它")  # seed 002: the Keys and Values of cat, tired, it

router = APIRouter(prefix="/lab/api", tags=["lab"])


def _kv_dtype(model: torch.nn.Module) -> str:
    """The cache's number format: that of the model's floating-point weights."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def _describe(model: torch.nn.Module | None, tokenizer: Any, name: str | None) -> dict | None:
    if model is None:
        return None
    cfg = model.cfg
    decoder = cfg.family not in ("bert", "rnn")
    dtype = _kv_dtype(model)
    return {
        "name": name,
        "family": cfg.family,
        "n_layers": cfg.n_layers,
        "n_heads": getattr(cfg, "n_heads", None),
        "d_model": cfg.d_model,
        "vocab_size": cfg.vocab_size,
        "max_seq_len": cfg.max_seq_len,
        "kv_dtype": dtype if decoder else None,
        "kv_bytes_per_token": kv_bytes_per_token(cfg, dtype) if decoder else None,
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }


@router.get("/info")
def info(request: Request) -> dict:
    """The loaded models (shape, KV bytes per token) and the vocabularies the counter has."""
    served = served_models(request)
    return {
        "model": _describe(served.model, served.tokenizer, served.name),
        "embed_model": _describe(
            getattr(served, "embed_model", None),
            getattr(served, "embed_tokenizer", None),
            getattr(served, "embed_name", None),
        ),
        "vocabularies": available_vocabularies(),
        "rag": _describe_store(getattr(served, "rag_store", None)),
    }


def _describe_store(store: Any) -> dict | None:
    if store is None:
        return None
    info = store.info
    return {
        "store": store.location,
        "chunks": store.count(),
        "embed_model": info.embed_model,
        "chunk_tokens": info.chunk_tokens,
        "overlap": info.overlap,
    }


# --- chat: what a turn holds in the KV cache -------------------------------------------------


class Message(LabBody):
    role: Literal["system", "user", "assistant"]
    content: str


class TurnCost(LabBody):
    messages: list[Message] = Field(min_length=1)
    completion_tokens: int = Field(ge=0)
    prompt_tokens: int | None = Field(default=None, ge=0)


@router.post("/turn_cost")
async def turn_cost(request: Request) -> dict:
    """The KV-cache bytes a chat turn leaves: (prompt + completion tokens) x bytes per token,
    by calc.kv_cache_bytes. prompt_tokens: the API's usage figure; if absent, the prompt is
    encoded here with the model's chat template. A turn past the context could not be cached."""
    served = served_models(request)
    body = await read_body(request, TurnCost)
    model, tokenizer = served.model, served.tokenizer
    prompt = body.prompt_tokens
    if prompt is None:
        if not getattr(tokenizer, "chat_template", None):
            raise bad(
                "this model has no chat template: give prompt_tokens (the API's usage)",
                "prompt_tokens",
            )
        messages = [m.model_dump() for m in body.messages]
        ids = await run_in_threadpool(
            partial(tokenizer.encode_chat, messages, add_generation_prompt=True)
        )
        prompt = len(ids)
    total = prompt + body.completion_tokens
    context = served_context(request)
    check_context(prompt, context, "messages" if body.prompt_tokens is None else "prompt_tokens")
    check_context(total, context, "completion_tokens", "the turn (prompt + completion)")
    dtype = _kv_dtype(model)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": body.completion_tokens,
        "cached_tokens": total,
        "kv_dtype": dtype,
        "kv_bytes_per_token": kv_bytes_per_token(model.cfg, dtype),
        "kv_bytes": kv_cache_bytes(model.cfg, total, dtype),
    }


# --- the sampling layer ------------------------------------------------------------------------


router.add_api_route("/next_tokens", lab_sampling.next_tokens, methods=["POST"])
router.add_api_route("/sample", lab_sampling.sample_next, methods=["POST"])


# --- the attention explorer --------------------------------------------------------------------


class AttentionRequest(LabBody):
    text: str = Field(min_length=1, max_length=2000)
    which: Literal["model", "embed_model"] = "embed_model"


def _attention_ids(model: torch.nn.Module, tokenizer: Any, text: str, context: int) -> list:
    """The ids attention_view reads for `text` (its own encoder), within /v1's context."""
    try:
        ids = encode_for_view(model, tokenizer, text)
    except ValueError as err:  # a character the vocabulary cannot encode
        raise bad(f"text: {err}", "text") from None
    check_context(len(ids), context, "text", "the text")
    return ids


def _view(model: torch.nn.Module, tokenizer: Any, text: str) -> Any:
    try:
        return attention_view(model, tokenizer, text, max_tokens=MAX_ATTENTION_TOKENS)
    except ValueError as err:
        raise bad(f"text: {err}", "text") from None


@router.post("/attention")
async def attention(request: Request) -> JSONResponse:
    """Every layer's and head's attention weights for `text` (inspect.attention_view), rounded
    to 5 decimals: weights[layer][head][query][key]; token_kinds[i] says whether tokens[i] is
    a piece of text ("token"), the unknown token ("unk") or part of a character ("byte"), and
    note explains the unk and byte pieces (null when there are none)."""
    served = served_models(request)
    body = await read_body(request, AttentionRequest)
    embed = body.which == "embed_model"
    model = getattr(served, body.which, None)
    tokenizer = getattr(served, "embed_tokenizer" if embed else "tokenizer", None)
    name = getattr(served, "embed_name" if embed else "name", None) or body.which
    if model is None:
        flag = "--embed-model" if embed else "--model"
        raise bad(f"which: no {body.which} is loaded; start the server with {flag}", "which")
    context = model.cfg.max_seq_len if embed else served_context(request)
    ids = await run_in_threadpool(_attention_ids, model, tokenizer, body.text, context)
    # Captured between two decode steps, on the engine thread, as every forward of the server
    # (no decode step can reach the capture's hooks; one OpenMP team runs every model).
    view = await on_engine_thread(request, partial(_view, model, tokenizer, body.text))
    # Some 300,000 numbers: checked and rendered to JSON in a worker thread (FastAPI's own
    # encoder took 0.5 s of the event loop for MiniLM's 6 x 12 x 64 x 64).
    reply = partial(_attention_reply, model, tokenizer, name, body.text, view, ids)
    return await run_in_threadpool(lambda: JSONResponse(reply()))


def _attention_reply(
    model: torch.nn.Module, tokenizer: Any, name: str, text: str, view: Any, ids: list
) -> dict:
    weights = torch.stack(view.weights)  # (L, H, T, T)
    kinds = token_kinds(tokenizer, ids[: len(view.query_tokens)])
    return finite(
        {
            "name": name,
            "family": model.cfg.family,
            "tokens": view.query_tokens,
            "token_kinds": kinds,
            "note": kinds_note(tokenizer, name, text, view.query_tokens, kinds),
            "notes": view.notes,
            "n_layers": weights.shape[0],
            "n_heads": weights.shape[1],
            "weights": np.round(weights.cpu().numpy().astype(np.float64), 5).tolist(),
        }
    )


# --- the 猫/累/它 worked example -------------------------------------------------------------


class WorkedExample(LabBody):
    q: list[float] = Field(min_length=1, max_length=64, description="the Query of 它")
    K: list[list[float]] = Field(min_length=1, max_length=16, description="one Key per token")
    V: list[list[float]] = Field(min_length=1, max_length=16, description="one Value per token")
    divide_by_sqrt_d: bool = True
    key_scale: float = 1.0


@router.get("/worked_example")
def worked_example_defaults() -> dict:
    """Seed 002's vectors and what numpy_ref.worked_example computes from them."""
    q, K, V = numpy_ref.worked_example_vectors()
    result = numpy_ref.worked_example()
    return {
        "tokens": list(WORKED_EXAMPLE_TOKENS),
        "query_token": "它",
        "q": q.tolist(),
        "K": K.tolist(),
        "V": V.tolist(),
        "weights": result.weights.tolist(),
        "output": result.output.tolist(),
        "scores": result.scores.tolist(),
    }


@router.post("/worked_example")
async def worked_example(request: Request) -> dict:
    """The worked example with edited vectors: numpy_ref.attention, the function
    numpy_ref.worked_example calls; divide_by_sqrt_d=False drops the 1/√d (scale 1), key_scale
    multiplies every Key (×10 pushes the softmax into saturation). Numbers so large that a
    score or an output overflows float64 are a 400 naming the one to make smaller."""
    body = await read_body(request, WorkedExample)
    d = len(body.q)
    for name, rows in (("K", body.K), ("V", body.V)):
        for n, row in enumerate(rows):
            if len(row) != d:
                raise bad(
                    f"{name}[{n}] has {len(row)} numbers: every row needs d={d}, as q",
                    f"{name}.{n}",
                )
    if len(body.K) != len(body.V):
        raise bad(f"K has {len(body.K)} rows and V {len(body.V)}: one Key and Value per token", "V")
    scale = 1 / math.sqrt(d) if body.divide_by_sqrt_d else 1.0
    result = worked_attention(body.q, body.K, body.V, body.key_scale, scale)
    return finite(
        {
            "weights": result.weights[0].tolist(),
            "output": result.output[0].tolist(),
            "scores": result.scores[0].tolist(),
            "scale": scale,
        }
    )


# --- the token counter ------------------------------------------------------------------------


class TokenizeRequest(LabBody):
    text: str = Field(max_length=MAX_TEXT_CHARS)


_cached_vocabulary = lru_cache(maxsize=None)(load_vocabulary)


def _count(text: str, served: Any) -> dict:
    vocabularies = []
    for which, tok, name in (
        ("model", served.tokenizer, served.name),
        (
            "embed_model",
            getattr(served, "embed_tokenizer", None),
            getattr(served, "embed_name", None),
        ),
    ):
        if tok is not None:
            vocabularies.append(model_vocabulary(tok, name or which))
    vocabularies += [_cached_vocabulary(name) for name in available_vocabularies()]
    results = []
    for vocabulary in vocabularies:
        try:
            result = tokenize(text, vocabulary)
        except ValueError as err:  # e.g. a byte this vocabulary cannot encode
            results.append({"vocabulary": vocabulary.name, "error": str(err)})
            continue
        results.append(
            {
                "vocabulary": result.vocabulary,
                "count": result.count,
                "ids": result.ids,
                "pieces": result.pieces,
            }
        )
    return {"characters": len(text), "results": results}


@router.post("/tokenize")
async def tokenize_text(request: Request) -> dict:
    """The text's pieces and count under the loaded models' tokenizers, Qwen's and cl100k's."""
    served = served_models(request)
    body = await read_body(request, TokenizeRequest)
    return await run_in_threadpool(_count, body.text, served)


# --- the page --------------------------------------------------------------------------------


def mount_static(app: FastAPI) -> None:
    """Serve the page at `/` and its script and style under /lab/static/, from this package:
    no build step, no CDN."""
    app.mount("/lab/static", StaticFiles(directory=STATIC_DIR), name="lab-static")

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8")
