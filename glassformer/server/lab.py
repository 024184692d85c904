"""The lab in a browser (seed 002 练习 1 and 2): the JSON endpoints behind the page at `/`.

The page (glassformer/server/static/, plain JS, no build step) has five views; each asks one
endpoint here, which calls the library's own code, so what the page shows is what the library
computes:

    chat        POST /v1/chat/completions (the API itself), then /lab/api/turn_cost: KV bytes
    sampling    /lab/api/next_tokens, /lab/api/sample   infer.sampling's distribution and draw
    attention   /lab/api/attention                      inspect.attention_view's weights
    猫/累/它     /lab/api/worked_example                 numpy_ref.attention, as worked_example
    tokens      /lab/api/tokenize                       glassformer.tokenize

The models come from `request.app.state.served` (model, tokenizer, name, embed_model,
embed_tokenizer, embed_name); the app factory includes `router` and calls `mount_static(app)`.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from glassformer import numpy_ref
from glassformer.calc import kv_bytes_per_token, kv_cache_bytes
from glassformer.infer.sampling import (
    SamplingParams,
    make_generator,
    sample,
    sampling_distribution,
)
from glassformer.inspect import attention_view
from glassformer.tokenize import (
    available_vocabularies,
    load_vocabulary,
    model_vocabulary,
    piece_label,
    tokenize,
)

STATIC_DIR = Path(__file__).parent / "static"
MAX_TEXT_CHARS = 20_000  # the token counter; more is a paste accident, not a question
MAX_ATTENTION_TOKENS = 64  # a grid of L x H matrices of T x T numbers has to reach the page
MAX_CANDIDATES = 50
WORKED_EXAMPLE_TOKENS = ("猫", "累", "它")  # seed 002: the Keys and Values of cat, tired, it

router = APIRouter(prefix="/lab/api", tags=["lab"])
# The lab's forwards run one at a time: attention capture switches the modules' weights sink on,
# and two captures of one model must not overlap (capture refuses to nest).
_model_lock = threading.Lock()
_logits_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # (model id, ids) -> (V,)
LOGITS_CACHE_SIZE = 16  # a slider drag reshapes the same logits: one forward, many redraws


def _bad(message: str) -> HTTPException:
    return HTTPException(status_code=400, detail=message)


def _served(request: Request) -> Any:
    served = getattr(request.app.state, "served", None)
    if served is None:
        raise HTTPException(503, "no model is loaded: start the server with --model")
    return served


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
    served = _served(request)
    return {
        "model": _describe(served.model, served.tokenizer, served.name),
        "embed_model": _describe(
            getattr(served, "embed_model", None),
            getattr(served, "embed_tokenizer", None),
            getattr(served, "embed_name", None),
        ),
        "vocabularies": available_vocabularies(),
    }


# --- chat: what a turn holds in the KV cache -------------------------------------------------


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class TurnCost(BaseModel):
    messages: list[Message] = Field(min_length=1)
    completion_tokens: int = Field(ge=0)
    prompt_tokens: int | None = Field(default=None, ge=0)


@router.post("/turn_cost")
def turn_cost(body: TurnCost, request: Request) -> dict:
    """The KV-cache bytes a chat turn leaves: (prompt + completion tokens) x bytes per token,
    by calc.kv_cache_bytes. prompt_tokens: the API's usage figure; if absent, the prompt is
    encoded here with the model's chat template."""
    served = _served(request)
    model, tokenizer = served.model, served.tokenizer
    prompt = body.prompt_tokens
    if prompt is None:
        if not getattr(tokenizer, "chat_template", None):
            raise _bad("this model has no chat template: give prompt_tokens (the API's usage)")
        messages = [m.model_dump() for m in body.messages]
        prompt = len(tokenizer.encode_chat(messages, add_generation_prompt=True))
    total = prompt + body.completion_tokens
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


class NextTokens(BaseModel):
    prompt: str
    chat: bool = Field(True, description="wrap the prompt in the model's chat template")
    ids: list[int] = Field(default_factory=list, description="tokens chosen so far")
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    k: int = Field(10, ge=1, le=MAX_CANDIDATES, description="candidates to list")
    seed: int | None = None


