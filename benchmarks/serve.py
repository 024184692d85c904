"""`glassformer serve` under load (issue 15): concurrent streaming clients vs the same requests
one at a time, on SmolLM2-135M.

A real server process (the `glassformer serve` command) is started on a free loopback port and
driven by the official `openai` client: for each concurrency C in --clients, C requests with
distinct 128-token prompts (windows of Shakespeare) and 64 new tokens, streamed, all at once;
then the same C requests one after another (prefix reuse off, so no request starts from another's
cache). It prints, per C, the aggregate generated tokens/s
(completion tokens from each stream's usage over the wall time; the median of --repeats runs,
concurrent and sequential alternating) and p50/p99 time to first token (from sending a request
to its first text, pooled over the runs), concurrent vs sequential, and the median ratio.
Target (issue 15): 8 concurrent clients >= 3x the sequential aggregate tokens/s, p99 TTFT < 2 s.

--prefill-chunks A B ... instead compares servers that differ only in --prefill-chunk (0: each
prompt prefilled whole, the running streams waiting; all started at once, driven one at a time,
their order turned each repeat so drift hits them alike). Per server it prints, as medians of
the repeats: a burst of --burst-clients concurrent requests as above (tokens/s, p50 and p99
TTFT), and the join case: --running streams are decoding when --join-prompts new requests of
--join-tokens-long prompts arrive together; the running streams' inter-token gaps while those
prompts prefill (from the moment they are sent to the last one's first token; p50, p99, max)
and the new requests' p99 TTFT. Chunked prefill should keep the running streams' p99 gap near
one chunk plus a decode step, where whole prefills stall them for all the new prompts at once.

--memory N instead sends N short requests (8 at a time) and prints the server's resident memory
after a warm-up and at the end: it should stay flat (the bound is checked here, not in a test).

llama-cpp-python's OpenAI server is not compared: it is not installed here.

    python benchmarks/serve.py --threads 2
    python benchmarks/serve.py --clients 1 4 --new-tokens 16      # a quick check
    python benchmarks/serve.py --prefill-chunks 0 256 512 --threads 2 --repeats 5
    python benchmarks/serve.py --memory 1000 --threads 2

--json PATH also writes every row with the command, date and machine (benchmarks/record.py),
for benchmarks/render.py: the docs' tables are benchmarks/results/serve.json (--threads 2) and
serve_prefill_chunks.json (--prefill-chunks 0 256 512 1024 --threads 2 --repeats 5).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import httpx
import openai
import record  # benchmarks/record.py

MODEL = "smollm2"


def start_server(
    threads: int, max_batch: int, prefill_chunk: int | None = None
) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    command = [
        sys.executable, "-m", "glassformer", "serve", "--model", MODEL, "--port", str(port),
        "--threads", str(threads), "--max-batch", str(max_batch), "--max-queue", "256",
        "--prefix-cache-mb", "0", "--log-level", "warning",
    ]  # fmt: skip
    if prefill_chunk is not None:
        command += ["--prefill-chunk", str(prefill_chunk)]
    process = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if process.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("the server did not start within 60 s")


def prompts(n: int, length: int) -> list[list[int]]:
    """n distinct prompts of exactly `length` tokens: windows of Shakespeare."""
    from glassformer.data import shakespeare_plays
    from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf
    from glassformer.interop.pretrained import resolve

    tokenizer = tokenizer_from_gguf(read_gguf(resolve(MODEL)))
    text = "\n".join(shakespeare_plays("modern").values())[:200_000]
    ids = tokenizer.encode(text, add_special_tokens=False)
    stride = min(997, (len(ids) - length) // n)  # distinct windows that all fit in the text
    return [ids[i * stride : i * stride + length] for i in range(n)]


async def one(client: openai.AsyncOpenAI, prompt: list[int], new_tokens: int) -> tuple[float, int]:
    """(time to first token, completion tokens) of one streamed completion."""
    start = time.perf_counter()
    ttft, tokens = None, 0
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return (ttft if ttft is not None else time.perf_counter() - start), tokens


async def run(url: str, batch: list[list[int]], new_tokens: int, together: bool) -> dict:
    """One pass over `batch`: aggregate tokens/s and every request's time to first token."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=600) as client:
        start = time.perf_counter()
        if together:
            results = await asyncio.gather(*(one(client, p, new_tokens) for p in batch))
        else:
            results = [await one(client, p, new_tokens) for p in batch]
        wall = time.perf_counter() - start
    return {"tok_s": sum(n for _, n in results) / wall, "ttfts": [t for t, _ in results]}


