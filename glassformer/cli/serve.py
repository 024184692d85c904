"""`glassformer serve`: the OpenAI-compatible API and the browser lab on uvicorn (the stack vLLM's
and litgpt's OpenAI servers use). The server itself lives in glassformer/server/."""

from __future__ import annotations

import argparse
import sys

from glassformer.cli.common import (
    DecodeOptions,
    add_command,
    add_decode_flags,
    add_thinking_flags,
    load_for_decode,
    load_with_tokenizer,
    positive_int,
    thinking_options,
)


def cmd_serve(args: argparse.Namespace) -> None:
    """serve a model over an OpenAI-compatible HTTP API (and the browser lab at /)

    GET /v1/models, POST /v1/completions, /v1/chat/completions (streaming with stream: true) and
    /v1/embeddings (with --embed-model), GET /health and /metrics (Prometheus). Concurrent
    requests share decode steps (continuous batching); a chat that extends a recent conversation
    prefills only its new part. Binds 127.0.0.1 unless --host says otherwise.
    """
    import uvicorn

    from glassformer.server.app import Served, ServerOptions, create_app, served_name

    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty: give a key, or drop the flag to serve without one")
    options = DecodeOptions.from_args(args)
    model, tokenizer = load_for_decode(args.model, options, "serve needs one to encode text")
    thinking, _ = thinking_options(args, tokenizer, args.model)  # checks the flags
    served = Served(model, tokenizer, served_name(args.model))
    if args.embed_model:
        embed_model, embed_tokenizer = load_with_tokenizer(
            args.embed_model, "serve needs one to encode the texts to embed"
        )
        if embed_model.cfg.family != "bert":
            raise ValueError(
                f"--embed-model {args.embed_model} is a {embed_model.cfg.family!r} model: "
                "embeddings need an encoder (family 'bert'), e.g. --embed-model minilm"
            )
        served.embed_model, served.embed_tokenizer = embed_model, embed_tokenizer
        served.embed_name = served_name(args.embed_model)
    server_options = ServerOptions(
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        api_key=args.api_key,
        max_seq_len=args.max_seq_len,
        prefix_cache_bytes=args.prefix_cache_mb * 2**20,
        thinking_budget=thinking.get("thinking_budget"),
    )
    app = create_app(served, server_options)
    print(
        f"serving {served.name} on http://{args.host}:{args.port} (OpenAI API at /v1, "
        f"the lab at /); Ctrl-C stops",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "serve", cmd_serve)
    add_thinking_flags(p)
    p.add_argument(
        "--model", required=True, help="alias (smollm2), Hugging Face folder, .gguf file or run"
    )
    p.add_argument(
        "--embed-model", help="an encoder for /v1/embeddings, e.g. minilm (default: none)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=8,
        help="rows decoded together; more requests wait in the queue (default 8)",
    )
    p.add_argument(
        "--max-queue",
        type=positive_int,
        default=64,
        help="rows that may wait for a slot; beyond this a request gets 429 (default 64)",
    )
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: open)",
    )
    p.add_argument(
        "--max-seq-len",
        type=positive_int,
        help="positions per request: prompt + reply (default: the model's context, at most 2048)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=256,
        help="KV-cache MiB that finished conversations may keep for their next turn (default "
        "256; 0 turns prefix reuse off)",
    )
    p.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn's log level (default info)",
    )
    add_decode_flags(p)
