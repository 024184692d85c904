"""Servers for the side-by-side benchmarks, each a real process on a free loopback port, stopped
on exit: `glassformer serve` and llama.cpp's own `llama-server` (benchmarks/build_llama_cpp.sh).
Each is ready when its /health answers 200 (llama-server answers 503 while it loads); its log
goes to a temporary file whose end is shown if it exits or does not answer in time."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from llama_cpp_peer import llama_cpp_binary  # benchmarks/

from glassformer.lab.serving import free_port, stop_server

START_TIMEOUT_S = 300.0  # a GGUF file dequantized or repacked at start-up, on a busy machine


@contextmanager
def glassformer_server(args: list[str], threads: int) -> Iterator[str]:
    """`glassformer serve ARGS --threads THREADS`; yields its url."""
    command = [sys.executable, "-m", "glassformer", "serve", *args, "--threads", str(threads),
               "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    with _serving("glassformer serve", command, env) as url:
        yield url


@contextmanager
def llama_server(
    gguf: Path, threads: int, parallel: int, ctx_per_slot: int = 2048
) -> Iterator[str]:
    """llama.cpp's OpenAI-compatible server on `gguf`: `parallel` slots (continuous batching),
    `threads` threads for decode and prefill; yields its url."""
    binary = llama_cpp_binary("llama-server")
    if binary is None:
        raise FileNotFoundError("no llama-server: run bash benchmarks/build_llama_cpp.sh")
    command = [
        str(binary), "--model", str(gguf), "--threads", str(threads),
        "--threads-batch", str(threads), "--parallel", str(parallel),
        "--ctx-size", str(parallel * ctx_per_slot), "--no-webui", "--jinja",
    ]  # fmt: skip
    with _serving("llama-server", command, dict(os.environ)) as url:
        yield url


@contextmanager
def _serving(name: str, command: list[str], env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    command = [*command, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=log, text=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _healthy(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    why = "exited" if process.poll() is not None else "did not answer /health"
                    raise RuntimeError(f"{name} {why}; its log ends:\n{log.read()[-2000:]}")
                time.sleep(0.2)
            yield url
        finally:
            stop_server(process)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
