"""The lab's sampling view (server/lab.py's /lab/api/next_tokens and /lab/api/sample; seed 002
"采样"): the prompt's ids within the served context, the model's logits for the next token (one
forward on the engine thread, cached while sliders reshape them), and infer.sampling's
distribution and draw over them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from functools import partial
from typing import Any

import torch
from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from pydantic import Field

from glassformer.infer.sampling import SamplingParams, make_generator, sample, sampling_distribution
from glassformer.server.lab_edge import (
    LabBody,
    bad,
    check_context,
    finite,
    on_engine_thread,
    read_body,
    served_context,
    served_models,
)
from glassformer.server.protocol import APIError
from glassformer.tokenize import model_vocabulary, piece_label

MAX_CANDIDATES = 50
_cache_lock = threading.Lock()  # the logits cache is read by handlers, filled after forwards
_logits_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # (model id, ids) -> (V,)
LOGITS_CACHE_SIZE = 16  # a slider drag reshapes the same logits: one forward, many redraws


class NextTokens(LabBody):
    prompt: str  # held to the served context in tokens, as /v1's prompts
    chat: bool = Field(True, description="wrap the prompt in the model's chat template")
    ids: list[int] = Field(default_factory=list, description="tokens chosen so far")
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    k: int = Field(10, ge=1, le=MAX_CANDIDATES, description="candidates to list")
    seed: int | None = None


def params_of(body: NextTokens) -> SamplingParams:
    try:  # SamplingParams checks every value and says what is allowed
        return SamplingParams(
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            min_p=body.min_p,
            seed=body.seed,
        )
    except ValueError as err:
        param = str(err).partition("=")[0]
        raise bad(str(err), param if param in NextTokens.model_fields else None) from None


def prompt_ids(body: NextTokens, model: torch.nn.Module, tokenizer: Any, context: int) -> list:
    """The prompt's ids (in the chat template if asked) + the chosen ids, within the context
    with room for the next token, as /v1/completions asks of a prompt."""
    vocab = model.cfg.vocab_size
    bad_ids = [i for i in body.ids if not 0 <= i < vocab]
    if bad_ids:
        raise bad(f"ids: {bad_ids[0]} is outside the vocabulary 0..{vocab - 1}", "ids")
    try:
        if body.chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.encode_chat([{"role": "user", "content": body.prompt}])
        elif hasattr(tokenizer, "chat_template"):
            ids = tokenizer.encode(body.prompt, parse_special=False)
        else:
            ids = tokenizer.encode(body.prompt)
    except ValueError as err:  # a character the vocabulary cannot encode
        raise bad(f"prompt: {err}", "prompt") from None
    ids = list(ids) + body.ids
    if not ids:
        raise bad("prompt: the text encodes to no tokens; type something", "prompt")
    check_context(len(ids), context, "prompt", room=1)
    return ids


@torch.inference_mode()
def _forward_last(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The logits (V,) after `ids`: on the engine thread, so that no capture can be running
    while it does (this forward would land in the capture's sinks)."""
    device = next(model.parameters()).device
    return model(torch.tensor([ids], device=device), last_token_only=True)[0, -1].float().cpu()


async def next_logits(request: Request, model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The model's logits (V,) for the token after `ids` (cached: sliders reuse them)."""
    key = (id(model), tuple(ids))
    with _cache_lock:
        if key in _logits_cache:
            _logits_cache.move_to_end(key)
            return _logits_cache[key]
    logits = await on_engine_thread(request, partial(_forward_last, model, ids))
    if not torch.isfinite(logits).all():
        raise APIError(
            500,
            f"the model's logits after these {len(ids)} tokens are not all finite (NaN or inf): "
            "it overflows its number format on this input; try another prompt",
            kind="server_error",
            code="non_finite_result",
        )
    with _cache_lock:
        _logits_cache[key] = logits
        while len(_logits_cache) > LOGITS_CACHE_SIZE:
            _logits_cache.popitem(last=False)
    return logits


def piece(tokenizer: Any, token_id: int) -> str:
    """The token's text, or its bytes in hex when it is part of a character ("<e6 99>")."""
    return piece_label(model_vocabulary(tokenizer, "model").token_bytes(token_id))


async def _sampling_input(request: Request) -> tuple[Any, NextTokens, SamplingParams, list, Any]:
    """The request's served models, body, SamplingParams, prompt ids and next-token logits."""
    served = served_models(request)
    body = await read_body(request, NextTokens)
    params = params_of(body)
    get_ids = partial(prompt_ids, body, served.model, served.tokenizer, served_context(request))
    ids = await run_in_threadpool(get_ids)
    return served, body, params, ids, await next_logits(request, served.model, ids)


def _candidates(
    body: NextTokens, params: SamplingParams, ids: list, logits: torch.Tensor, tokenizer: Any
) -> dict:
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
                "piece": piece(tokenizer, int(i)),
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


async def next_tokens(request: Request) -> dict:
    """The top-k candidates for the next token: the model's own probabilities (temperature 1,
    no cut) and the distribution the sampler draws from under the given settings
    (infer.sampling.sampling_distribution), with its entropy in nats."""
    served, body, params, ids, logits = await _sampling_input(request)
    work = partial(_candidates, body, params, ids, logits, served.tokenizer)
    return finite(await run_in_threadpool(work))


async def sample_next(request: Request) -> dict:
    """Draw one token the way the engine does (infer.sampling.sample), with `seed` if given:
    its id, its piece, and its probability under the distribution next_tokens shows (prob) and
    under the model's own (model_prob)."""
    served, body, params, _, logits = await _sampling_input(request)
    token = int(sample(logits[None], params, make_generator(body.seed))[0])
    prob = sampling_distribution(logits[None], params)[0, token]
    return finite(
        {
            "id": token,
            "piece": piece(served.tokenizer, token),
            "prob": float(prob),
            "model_prob": float(torch.softmax(logits, dim=-1)[token]),
        }
    )
