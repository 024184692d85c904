"""What a streaming client's own CPU costs the server's decode rate when both share the machine's
cores (issue 36's target: one client's tokens/s through the server >= 95% of the engine's in
process, measured with the official `openai` client on the same 2 cores as the server).

One `glassformer serve` on SmolLM2's Q4_1 file, and in turn, --runs times: the engine in this
process (the basis), a bare client (http.client, next to no CPU a token), the same bare client
spending --burn milliseconds of CPU on each token (a busy loop: a client's parsing, made to
measure), and the `openai` client, each streaming 64 new tokens of a prompt no other run sent.
It prints each one's decode tokens/s (after the first token, medians) and its share of the
engine's. The engine's step keeps both cores busy and waits at a barrier for both threads many
times a token, so a client's CPU on either core holds up the whole step, not half of it. Where
llama.cpp's llama-server is built (benchmarks/build_llama_cpp.sh), the `openai` client also
streams from it, on the same file, for what the same client spends on another server's events.

    python benchmarks/client_cpu.py
    python benchmarks/client_cpu.py --burn 0.1 0.25 0.5 --runs 7 \\
        --json benchmarks/results/client_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from contextlib import ExitStack
from pathlib import Path

import openai
import record  # benchmarks/record.py
import torch
from llama_cpp_peer import llama_cpp_binary
from serve_peer import InProcess, Server, bare_stream, stream, text_prompts
from servers import glassformer_server, llama_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")


async def openai_stream(server: Server, prompt: str, new_tokens: int) -> dict:
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none") as client:
        return await stream(client, server, prompt, new_tokens, {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burn", type=float, nargs="+", default=[0.25, 0.5], metavar="MS")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write every row here (benchmarks/results/)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf
    from glassformer.interop.pretrained import resolve

    source = resolve("smollm2")
    tokenizer = tokenizer_from_gguf(read_gguf(source))
    clients = ["bare"] + [f"bare, {ms} ms of CPU a token" for ms in args.burn] + ["openai"]
    prompts = iter(text_prompts(tokenizer, 2 + args.runs * (len(clients) + 1), 128, first=1))
    engine = InProcess(source, next(prompts), args.threads, "fp16")
    peer = "openai, from llama-server" if llama_cpp_binary("llama-server") else None
    rates: dict[str, list[float]] = {"engine in process": [], **{name: [] for name in clients}}
    cpu: dict[str, list[float]] = {"openai": [], **({peer: []} if peer else {})}
    serve = ["--model", str(source), "--max-batch", "4", "--kv-cache-dtype", "fp16"]
    with ExitStack() as stack:
        server = Server(
            "glassformer", stack.enter_context(glassformer_server(serve, args.threads)), {}
        )
        servers = {"openai": server}
        if peer:
            url = stack.enter_context(
                llama_server(source, args.threads, parallel=4, ctx_per_slot=800)
            )
            servers[peer] = Server("llama-server", url, {})
            rates[peer] = []
        bare_stream(server, next(prompts), 8)  # warm-up
        for _ in range(args.runs):
            rates["engine in process"].append(engine.rate(args.new_tokens))
            for name, burn in zip(clients[:-1], [0.0, *args.burn], strict=True):
                rates[name].append(bare_stream(server, next(prompts), args.new_tokens, burn))
            for name, target in servers.items():
                streamed = asyncio.run(openai_stream(target, next(prompts), args.new_tokens))
                rates[name].append(streamed["decode_tok_s"])
                cpu[name].append(streamed["client_cpu_s"])
    basis = statistics.median(rates["engine in process"])
    rows = []
    for name, values in rates.items():
        rate = statistics.median(values)
        ours = name != peer  # llama-server's rate is its own engine's, not a share of ours
        row = {"client": name, "decode_tok_s": rate, "vs_engine": rate / basis if ours else None}
        if name in cpu:
            row["client_cpu_ms"] = 1000 * statistics.median(cpu[name])
        rows.append(row)
        share = f"{rate / basis:5.0%} of the engine" if ours else "(another engine)"
        spent = f" (its CPU: {row['client_cpu_ms']:.2f} ms a token)" if name in cpu else ""
        print(f"{name:32s} {rate:6.1f} tok/s  {share}{spent}")
    if args.json:
        settings = {"model": "SmolLM2-135M Q4_1", "new_tokens": args.new_tokens, "runs": args.runs}
        record.write(args.json, args.threads, settings | {"rows": rows})


if __name__ == "__main__":
    main()
