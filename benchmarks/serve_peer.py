"""`glassformer serve` beside llama.cpp's own `llama-server` (issue 36), on the same GGUF file
at equal precision, driven by the official `openai` client.

For each precision, one file both servers load: int4 is the shipped SmolLM2-135M Q4_1 file;
int8 and fp32 are llama.cpp's requantizations of it (llama-quantize into Q8_0 and F32, so both
servers read the same numbers). glassformer runs a file at its own precision by default (Q4_1
as int4, Q8_0 as int8, F32 as fp32); llama-server runs it as it is. Both get --threads threads
and as many slots as the largest client count (llama-server's --parallel, glassformer's
--max-batch), each with its own prompt reuse as it comes (distinct prompts share little).

Per precision, client count C and new-token count N: C streaming completions at once, distinct
--prompt-tokens prompts (windows of Shakespeare, new ones in every case and run: no prompt
reaches a server twice), exactly N new tokens each (ignore_eos), the two servers alternating,
--runs times. It prints the aggregate tokens/s (the streams' usage over the wall time, median
of the runs), p50/p99 time to first token and p50/p99 inter-token gap (pooled over the runs),
and glassformer's ratio. One client's decode rate through the server
(after its first token) is set beside the engine's in this process on the same file, the
engine run after the two servers in each run (target: >= 95%), with the openai client and with a
bare one (http.client, next to no CPU: the server's own cost, without the client's share of the
two cores); the openai client's CPU a token is counted too, and the most of the engine's rate
that any server could give it on these cores (client_ceiling). --shared-prefix T adds a run
where every prompt starts with the same T tokens: the prefix cache's hit (glassformer's
usage.prompt_tokens_details.cached_tokens) and TTFT.
llama-server stores keys and values in f16 by default, and so does glassformer serve here
(--kv-cache-dtype fp16, the default of this benchmark; fp32 or bf16 to compare others).

    bash benchmarks/build_llama_cpp.sh                        # llama-server, llama-quantize
    python benchmarks/serve_peer.py --threads 2
    python benchmarks/serve_peer.py --precisions int4 --clients 1 8 --new-tokens 64 --runs 1
    python benchmarks/serve_peer.py --runs 2 --new-tokens 64 \
        --json benchmarks/results/serve_peer.json
    python benchmarks/serve_peer.py --runs 1 --new-tokens 256 --shared-prefix 0 \
        --json benchmarks/results/serve_peer_256.json
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from itertools import pairwise
from pathlib import Path

import openai
import record  # benchmarks/record.py
import torch
from llama_cpp_peer import (
    LLAMA_CPP_TYPES,
    llama_cpp_binary,
    llama_cpp_version,
    quantized_with_binary,
)
from serve import percentile  # benchmarks/serve.py: nearest-rank
from servers import glassformer_server, llama_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The file's own precision, except w8a8 / w4a8: its int8 / int4 weights with every input rounded
# to int8 too (--quantize), the arithmetic llama.cpp uses for Q8_0 and Q4_1
ROUNDED_INPUTS = ("w8a8", "w4a8")


def text_prompts(tokenizer, n: int, length: int, shared: int = 0, first: int = 0) -> list[str]:
    """n distinct prompts of about `length` tokens: windows first..first + n - 1 of Shakespeare,
    `length` tokens each and none overlapping another, each after the same `shared` tokens when
    shared > 0. Each case and run of compare() takes windows no earlier one took, so no prompt
    reaches a server twice and time to first token is a prefill's (llama-server keeps every
    prompt it served in an 8 GiB cache in RAM, --cache-ram; glassformer keeps finished rows'
    keys/values in its free slots): only the shared-prefix run measures what a cache saves."""
    from glassformer.data import shakespeare_plays

    text = "\n".join(shakespeare_plays("modern").values())[:400_000]
    ids = tokenizer.encode(text, add_special_tokens=False)
    body = ids[: len(ids) - shared]
    if (first + n) * length > len(body):
        raise ValueError(
            f"{first + n} windows of {length} tokens need {(first + n) * length} tokens of text, "
            f"the corpus has {len(body)}: fewer --runs, clients or --prompt-tokens"
        )
    head = tokenizer.decode(ids[-shared:]) if shared else ""
    windows = range(first, first + n)
    return [head + tokenizer.decode(body[i * length : (i + 1) * length]) for i in windows]


class Server:
    def __init__(self, name: str, url: str, extra: dict) -> None:
        self.name, self.url, self.extra = name, url, extra
        models = openai.OpenAI(base_url=f"{url}/v1", api_key="none").models.list()
        self.model = models.data[0].id


async def stream(client, server: Server, prompt: str, new_tokens: int, extra: dict) -> dict:
    """One streamed completion: when it was sent, when each piece of text came, its usage."""
    sent = time.perf_counter()
    arrivals, cpu, usage = [], [], None
    response = await client.completions.create(
        model=server.model, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip
    async for chunk in response:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
            cpu.append(time.process_time())  # this process's: the client's, with one stream
        if chunk.usage is not None:
            usage = chunk.usage
    cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None)
    return {
        "ttft": arrivals[0] - sent,
        "gaps": [b - a for a, b in pairwise(arrivals)],
        "tokens": usage.completion_tokens,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": cached or 0,
        "decode_tok_s": (usage.completion_tokens - 1) / (arrivals[-1] - arrivals[0]),
        "client_cpu_s": (cpu[-1] - cpu[0]) / (len(cpu) - 1),  # per event, after the first
    }


def bare_stream(server: Server, prompt: str, new_tokens: int, burn_ms: float = 0.0) -> float:
    """One streamed completion read by a client that costs next to no CPU (http.client, one
    json.loads an event): its decode tokens/s, as stream() reckons it. The openai client spends
    a fraction of a millisecond of CPU on each event, on the same 2 cores as the step's threads;
    this one leaves the server's own cost. burn_ms > 0 spends that much CPU on each token
    (benchmarks/client_cpu.py: what a client's CPU costs on these cores)."""
    host, port = server.url.removeprefix("http://").split(":")
    body = {"model": server.model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}  # fmt: skip
    connection = http.client.HTTPConnection(host, int(port), timeout=900)
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    arrivals, tokens = [], None
    for line in iter(response.readline, b""):
        if not line.startswith(b"data: {"):
            continue
        now, event = time.perf_counter(), json.loads(line[6:])
        if event["choices"] and event["choices"][0]["text"]:
            arrivals.append(now)
            until = time.process_time() + burn_ms / 1000
            while time.process_time() < until:
                pass
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    connection.close()
    return (tokens - 1) / (arrivals[-1] - arrivals[0])


async def burst(server: Server, prompts: list[str], new_tokens: int, extra: dict) -> dict:
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=900) as c:
        start = time.perf_counter()
        streams = await asyncio.gather(*(stream(c, server, p, new_tokens, extra) for p in prompts))
        wall = time.perf_counter() - start
    return {"tok_s": sum(s["tokens"] for s in streams) / wall, "streams": streams}


