"""What the /v1 routes do with a request first: read and validate its body (a large one off the
event loop), check the model it names and the token ids it sends, and encode its text with a
tokenizer's refusals turned into 400s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from glassformer.server.protocol import APIError, parse_json, validate
from glassformer.templates import ConversationTooLong

# Bodies above this are parsed in a worker thread: a 10 MB prompt took seconds of JSON, validation
# and tokenizing, and on the event loop that stalled /health and every running stream.
BIG_BODY_BYTES = 256 * 1024


async def read_body(request: Request, model: type[BaseModel]) -> Any:
    """The request body parsed and validated as `model`, a large one off the event loop."""
    raw = await request.body()
    if len(raw) < BIG_BODY_BYTES:
        return validate(model, parse_json(raw))
    return await run_in_threadpool(lambda: validate(model, parse_json(raw)))


def check_model(served: Any, name: str) -> None:
    """A 404 unless `name` is the generation model this server serves."""
    if name != served.name:
        raise APIError(
            404,
            f"model {name!r} is not served here: use {served.name!r} (GET /v1/models)",
            "model",
            code="model_not_found",
        )


def check_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    """`ids`, or a 400 naming the first that is outside the vocabulary."""
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise APIError(
            400, f"token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}", param
        )
    return ids


def encoded(encode: Callable[[], list[int]], param: str) -> list[int]:
    """encode()'s ids, with what a tokenizer or template refuses, and an empty encoding, as a
    400 naming `param`."""
    try:
        ids = encode()
    except ConversationTooLong as err:  # too long to render: a length error, as a prompt's
        raise APIError(400, str(err), param, code="context_length_exceeded") from None
    except ValueError as err:  # uncodable bytes, a template that refuses the conversation
        raise APIError(400, str(err), param) from None
    if not ids:
        raise APIError(400, f"{param} encodes to no tokens: send some text", param)
    return ids