def _params(body: NextTokens) -> SamplingParams:
    try:  # SamplingParams checks every value and says what is allowed
        return SamplingParams(
            temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
            seed=body.seed,
        )  # fmt: skip
    except ValueError as err:
        raise _bad(str(err)) from None


def _prompt_ids(body: NextTokens, model: torch.nn.Module, tokenizer: Any) -> list[int]:
    if body.chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.encode_chat([{"role": "user", "content": body.prompt}])
    elif hasattr(tokenizer, "chat_template"):
        ids = tokenizer.encode(body.prompt, parse_special=False)
    else:
        ids = tokenizer.encode(body.prompt)
    vocab = model.cfg.vocab_size
    bad = [i for i in body.ids if not 0 <= i < vocab]
    if bad:
        raise _bad(f"ids: {bad[0]} is outside the vocabulary 0..{vocab - 1}")
    ids = list(ids) + body.ids
    if not ids:
        raise _bad("prompt: the text encodes to no tokens; type something")
    if len(ids) > model.cfg.max_seq_len:
        raise _bad(
            f"prompt + ids: {len(ids)} tokens exceed the model's context of "
            f"{model.cfg.max_seq_len}; shorten the prompt or reset the steps"
        )
    return ids


@torch.inference_mode()
def _next_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The model's logits (V,) for the token after `ids` (cached: sliders reuse them)."""
    key = (id(model), tuple(ids))
    with _model_lock:
        if key in _logits_cache:
            _logits_cache.move_to_end(key)
            return _logits_cache[key]
        device = next(model.parameters()).device
        logits = model(torch.tensor([ids], device=device), last_token_only=True)[0, -1]
        logits = logits.float().cpu()
        _logits_cache[key] = logits
        while len(_logits_cache) > LOGITS_CACHE_SIZE:
            _logits_cache.popitem(last=False)
        return logits


def _piece(tokenizer: Any, token_id: int) -> str:
    """The token's text, or its bytes in hex when it is part of a character ("<e6 99>")."""
    return piece_label(model_vocabulary(tokenizer, "model").token_bytes(token_id))


@router.post("/next_tokens")
def next_tokens(body: NextTokens, request: Request) -> dict:
    """The top-k candidates for the next token: the model's own probabilities (temperature 1,
    no cut) and the distribution the sampler draws from under the given settings
    (infer.sampling.sampling_distribution), with its entropy in nats."""
    served = _served(request)
    model, tokenizer = served.model, served.tokenizer
    params = _params(body)
    ids = _prompt_ids(body, model, tokenizer)
    logits = _next_logits(model, ids)
    model_probs = torch.softmax(logits, dim=-1)  # (V,)
    probs = sampling_distribution(logits[None], params)[0]  # (V,)
    order = torch.argsort(logits, descending=True)[: body.k]  # by the model's own ranking
    kept = probs > 0
    entropy = -(probs[kept] * probs[kept].log()).sum().item()
    return {
        "prompt_tokens": len(ids) - len(body.ids),
        "continuation": tokenizer.decode(body.ids) if body.ids else "",
        "candidates": [
            {
                "id": int(i),
                "piece": _piece(tokenizer, int(i)),
                "model_prob": float(model_probs[i]),
                "prob": float(probs[i]),
            }
            for i in order
        ],
        "entropy": entropy,
        "top_prob": float(probs.max()),
        "kept": int(kept.sum()),
        "vocab_size": int(probs.numel()),
    }


@router.post("/sample")
def sample_next(body: NextTokens, request: Request) -> dict:
    """Draw one token the way the engine does (infer.sampling.sample), with `seed` if given."""
    served = _served(request)
    model, tokenizer = served.model, served.tokenizer
    params = _params(body)
    ids = _prompt_ids(body, model, tokenizer)
    logits = _next_logits(model, ids)
    token = int(sample(logits[None], params, make_generator(body.seed))[0])
    return {"id": token, "piece": _piece(tokenizer, token)}


# --- the attention explorer --------------------------------------------------------------------