def summarize(runs: list[dict]) -> dict:
    streams = [s for run in runs for s in run["streams"]]
    return {
        "tok_s": statistics.median(run["tok_s"] for run in runs),
        "p50_ttft_s": percentile([s["ttft"] for s in streams], 0.5),
        "p99_ttft_s": percentile([s["ttft"] for s in streams], 0.99),
        "p50_gap_ms": 1000 * percentile([g for s in streams for g in s["gaps"]], 0.5),
        "p99_gap_ms": 1000 * percentile([g for s in streams for g in s["gaps"]], 0.99),
        "decode_tok_s": statistics.median(s["decode_tok_s"] for s in streams),
        "prompt_tokens": statistics.median(s["prompt_tokens"] for s in streams),
        "cached_tokens": statistics.median(s["cached_tokens"] for s in streams),
    }


def client_ceiling(engine_tok_s: float, client_cpu_ms: float, threads: int) -> float:
    """The most of the engine's rate that any server can deliver to a client which spends
    client_cpu_ms of CPU on each token, on this machine's cores: a token costs the step's
    threads x its time, plus the client's CPU, and the cores give at most their count in CPU
    seconds a second. (With the openai client's ~0.5 ms and a 3 ms step on 2 threads and 2
    cores: 92%.) The server's own CPU per token would lower it further."""
    cores = len(os.sched_getaffinity(0))
    step = 1 / engine_tok_s
    return min(1.0, cores * step / (threads * step + client_cpu_ms / 1000))


