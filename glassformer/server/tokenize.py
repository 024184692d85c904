"""/tokenize and /detokenize (vLLM's extras): a prompt or a conversation as the served model's
token ids, with the context they must fit in, and ids back as text. Neither runs the model.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from glassformer.server.protocol import APIError, DetokenizeRequest, TokenizeRequest
from glassformer.server.requests import check_ids, check_model, read_body

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> dict:
    body = await read_body(request, TokenizeRequest)
    served = request.app.state.served
    check_model(served, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give one of prompt or messages", "prompt")
    tokenizer = served.tokenizer
    if body.messages is not None and not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"{served.name} has no chat template: send a prompt", "messages")
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.content}
        for m in body.messages or []
    ]

    def encode() -> list[int]:
        if body.prompt is not None:
            return tokenizer.encode(body.prompt)
        return tokenizer.encode_chat(messages)

    try:
        ids = await run_in_threadpool(encode)
    except ValueError as err:
        param = "prompt" if body.prompt is not None else "messages"
        raise APIError(400, str(err), param) from None
    context = request.app.state.scheduler.engine.slot_len
    return {"tokens": ids, "count": len(ids), "max_model_len": context}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict:
    body = await read_body(request, DetokenizeRequest)
    served = request.app.state.served
    check_model(served, body.model)
    ids = check_ids(body.tokens, served.model.cfg.vocab_size, "tokens")
    return {"prompt": await run_in_threadpool(served.tokenizer.decode, ids)}