class AttentionRequest(BaseModel):
    text: str = Field(min_length=1, max_length=2000)
    which: Literal["model", "embed_model"] = "embed_model"


@router.post("/attention")
def attention(body: AttentionRequest, request: Request) -> dict:
    """Every layer's and head's attention weights for `text` (inspect.attention_view), rounded
    to 5 decimals: weights[layer][head][query][key]."""
    served = _served(request)
    model = getattr(served, body.which, None)
    tokenizer = getattr(served, "tokenizer" if body.which == "model" else "embed_tokenizer", None)
    if model is None:
        flag = "--model" if body.which == "model" else "--embed-model"
        raise _bad(f"which: no {body.which} is loaded; start the server with {flag}")
    try:
        with _model_lock:
            view = attention_view(model, tokenizer, body.text, max_tokens=MAX_ATTENTION_TOKENS)
    except ValueError as err:
        raise _bad(f"text: {err}") from None
    weights = torch.stack(view.weights)  # (L, H, T, T)
    return {
        "name": getattr(served, "name" if body.which == "model" else "embed_name", None),
        "family": model.cfg.family,
        "tokens": view.query_tokens,
        "notes": view.notes,
        "n_layers": weights.shape[0],
        "n_heads": weights.shape[1],
        "weights": np.round(weights.cpu().numpy().astype(np.float64), 5).tolist(),
    }


# --- the 猫/累/它 worked example -------------------------------------------------------------


class WorkedExample(BaseModel):
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
def worked_example(body: WorkedExample) -> dict:
    """The worked example with edited vectors: numpy_ref.attention, the function
    numpy_ref.worked_example calls; divide_by_sqrt_d=False drops the 1/√d (scale 1), key_scale
    multiplies every Key (×10 pushes the softmax into saturation)."""
    d = len(body.q)
    for name, rows in (("K", body.K), ("V", body.V)):
        for n, row in enumerate(rows):
            if len(row) != d:
                raise _bad(f"{name}[{n}] has {len(row)} numbers: every row needs d={d}, as q")
    if len(body.K) != len(body.V):
        raise _bad(f"K has {len(body.K)} rows and V {len(body.V)}: one Key and Value per token")
    values = [body.key_scale, *body.q, *(x for row in body.K + body.V for x in row)]
    if not all(math.isfinite(x) for x in values):
        raise _bad("q, K, V and key_scale must be finite numbers")
    q = np.array(body.q)[None]  # (1, D): the one query, 它
    K = np.array(body.K) * body.key_scale  # (Tk, D)
    result = numpy_ref.attention(
        q, K, np.array(body.V), scale=None if body.divide_by_sqrt_d else 1.0
    )
    return {
        "weights": result.weights[0].tolist(),
        "output": result.output[0].tolist(),
        "scores": result.scores[0].tolist(),
        "scale": 1 / math.sqrt(d) if body.divide_by_sqrt_d else 1.0,
    }


# --- the token counter ------------------------------------------------------------------------


class TokenizeRequest(BaseModel):
    text: str = Field(max_length=MAX_TEXT_CHARS)


_cached_vocabulary = lru_cache(maxsize=None)(load_vocabulary)


@router.post("/tokenize")
def tokenize_text(body: TokenizeRequest, request: Request) -> dict:
    """The text's pieces and count under the loaded models' tokenizers, Qwen's and cl100k's."""
    served = _served(request)
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
            result = tokenize(body.text, vocabulary)
        except ValueError as err:  # e.g. a byte this vocabulary cannot encode
            results.append({"vocabulary": vocabulary.name, "error": str(err)})
            continue
        results.append(
            {"vocabulary": result.vocabulary, "count": result.count, "ids": result.ids,
             "pieces": result.pieces}
        )  # fmt: skip
    return {"characters": len(body.text), "results": results}


# --- the page --------------------------------------------------------------------------------


def mount_static(app: FastAPI) -> None:
    """Serve the page at `/` and its script and style under /lab/static/, from this package:
    no build step, no CDN."""
    app.mount("/lab/static", StaticFiles(directory=STATIC_DIR), name="lab-static")

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8")