class InProcess:
    """The engine in this process on the same file and precision (the CLI's: the file's own, the
    fused step), the same prompt: the one-client target's basis. compare() runs it between the
    servers' one-client runs, so that the three see the machine in the same minutes (on a
    shared machine the rate of either drifted by 10% from one minute to the next)."""

    def __init__(
        self, path: Path, prompt: str, threads: int, kv: str | None, quantize: str | None = None
    ) -> None:
        from glassformer.cli.common import DecodeOptions, decode_engine, load_for_decode

        options = DecodeOptions(threads=threads, kv_cache_dtype=kv, quantize=quantize)
        model, tokenizer = load_for_decode(str(path), options, "the benchmark needs one")
        self.engine = decode_engine(model, tokenizer, options)
        self.ids = tokenizer.encode(prompt)
        self.rate(8)  # warm-up: the kernels' first build, the cache's first pages

    def rate(self, new_tokens: int) -> float:
        """One generation's decode tokens/s (after its first token)."""
        import glassformer as gf
        from glassformer.infer.sampling import NO_EOS

        params = gf.SamplingParams(temperature=0.0, max_new_tokens=new_tokens, eos_token_id=NO_EOS)
        row = self.engine.add(self.ids, params)
        while not row.finished:
            self.engine.step()
        return row.stats.decode_tokens_per_s