async def arrivals(
    client: openai.AsyncOpenAI, prompt: list[int], new_tokens: int, times: list[float]
) -> None:
    """Stream one completion, appending the arrival time of each piece of text to `times`."""
    stream = await client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())


async def join(url: str, running: list[list[int]], joining: list[list[int]], args) -> dict:
    """The running streams decode; once each has 4 pieces of text the joining requests are sent
    together. Returns the running streams' gaps that overlap the joining prompts' prefill (sent
    until the last one's first text) and the joining requests' times to first text."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=600) as client:
        streams = [[] for _ in running]
        tasks = [
            asyncio.create_task(arrivals(client, p, args.running_new_tokens, t))
            for p, t in zip(running, streams, strict=True)
        ]
        while min(len(t) for t in streams) < 4:
            if any(task.done() for task in tasks):
                raise SystemExit("a running stream ended before the join: raise its max_tokens")
            await asyncio.sleep(0.005)
        sent = time.perf_counter()
        joined = [[] for _ in joining]
        pairs = zip(joining, joined, strict=True)
        await asyncio.gather(*(arrivals(client, p, 8, t) for p, t in pairs))
        await asyncio.gather(*tasks)
    prefilled = max(t[0] for t in joined)
    if any(t[-1] < prefilled for t in streams):
        print("warning: a running stream ended during the join; raise --running-new-tokens")
    gaps = [b - a for t in streams for a, b in pairwise(t) if b > sent and a < prefilled]
    return {"gaps": gaps, "ttfts": [t[0] - sent for t in joined]}


def compare_chunks(args) -> None:
    """The burst and the join case on one server per --prefill-chunks value, side by side."""
    servers = {c: start_server(args.threads, args.max_batch, c) for c in args.prefill_chunks}
    try:
        burst = prompts(args.burst_clients, args.prompt_tokens)
        few = prompts(args.running + args.join_prompts, args.join_tokens)
        running = [p[:16] for p in few[: args.running]]
        joining = few[args.running :]
        for _, url in servers.values():
            asyncio.run(run(url, prompts(2, 16), 4, together=True))  # warm-up
        results = {c: [] for c in servers}
        order = list(servers)
        for repeat in range(args.repeats):
            for c in order[repeat % len(order) :] + order[: repeat % len(order)]:
                url = servers[c][1]
                b = asyncio.run(run(url, burst, args.new_tokens, together=True))
                j = asyncio.run(join(url, running, joining, args))
                results[c].append((b, j))
                print(f"  repeat {repeat + 1}, prefill chunk {c}: done", file=sys.stderr)
        print_comparison(results, args)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=30)


def print_comparison(results: dict[int, list[tuple[dict, dict]]], args) -> None:
    median = statistics.median
    rows = {}
    for c, runs in results.items():
        rows[c] = {
            "tok_s": median(b["tok_s"] for b, _ in runs),
            "ttft50": median(percentile(b["ttfts"], 0.5) for b, _ in runs),
            "ttft99": median(percentile(b["ttfts"], 0.99) for b, _ in runs),
            "gap50": median(percentile(j["gaps"], 0.5) for _, j in runs),
            "gap99": median(percentile(j["gaps"], 0.99) for _, j in runs),
            "gapmax": median(max(j["gaps"]) for _, j in runs),
            "join99": median(percentile(j["ttfts"], 0.99) for _, j in runs),
        }
    base = rows[next(iter(rows))]
    if args.json:
        settings = {"model": "SmolLM2-135M", "burst_clients": args.burst_clients}
        settings |= {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
        settings |= {"running": args.running, "join_prompts": args.join_prompts}
        settings |= {"join_tokens": args.join_tokens, "repeats": args.repeats}
        records = [
            {
                "prefill_chunk": c,
                "tok_s": r["tok_s"],
                "p50_ttft_s": r["ttft50"],
                "p99_ttft_s": r["ttft99"],
                "p99_ttft_vs_first": r["ttft99"] / base["ttft99"],
                "gap_p50_s": r["gap50"],
                "gap_p99_s": r["gap99"],
                "gap_max_s": r["gapmax"],
                "gap_p99_vs_first": r["gap99"] / base["gap99"],
                "join_p99_ttft_s": r["join99"],
            }
            for c, r in rows.items()
        ]
        record.write(args.json, args.threads, {**settings, "rows": records})
    print(
        f"burst: {args.burst_clients} clients x {args.prompt_tokens}-token prompts, "
        f"{args.new_tokens} new tokens; join: {args.running} running streams, "
        f"{args.join_prompts} new {args.join_tokens}-token prompts; medians of {args.repeats}"
    )
    print(
        f"{'prefill chunk':>13} {'tok/s':>6} {'p50 TTFT':>9} {'p99 TTFT':>9} {'vs first':>8} "
        f"{'gap p50':>8} {'gap p99':>8} {'gap max':>8} {'vs first':>8} {'join p99 TTFT':>13}"
    )
    for c, r in rows.items():
        print(
            f"{c or 'off':>13} {r['tok_s']:>6.1f} {r['ttft50']:>8.3f}s {r['ttft99']:>8.3f}s "
            f"{r['ttft99'] / base['ttft99']:>7.2f}x {r['gap50']:>7.3f}s {r['gap99']:>7.3f}s "
            f"{r['gapmax']:>7.3f}s {r['gap99'] / base['gap99']:>7.2f}x {r['join99']:>12.3f}s"
        )


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: with few samples p99 is the largest, the conservative reading."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def memory_check(url: str, pid: int, n: int) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=600)
    batch = prompts(64, 48)  # one event loop for the whole check: the client lives in it

    async def wave(start: int, count: int) -> None:
        for first in range(start, start + count, 8):
            await asyncio.gather(
                *(one(client, batch[i % len(batch)], 16) for i in range(first, first + 8))
            )

    await wave(0, 48)
    before = rss_mib(pid)
    await wave(48, n)
    after = rss_mib(pid)
    print(f"server RSS after a 48-request warm-up: {before:.0f} MiB")
    print(f"server RSS after {n} more requests:    {after:.0f} MiB ({after - before:+.0f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per row: medians, pooled TTFTs"
    )
    parser.add_argument("--memory", type=int, metavar="N", help="run the memory check instead")
    parser.add_argument(
        "--prefill-chunk", type=int, help="the server's --prefill-chunk (default: serve's)"
    )
    parser.add_argument(
        "--prefill-chunks", type=int, nargs="+", metavar="TOKENS",
        help="compare servers with these --prefill-chunk values instead (0: whole prompts)",
    )  # fmt: skip
    parser.add_argument("--burst-clients", type=int, default=16)
    parser.add_argument("--running", type=int, default=4, help="streams decoding at the join")
    parser.add_argument("--running-new-tokens", type=int, default=64)
    parser.add_argument("--join-prompts", type=int, default=8)
    parser.add_argument("--join-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, help="also write every row here (benchmarks/results/)")
    args = parser.parse_args()
    if args.prefill_chunks:
        compare_chunks(args)
        return
    process, url = start_server(args.threads, args.max_batch, args.prefill_chunk)
    try:
        if args.memory:
            asyncio.run(memory_check(url, process.pid, args.memory))
            return
        asyncio.run(run(url, prompts(2, 16), 4, together=True))  # warm-up
        header = f"{'clients':>7} {'tok/s conc':>11} {'tok/s seq':>10} {'ratio':>6} "
        print(header + f"{'p50 TTFT conc':>14} {'p99 TTFT conc':>14} {'p50 TTFT seq':>13}")
        records = []
        for c in args.clients:
            batch = prompts(c, args.prompt_tokens)
            runs = []  # (concurrent, sequential) pairs, alternating, so drift hits both alike
            for _ in range(args.repeats):
                conc = asyncio.run(run(url, batch, args.new_tokens, together=True))
                seq = asyncio.run(run(url, batch, args.new_tokens, together=False))
                runs.append((conc, seq))
            conc_ttfts = [t for conc, _ in runs for t in conc["ttfts"]]
            seq_ttfts = [t for _, seq in runs for t in seq["ttfts"]]
            row = {
                "clients": c,
                "tok_s_concurrent": statistics.median(conc["tok_s"] for conc, _ in runs),
                "tok_s_sequential": statistics.median(seq["tok_s"] for _, seq in runs),
                "ratio": statistics.median(conc["tok_s"] / seq["tok_s"] for conc, seq in runs),
                "p50_ttft_concurrent_s": percentile(conc_ttfts, 0.5),
                "p99_ttft_concurrent_s": percentile(conc_ttfts, 0.99),
                "p50_ttft_sequential_s": percentile(seq_ttfts, 0.5),
            }
            records.append(row)
            print(
                f"{c:>7} {row['tok_s_concurrent']:>11.1f} {row['tok_s_sequential']:>10.1f} "
                f"{row['ratio']:>5.2f}x {row['p50_ttft_concurrent_s']:>13.3f}s "
                f"{row['p99_ttft_concurrent_s']:>13.3f}s {row['p50_ttft_sequential_s']:>12.3f}s",
                flush=True,
            )
        if args.json:
            settings = {"model": "SmolLM2-135M", "prompt_tokens": args.prompt_tokens}
            settings |= {"new_tokens": args.new_tokens, "repeats": args.repeats}
            record.write(args.json, args.threads, {**settings, "rows": records})
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
