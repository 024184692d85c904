"""`glassformer serve`: the OpenAI-compatible API and the browser lab on uvicorn (the stack vLLM's
and litgpt's OpenAI servers use). The server itself lives in glassformer/server/."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from dataclasses import replace

import torch
from torch import nn

from glassformer.calc import format_bytes, kv_cache_bytes, rnn_state_bytes
from glassformer.cli.common import (
    DecodeOptions,
    add_command,
    add_decode_flags,
    add_thinking_flags,
    load_for_decode,
    load_with_tokenizer,
    non_negative_int,
    non_negative_seconds,
    positive_int,
    tcp_port,
    thinking_options,
)
from glassformer.infer.prefill import MIN_SHARED_PREFIX, PREFILL_CHUNK
from glassformer.memory import available_memory_bytes
from glassformer.nn.quant import precision_name

_ADDRESS_HINT = "e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"


def check_address(host: str, port: int) -> None:
    """Refuse a --host/--port that uvicorn could not listen on, before the model loads, in one
    line (not uvicorn's traceback for a host that is not UTF-8, nor its exit 3 for 999.1.1.1 or
    a port in use). Every address the host resolves to is bound as asyncio's create_server binds
    it (SO_REUSEADDR, IPv6 only on IPv6 sockets), then closed: a socket that never listened
    leaves nothing behind, so uvicorn can bind the port right after."""
    if not host:
        raise ValueError(f"--host is empty: give an address to bind, {_ADDRESS_HINT}")
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not a valid host name"
        raise ValueError(
            f"--host {host!r} is not an address this machine can bind ({reason}): give an IP "
            f"address or host name, {_ADDRESS_HINT}"
        ) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(found):  # as asyncio, once each
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            if os.name == "posix":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as err:
                raise ValueError(_bind_error(host, port, err)) from None
    finally:
        for sock in sockets:
            sock.close()


def _bind_error(host: str, port: int, err: OSError) -> str:
    if err.errno == errno.EADDRINUSE:
        return (
            f"port {port} on {host} is in use (another server, or a serve still running): stop "
            "it, or pick another --port"
        )
    if err.errno == errno.EACCES:
        return f"port {port} needs privileges to bind: use a --port of 1024 or above, e.g. 8000"
    if err.errno == errno.EADDRNOTAVAIL:
        return (
            f"--host {host} is not an address of this machine: give one of its own, {_ADDRESS_HINT}"
        )
    return f"cannot bind {host}:{port} ({err.strerror}): check --host and --port"


def check_cache_fits(
    model: nn.Module,
    max_rows: int,
    slot_len: int,
    max_batch: int,
    kv_dtype: torch.dtype | None = None,
) -> None:
    """Refuse a --max-batch whose cache cannot fit, before the server allocates it at start:
    the engine reserves max_rows slots (running and parked rows) of slot_len positions each, in
    kv_dtype (None: the model's dtype)."""
    cfg = model.cfg
    if cfg.family == "bert" or next(model.parameters()).device.type != "cpu":
        return  # an encoder keeps no cache; a GPU's memory is not what /proc/meminfo counts
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(kv_dtype or dtype, "fp32")
    if cfg.family == "rnn":
        need = rnn_state_bytes(cfg, name) * max_rows
    else:
        need = kv_cache_bytes(cfg, slot_len, name, batch_size=max_rows)
    available = available_memory_bytes()
    if available is not None and need > available:
        raise ValueError(
            f"--max-batch {max_batch} reserves a cache of {max_rows:,} rows x {slot_len:,} "
            f"positions, {format_bytes(need)}, but {format_bytes(available)} of memory is "
            "available: lower --max-batch (or --max-seq-len)"
        )


def attach_rag_store(served, location: str, embed_model: str | None) -> None:
    """Open the store for /rag/search and the lab's RAG view. Its questions are embedded by
    --embed-model, which must be the store's encoder; without --embed-model the store's own
    encoder is loaded, and served for /v1/embeddings too."""
    from glassformer.rag import Encoder, Store
    from glassformer.server.app import served_name

    store = Store.open(location)
    if served.embed_model is None:
        encoder = Encoder.load(store.info.embed_model)
        served.embed_model, served.embed_tokenizer = encoder.model, encoder.tokenizer
        served.embed_name = served_name(encoder.name)
    else:
        encoder = Encoder(served.embed_model, served.embed_tokenizer, embed_model)
    store.check_encoder(encoder.name, encoder.dim)
    served.rag_store, served.rag_encoder = store, encoder


def cmd_serve(args: argparse.Namespace) -> None:
    """serve a model over an OpenAI-compatible HTTP API (and the browser lab at /)

    GET /v1/models, POST /v1/completions, /v1/chat/completions (streaming with stream: true) and
    /v1/embeddings (with --embed-model), GET /health and /metrics (Prometheus). Concurrent
    requests share decode steps (continuous batching); a chat that extends a recent conversation
    prefills only its new part. Binds 127.0.0.1 unless --host says otherwise.
    """
    import uvicorn

    from glassformer.server.app import Served, ServerOptions, create_app, served_name
    from glassformer.server.gate import resolve_api_key

    api_key = resolve_api_key(args.api_key, args.api_key_file, os.environ)
    check_address(args.host, args.port)
    options = DecodeOptions.from_args(args)
    # The engine thread runs every forward with --threads; this thread loads on one, so that
    # no second OpenMP team outlives the loading (Scheduler's docstring says why that matters).
    threads = args.threads or torch.get_num_threads()
    loading = replace(options, threads=1)
    model, tokenizer = load_for_decode(args.model, loading, "serve needs one to encode text")
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
    if args.rag_store:
        attach_rag_store(served, args.rag_store, args.embed_model)
    server_options = ServerOptions(
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        api_key=api_key,
        max_seq_len=args.max_seq_len,
        prefix_cache_bytes=args.prefix_cache_mb * 2**20,
        prompt_store_bytes=args.prompt_store_mb * 2**20,
        min_shared_prefix=args.min_shared_prefix,
        thinking_budget=thinking.get("thinking_budget"),
        request_timeout_s=args.request_timeout or None,
        max_body_bytes=args.max_body_mb * 2**20,
        prefill_chunk=args.prefill_chunk or None,
        huge_pages=True,  # the server owns the model it loaded: its decode steps stream faster
        kv_dtype=options.kv_dtype,
        threads=threads,
    )
    app = create_app(served, server_options)
    engine = app.state.scheduler.engine
    check_cache_fits(model, engine.max_rows, engine.slot_len, args.max_batch, options.kv_dtype)
    kv = f", {options.kv_cache_dtype} keys/values" if options.kv_cache_dtype else ""
    print(
        f"serving {served.name} ({precision_name(model)}{kv}) on http://{args.host}:{args.port} "
        "(OpenAI API at /v1, the lab at /); Ctrl-C stops",
        file=sys.stderr,
    )
    # loop and http "auto": uvloop and httptools, installed with glassformer (asyncio's loop and
    # h11 where uvloop does not build)
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
    p.add_argument(
        "--rag-store",
        help="a store built by `glassformer rag index`: POST /rag/search and the lab's RAG view "
        "(its encoder is loaded unless --embed-model names it)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=tcp_port, default=8000, help="port to listen on (default 8000)")
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
        help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: open; the "
        "key shows in ps: prefer --api-key-file or GLASSFORMER_API_KEY)",
    )
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="read the API key from the first line of PATH (default: $GLASSFORMER_API_KEY if "
        "set, else open)",
    )
    p.add_argument(
        "--max-seq-len",
        type=positive_int,
        help="positions per request: prompt + reply (default: the model's context, at most 2048)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=non_negative_int,
        default=256,
        help="KV-cache MiB that finished requests may keep parked for their next turn and for "
        "other prompts that start the same way (default 256; 0 parks nothing)",
    )
    p.add_argument(
        "--prompt-store-mb",
        type=non_negative_int,
        default=1024,
        help="MiB of keys/values that parked requests leave behind when their slots are needed, "
        "kept in memory for later prompts that start the same way (llama-server's --cache-ram; "
        "default 1024; 0 keeps none)",
    )
    p.add_argument(
        "--min-shared-prefix",
        type=non_negative_int,
        default=MIN_SHARED_PREFIX,
        metavar="TOKENS",
        help="the fewest prompt tokens a request copies from the keys/values of another "
        f"request that began the same way (default {MIN_SHARED_PREFIX}; 0: only a "
        "conversation's next turn reuses its own)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=non_negative_int,
        default=PREFILL_CHUNK,
        metavar="TOKENS",
        help="the most prompt tokens one engine step prefills, beside decoding the running "
        "requests: a long prompt, or many at once, is prefilled in chunks across steps, so "
        "running streams keep their pace (vLLM's max_num_batched_tokens, llama.cpp's "
        f"--batch-size). 0 prefills each new prompt whole, running streams waiting (default "
        f"{PREFILL_CHUNK})",
    )
    p.add_argument(
        "--request-timeout",
        type=non_negative_seconds,
        default=600.0,
        metavar="SECONDS",
        help="the most a request may take, queue included; past it its rows are cancelled and "
        "the client gets a 504 error (code request_timeout; in a stream, an error event then "
        "[DONE]). 0 turns the limit off (default 600)",
    )
    p.add_argument(
        "--max-body-mb",
        type=positive_int,
        default=16,
        metavar="MIB",
        help="the largest request body read, in MiB; a larger one gets a 413 before it is "
        "parsed (default 16: twice the largest real request, 2048 embedding inputs of 512 "
        "token ids; a 2048-token prompt is well under 1 MiB)",
    )
    p.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn's log level (default info)",
    )
    add_decode_flags(p)