def compare(args, precision: str, path: Path, tokenizer) -> tuple[list[dict], list[dict]]:
    """Both servers on one file: a row per server and case, and the one-client cases' engine
    rates in this process (each run: the two servers, then the engine)."""
    slots = max(args.clients)
    rows, engine = [], []
    prompt = text_prompts(tokenizer, 1, args.prompt_tokens)[0]
    quantize = precision if precision in ROUNDED_INPUTS else None
    in_process = InProcess(path, prompt, args.threads, args.kv_cache_dtype, quantize)
    with ExitStack() as stack:
        ours = ["--model", str(path), "--max-batch", str(slots), "--max-queue", "256"]
        ours += ["--kv-cache-dtype", args.kv_cache_dtype]
        ours += ["--quantize", quantize] if quantize else []
        url = stack.enter_context(glassformer_server(ours, args.threads))
        peer = stack.enter_context(
            llama_server(path, args.threads, parallel=slots, ctx_per_slot=args.prompt_tokens + 640)
        )
        servers = [
            Server(f"glassformer serve {precision}", url, {}),
            Server(f"llama-server {LLAMA_CPP_TYPES[precision]}", peer, {}),
        ]
        for server in servers:  # warm-up: first requests, the kernels' first compile
            asyncio.run(burst(server, text_prompts(tokenizer, 2, 16), 8, server.extra))
        drawn = 1  # windows of the prompts sent so far (the warm-up's lie in the first)
        cases = [(c, n, False) for n in args.new_tokens for c in args.clients]
        if args.shared_prefix:
            cases.append((max(args.clients), args.new_tokens[0], True))
        for clients, new_tokens, shared in cases:
            prefix = args.shared_prefix if shared else 0
            samples = {server.name: [] for server in servers}
            alone = clients == 1 and not shared
            engine_rates, bare_rates = [], []
            for _ in range(args.runs):
                prompts = text_prompts(tokenizer, clients, args.prompt_tokens, prefix, drawn)
                drawn += clients
                for server in servers:
                    samples[server.name].append(
                        asyncio.run(burst(server, prompts, new_tokens, server.extra))
                    )
                if alone:
                    bare_rates.append(bare_stream(servers[0], prompts[0], new_tokens))
                    engine_rates.append(in_process.rate(new_tokens))
            if alone:
                rate = statistics.median(engine_rates)
                runs = samples[servers[0].name]
                served = summarize(runs)["decode_tok_s"]
                cpu = [s["client_cpu_s"] for run in runs for s in run["streams"]]
                client_ms = 1000 * statistics.median(cpu)  # one stream: this process's CPU
                ceiling = client_ceiling(rate, client_ms, args.threads)
                bare = statistics.median(bare_rates)
                engine.append({"precision": precision, "new_tokens": new_tokens, "tok_s": rate,
                               "served_decode_tok_s": served, "served_vs_engine": served / rate,
                               "client_cpu_ms": client_ms, "client_ceiling": ceiling,
                               "bare_decode_tok_s": bare,
                               "bare_vs_engine": bare / rate})  # fmt: skip
                print(
                    f"{precision}, {new_tokens} tokens: one client's decode through the server "
                    f"{served:.1f} tok/s with the openai client, {bare:.1f} with a bare one: "
                    f"{served / rate:.0%} and {bare / rate:.0%} of the engine's {rate:.1f} in "
                    f"this process (runs in alternation); the openai client spent "
                    f"{client_ms:.2f} ms of CPU a token, which leaves any server at most "
                    f"{ceiling:.0%} of the engine on these cores",
                    flush=True,
                )
            pair = [summarize(samples[server.name]) for server in servers]
            for server, summary in zip(servers, pair, strict=True):
                row = {"precision": precision, "server": server.name, "clients": clients,
                       "new_tokens": new_tokens, "shared_prefix": prefix, **summary}  # fmt: skip
                rows.append(row)
            ratio = pair[0]["tok_s"] / pair[1]["tok_s"]
            label = f"{clients:>3} clients x {new_tokens:>3}" + (
                f", shared {prefix}" if prefix else ""
            )
            print(
                f"{precision} {label}: glassformer {pair[0]['tok_s']:6.1f} tok/s (TTFT p50 "
                f"{pair[0]['p50_ttft_s']:.2f} p99 {pair[0]['p99_ttft_s']:.2f} s, gap "
                f"{pair[0]['p50_gap_ms']:.1f} p99 {pair[0]['p99_gap_ms']:.0f} ms, cached "
                f"{pair[0]['cached_tokens']:.0f}) | llama-server {pair[1]['tok_s']:6.1f} (p50 "
                f"{pair[1]['p50_ttft_s']:.2f} p99 {pair[1]['p99_ttft_s']:.2f} s, gap "
                f"{pair[1]['p50_gap_ms']:.1f} p99 {pair[1]['p99_gap_ms']:.0f} ms) | "
                f"{ratio:.2f}x",
                flush=True,
            )
    return rows, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int8", "int4"],
                        choices=sorted(LLAMA_CPP_TYPES))  # fmt: skip
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument(
        "--shared-prefix", type=int, default=512, metavar="TOKENS",
        help="the shared-prefix run's common prompt head (0: no such run)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--kv-cache-dtype", choices=["fp32", "bf16", "fp16"], default="fp16",
        help="glassformer's key/value cache (default fp16: llama-server's own default, f16)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every row here (benchmarks/results/)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if llama_cpp_binary("llama-server") is None:
        raise SystemExit("llama-server is not built: bash benchmarks/build_llama_cpp.sh")
    from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf
    from glassformer.interop.pretrained import resolve

    source = resolve("smollm2")
    tokenizer = tokenizer_from_gguf(read_gguf(source))
    rows, engine = [], []
    with tempfile.TemporaryDirectory(prefix="glassformer-serve-peer-") as tmp:
        for precision in args.precisions:
            kind = LLAMA_CPP_TYPES[precision]
            path = source if kind == "Q4_1" else Path(tmp) / f"smollm2-{kind}.gguf"
            if path != source:
                quantized_with_binary(source, kind, path, args.threads)
            ours, in_process = compare(args, precision, path, tokenizer)
            rows += ours
            engine += in_process
    if args.json:
        settings = {"model": "SmolLM2-135M", "prompt_tokens": args.prompt_tokens, "runs": args.runs,
                    "llama_cpp": llama_cpp_version(),
                    "kv_cache": {"glassformer": args.kv_cache_dtype,
                                 "llama-server": "f16"}}  # fmt: skip
        record.write(args.json, args.threads, settings | {"rows": rows, "engine": engine})


if __name__ == "__main__":
    main()
