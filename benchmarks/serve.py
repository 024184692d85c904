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

--memory N instead sends N short requests (8 at a time) and prints the server's resident memory
after a warm-up and at the end: it should stay flat (the bound is checked here, not in a test).

llama-cpp-python's OpenAI server is not compared: it is not installed here.

    python benchmarks/serve.py --threads 2
    python benchmarks/serve.py --clients 1 4 --new-tokens 16      # a quick check
    python benchmarks/serve.py --memory 1000 --threads 2
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
from pathlib import Path

import httpx
import openai

MODEL = "smollm2"


def start_server(threads: int, max_batch: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    command = [
        sys.executable, "-m", "glassformer", "serve", "--model", MODEL, "--port", str(port),
        "--threads", str(threads), "--max-batch", str(max_batch), "--max-queue", "256",
        "--prefix-cache-mb", "0", "--log-level", "warning",
    ]  # fmt: skip
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
    args = parser.parse_args()
    process, url = start_server(args.threads, args.max_batch)
    try:
        if args.memory:
            asyncio.run(memory_check(url, process.pid, args.memory))
            return
        asyncio.run(run(url, prompts(2, 16), 4, together=True))  # warm-up
        header = f"{'clients':>7} {'tok/s conc':>11} {'tok/s seq':>10} {'ratio':>6} "
        print(header + f"{'p50 TTFT conc':>14} {'p99 TTFT conc':>14} {'p50 TTFT seq':>13}")
        for c in args.clients:
            batch = prompts(c, args.prompt_tokens)
            runs = []  # (concurrent, sequential) pairs, alternating, so drift hits both alike
            for _ in range(args.repeats):
                conc = asyncio.run(run(url, batch, args.new_tokens, together=True))
                seq = asyncio.run(run(url, batch, args.new_tokens, together=False))
                runs.append((conc, seq))
            conc_ttfts = [t for conc, _ in runs for t in conc["ttfts"]]
            seq_ttfts = [t for _, seq in runs for t in seq["ttfts"]]
            print(
                f"{c:>7} {statistics.median(conc['tok_s'] for conc, _ in runs):>11.1f} "
                f"{statistics.median(seq['tok_s'] for _, seq in runs):>10.1f} "
                f"{statistics.median(conc['tok_s'] / seq['tok_s'] for conc, seq in runs):>5.2f}x "
                f"{percentile(conc_ttfts, 0.5):>13.3f}s {percentile(conc_ttfts, 0.99):>13.3f}s "
                f"{percentile(seq_ttfts, 0.5):>12.3f}s",
                flush=True,
            )
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
