"""A real `glassformer serve` process for the lab's serving claims (seed 002 「KV Cache」 and 练习
2 第 4 步): a free loopback port, one torch thread, no prefix reuse (every request prefills its
whole prompt, as a first request to an API does), /health polled until it answers. Beside it
the same model (at the precision the server runs, the file's own) and tokenizer in this
process, the independent reference for what it bills. In
tiny mode the model is a random 2-layer one with SmolLM2's tokenizer and chat template.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from glassformer.lab.base import RunContext

HEALTH_TIMEOUT_S = 120.0  # SmolLM2's GGUF dequantises at start-up: seconds, on a busy machine


@dataclass
class Served:
    """A running server (url, the name clients send as `model`) and its model in this process."""

    url: str
    name: str
    model: torch.nn.Module
    tokenizer: Any
    description: str

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_chat_folder(folder: Path, seed: int) -> Path:
    """A random 2-layer SmolLM2-shaped model with SmolLM2's tokenizer, saved as a Hugging Face
    folder; its weights scaled up so greedy choices have no near-ties (a server and this process
    then pick the same tokens although their matmuls batch differently)."""
    from glassformer.config import ModelConfig
    from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf
    from glassformer.interop.hf import save_hf_model
    from glassformer.interop.pretrained import resolve
    from glassformer.models import build_model

    tokenizer = tokenizer_from_gguf(read_gguf(resolve("smollm2")))
    cfg = ModelConfig(
        vocab_size=tokenizer.hf.get_vocab_size(),
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=512,
        position="rope",
        norm="rms",
        ffn="swiglu",
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)
    save_hf_model(model, folder)
    tokenizer.save(folder)
    return folder


@contextmanager
def serve(ctx: RunContext, max_seq_len: int, extra_args: tuple[str, ...] = ()) -> Iterator[Served]:
    """SmolLM2-135M served (tiny mode: the random stand-in), stopped on exit."""
    from glassformer.interop.pretrained import from_pretrained

    with tempfile.TemporaryDirectory(prefix="glassformer-lab-serve-") as tmp:
        if ctx.tiny:
            model_arg = str(tiny_chat_folder(Path(tmp) / "tinychat", ctx.seed))
            description = "SmolLM2-shaped stand-in (2 random layers, SmolLM2's tokenizer)"
        else:
            model_arg, description = "smollm2", "SmolLM2-135M-Instruct"
        process, url = start(model_arg, max_seq_len, extra_args)
        try:
            # the precision the server runs it in: the file's own (its 4-bit blocks)
            model, tokenizer = from_pretrained(model_arg, quantize="file")
            name = Path(model_arg).name if ctx.tiny else model_arg
            yield Served(url, name, model, tokenizer, description)
        finally:
            stop_server(process)


def start(model_arg: str, max_seq_len: int, extra_args: tuple[str, ...]):
    """(process, url) of `glassformer serve` for the lab: prefix reuse off, one row at a time."""
    args = [
        "--model",
        model_arg,
        "--max-batch",
        "1",
        "--prefix-cache-mb",
        "0",
        "--max-seq-len",
        str(max_seq_len),
        *extra_args,
    ]
    return start_server(args, timeout=HEALTH_TIMEOUT_S)


def start_server(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 90.0
) -> tuple[subprocess.Popen, str]:
    """(process, url) of `glassformer serve ARGS` on a free loopback port with one torch thread,
    once /health answers (the lab's serving claims and the tests that drive a server use it)."""
    import httpx

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    command = [
        sys.executable,
        "-m",
        "glassformer",
        "serve",
        *args,
        "--port",
        str(port),
        "--threads",
        "1",
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"glassformer serve exited: {process.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    stop_server(process)
    raise RuntimeError(f"glassformer serve did not answer /health within {timeout:g} s")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
