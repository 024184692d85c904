"""/v1/embeddings (serve --embed-model): texts or token ids as vectors from the embedding model,
as floats or base64, tokenized off the event loop and run on the engine thread between two
decode steps, as every forward of the server.
"""

from __future__ import annotations

import asyncio
import base64
from functools import partial
from typing import Any

import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from glassformer.infer.embed import embed
from glassformer.server.protocol import APIError, EmbeddingRequest, engine_stopped
from glassformer.server.requests import check_ids, encoded, read_body
from glassformer.server.scheduler import Stopped

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> dict:
    body = await read_body(request, EmbeddingRequest)
    request.state.ignored_fields = body.ignored_fields
    served = request.app.state.served
    if served.embed_model is None:
        raise APIError(
            404,
            f"no embedding model is loaded: start the server with --embed-model "
            f"(e.g. minilm); {body.model!r} cannot embed",
            "model",
            code="model_not_found",
        )
    if body.model != served.embed_name:
        raise APIError(
            404,
            f"model {body.model!r} is not served for embeddings: use {served.embed_name!r}",
            "model",
            code="model_not_found",
        )
    limit, vocab = served.embed_model.cfg.max_seq_len, served.embed_model.cfg.vocab_size

    def tokenize() -> list[list[int]]:  # in a worker thread: a 5 MB input took seconds
        sequences = []
        for i, item in enumerate(body.input):
            param = f"input.{i}" if len(body.input) > 1 else "input"
            if isinstance(item, str):
                ids = encoded(partial(served.embed_tokenizer.encode, item), param)
            else:
                ids = check_ids(item, vocab, param)
            if len(ids) > limit:
                raise APIError(
                    400,
                    f"{param} is {len(ids)} tokens; {body.model} reads at most {limit}: shorten it",
                    param,
                    code="context_length_exceeded",
                )
            sequences.append(ids)
        return sequences

    sequences = await run_in_threadpool(tokenize)

    def run() -> torch.Tensor:
        return embed(served.embed_model, sequences)

    try:  # on the engine thread, between two decode steps, as every forward here
        vectors = await asyncio.wrap_future(request.app.state.scheduler.call(run))
    except Stopped:
        raise engine_stopped() from None
    vectors = vectors.cpu().numpy().astype(np.float32)
    data = []
    for index, vector in enumerate(vectors):
        if body.encoding_format == "base64":
            value: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode()
        else:
            value = vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": value})
    n_tokens = sum(len(s) for s in sequences)
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }
