"""The browser lab's edge (server/lab.py): its bodies read and refused the way /v1 reads and
refuses them (protocol.py's `validate` and OpenAI's error object, a 400 that names the field),
its prompts held to the context the /v1 routes allow, its work on the served model handed to
the engine thread, and no NaN or infinity ever sent to the page, which cannot draw one (and
JSON cannot carry one).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict

from glassformer import numpy_ref
from glassformer.server.protocol import APIError, engine_stopped, parse_json, validate
from glassformer.server.scheduler import Stopped

FLOAT64_MAX = np.finfo(np.float64).max  # 1.8e308


class LabBody(BaseModel):
    """A lab request body: unknown fields refused, values not cast ("0.7" is not a number), and
    no NaN or infinity (JSON's `NaN`, or 1e999, which Python's parser reads as inf)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def served_models(request: Request) -> Any:
    served = getattr(request.app.state, "served", None)
    if served is None:
        raise APIError(
            503, "no model is loaded: start the server with --model", kind="server_error"
        )
    return served


def served_context(request: Request) -> int:
    """The served model's context as /v1 has it: the engine's positions per row slot."""
    return request.app.state.scheduler.engine.slot_len


async def on_engine_thread(request: Request, work: Callable[[], Any]) -> Any:
    """work() run by the engine thread between two decode steps (Scheduler.call), awaited
    without blocking the event loop: the way every lab forward of the served model runs, so
    that no decode step can reach a capture's hooks, and no lab forward a capture's."""
    try:
        return await asyncio.wrap_future(request.app.state.scheduler.call(work))
    except Stopped:
        raise engine_stopped() from None


async def read_body(request: Request, model: type[BaseModel]) -> Any:
    """The body validated as `model` with /v1's parser and messages, in a worker thread (a body
    may be up to --max-body-bytes of JSON)."""
    raw = await request.body()
    return await run_in_threadpool(lambda: validate(model, parse_json(raw)))


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code=code)


def check_context(
    n_tokens: int, context: int, param: str, what: str = "the prompt", room: int = 0
) -> None:
    """Refuse, as /v1 does, `what` of n_tokens that leaves fewer than `room` positions of the
    context (room=1: a next token must still fit, as for a completion)."""
    if n_tokens + room > context:
        most = context - room
        raise bad(
            f"{what} is {n_tokens} tokens; the context is {context}: shorten it to at most "
            f"{most} tokens",
            param,
            code="context_length_exceeded",
        )


# --- no NaN, no infinity -------------------------------------------------------------------


def first_non_finite(value: Any, path: str = "") -> tuple[str, float] | None:
    """The first float in a JSON-like tree that is NaN or infinite, as (path, value)."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), v) for key, v in value.items())
    elif isinstance(value, (list, tuple)):
        try:  # a row of numbers (an attention row: thousands per reply) checked at C speed
            if all(map(math.isfinite, value)):
                return None
        except TypeError:  # not numbers only: look inside
            pass
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for where, child in items:
        found = first_non_finite(child, where)
        if found is not None:
            return found
    return None


def finite(payload: dict) -> dict:
    """The payload, or a 500 naming its first NaN/inf: the inputs were finite (LabBody), so a
    non-finite answer is the computation's failure, never something to hand the page."""
    found = first_non_finite(payload)
    if found is not None:
        where, value = found
        raise APIError(
            500,
            f"{where} came out {value}, not a finite number, so the server does not send it: "
            "the model overflows its number format on this input; try another input",
            kind="server_error",
            code="non_finite_result",
        )
    return payload


def _g(x: float) -> str:
    return f"{x:g}"


def _log_abs(x: np.ndarray | float) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(np.abs(x))  # 0 -> -inf: a zero factor blames nothing


def worked_attention(
    q: list[float], K: list[list[float]], V: list[list[float]], key_scale: float, scale: float
) -> numpy_ref.AttentionResult:
    """numpy_ref.attention of one query (1, D) against K x key_scale (Tk, D) and V (Tk, D), or a
    400 naming the input number that makes a score overflow float64 (the softmax is then NaN).
    The outputs cannot overflow: each is a weighted mean of finite Values."""
    q_, K_, V_ = np.array(q), np.array(K), np.array(V)
    with np.errstate(over="ignore", invalid="ignore"):
        result = numpy_ref.attention(q_[None], K_ * key_scale, V_, scale=scale)
    bad_scores = np.flatnonzero(~np.isfinite(result.scores[0]))
    if bad_scores.size:
        raise _score_overflow(q_, K_, key_scale, scale, int(bad_scores[0]))
    return result  # finite scores: finite weights, and each output a mean of finite Values


def _score_overflow(
    q: np.ndarray, K: np.ndarray, key_scale: float, scale: float, t: int
) -> APIError:
    """Score t = sum_i q[i] K[t][i] key_scale scale overflowed: blame the largest number of its
    largest term."""
    terms = _log_abs(q) + _log_abs(K[t]) + _log_abs(key_scale)  # (D,) log |term| / scale
    i = int(np.argmax(terms))
    factors = {f"q[{i}]": q[i], f"K[{t}][{i}]": K[t, i], "key_scale": key_scale}
    name = max(factors, key=lambda n: abs(factors[n]))
    term = " × ".join(f"{n}={_g(v)}" for n, v in factors.items())
    return bad(
        f"{name}={_g(factors[name])} makes the scores overflow: score {t} (q·K[{t}] × key_scale "
        f"× scale {_g(scale)}) passes float64's largest number, {FLOAT64_MAX:.1e} (its largest "
        f"term is {term}), so the softmax is NaN; use numbers below about 1e150",
        _param(name),
        code="non_finite_result",
    )


def _param(name: str) -> str:
    """A place named as /v1 names a field's: K[1][0] -> "K.1.0"."""
    return name.replace("][", ".").replace("[", ".").replace("]", "")
