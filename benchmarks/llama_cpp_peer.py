"""llama.cpp as a benchmark peer: its own binaries, built by benchmarks/build_llama_cpp.sh into
build/llama.cpp/bin (or found in $LLAMA_CPP_BIN).

- `llama-server`: the servers' side-by-sides start it on a GGUF file (benchmarks/servers.py).
- `llama-bench`: benchmarks/decode.py times batch-1 decoding with it on the shipped SmolLM2
  Q4_1 file and llama-quantize's requantizations of it (F32, BF16, Q8_0).
- `llama-quantize`: those requantizations, and Q4_0 / Q4_K_M for benchmarks/quantization.py.
- `llama-window-ppl` (benchmarks/llama_window_ppl.c, built against the same libraries): the
  negative log-likelihood llama.cpp computes on given token windows, quantization.py's
  "llama.cpp ppl" column.

No Python bindings: llama-cpp-python's 0.3.36 wheel built on these machines segfaults in
Llama.eval. Without the binaries, no peer: the benchmarks run without these rows."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

BUILD = Path(__file__).resolve().parent.parent / "build" / "llama.cpp" / "bin"


def llama_cpp_binary(name: str) -> Path | None:
    """The llama.cpp binary `name` (llama-server, ...): in $LLAMA_CPP_BIN, else where
    benchmarks/build_llama_cpp.sh puts it, else on PATH; None when there is none."""
    folder = os.environ.get("LLAMA_CPP_BIN")
    for candidate in ([Path(folder) / name] if folder else []) + [BUILD / name]:
        if candidate.is_file():
            return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def llama_cpp_version() -> str | None:
    """Which llama.cpp: the llama-cpp-python sdist it was built from (build_llama_cpp.sh's
    VERSION file) and llama-server's own `--version` line; None without llama-server."""
    binary = llama_cpp_binary("llama-server")
    if binary is None:
        return None
    result = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "version" in line]
    sdist = binary.parent / "VERSION"
    source = f"llama-cpp-python {sdist.read_text().strip()} sdist, " if sdist.is_file() else ""
    return source + (lines[0].strip() if lines else "version unknown")


def quantized_with_binary(source: Path, kind: str, target: Path, threads: int) -> Path:
    """`source` requantized by llama.cpp's own llama-quantize into `kind` (F32, BF16, Q8_0,
    Q4_0, Q4_1, ...; --allow-requantize, since the shipped file is already Q4_1: F32 and BF16
    then hold its dequantized values, Q8_0 those values rounded to 8 bits), at `target`."""
    binary = llama_cpp_binary("llama-quantize")
    if binary is None:
        raise FileNotFoundError("no llama-quantize: run bash benchmarks/build_llama_cpp.sh")
    command = [binary, "--allow-requantize", source, target, kind, str(threads)]
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"llama-quantize to {kind} failed: {result.stderr[-1000:]}")
    return target


class LlamaBench:
    """llama.cpp's own llama-bench on one GGUF file, batch 1, called like decode.py's runners
    (prompts, new_tokens) -> (time to first token, decode tokens/s, None): the prompt's
    processing time (its length over llama-bench's prompt rate, -p) and the rate of new tokens
    after a prompt of that length is in the cache (-n at depth -d). One repetition per call, so
    the runs interleave with the other engines'. llama-bench feeds its own token ids, so there
    are no tokens to compare. `cache_type`: its keys' and values' type (-ctk/-ctv: "f16", its
    default, or "bf16"; this version of llama-bench takes no "f32")."""

    def __init__(self, path: Path, threads: int, cache_type: str = "f16") -> None:
        self.binary = llama_cpp_binary("llama-bench")
        if self.binary is None:
            raise FileNotFoundError("no llama-bench: run bash benchmarks/build_llama_cpp.sh")
        self.path, self.threads, self.cache_type = path, threads, cache_type
        self.bytes_per_token = path.stat().st_size  # nearly all of the file is weights

    def rate(self, prompt: int, new: int, depth: int) -> float:
        """llama-bench's tokens/s for one test: a prompt of `prompt` tokens or `new` generated
        ones, after `depth` tokens already in the cache."""
        command = [self.binary, "-m", self.path, "-t", self.threads, "-p", prompt, "-n", new,
                   "-d", depth, "-ctk", self.cache_type, "-ctv", self.cache_type, "-r", 1,
                   "-o", "json"]  # fmt: skip
        result = subprocess.run([str(c) for c in command], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"llama-bench failed: {result.stderr[-1000:]}")
        return float(json.loads(result.stdout)[0]["avg_ts"])

    def __call__(self, prompts: list[list[int]], new_tokens: int):
        length = len(prompts[0])
        return length / self.rate(length, 0, 0), self.rate(0, new_tokens, length), None


# llama.cpp's file type (llama-quantize's name for it) for each precision
LLAMA_CPP_TYPES = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_1", "w8a8": "Q8_0",
                   "w4a8": "Q4_1"}  # fmt: skip


def llama_cpp_files(name: str, precisions, tmp: Path, threads: int) -> dict[str, Path]:
    """{"Q4_1": the shipped SmolLM2 file, "F32"/"BF16"/"Q8_0": llama-quantize's requantization
    of it into `tmp`}, for the precisions asked, when llama-bench and llama-quantize are built
    and the model is SmolLM2; else {}."""
    if name != "smollm2" or not (
        llama_cpp_binary("llama-bench") and llama_cpp_binary("llama-quantize")
    ):
        return {}
    from glassformer.interop.pretrained import resolve

    source, files = resolve("smollm2"), {}
    for kind in (LLAMA_CPP_TYPES[p] for p in precisions):
        target = tmp / f"smollm2-{kind}.gguf"
        files[kind] = (
            source if kind == "Q4_1" else quantized_with_binary(source, kind, target, threads)
        )
    return files


def requantized_smollm2(kinds, tmp: Path, threads: int) -> dict[str, Path]:
    """{kind: a GGUF file} for each of `kinds` (llama-quantize's names: Q4_0, Q4_K_M, ...; Q4_1
    is the shipped SmolLM2 file itself), requantized by llama-quantize into `tmp`; {} when it
    is not built."""
    if not kinds or llama_cpp_binary("llama-quantize") is None:
        return {}
    from glassformer.interop.pretrained import resolve

    source = resolve("smollm2")
    return {
        kind: source
        if kind == "Q4_1"
        else quantized_with_binary(source, kind, tmp / f"smollm2-{kind}.gguf", threads)
        for kind in kinds
    }


def window_perplexity(path: Path, ids: list[int], window: int, threads: int) -> float | None:
    """exp(mean NLL) as llama.cpp computes it on the GGUF file at `path`: `ids` cut into
    non-overlapping windows of `window` tokens, each from an empty cache, every position
    predicting the next (llama-window-ppl); None when llama-window-ppl is not built."""
    binary = llama_cpp_binary("llama-window-ppl")
    if binary is None:
        return None
    windows = [ids[start : start + window] for start in range(0, len(ids) - 1, window)]
    windows = [w for w in windows if len(w) > 1]
    lines = "".join(" ".join(map(str, w)) + "\n" for w in windows)
    result = subprocess.run(
        [str(binary), str(path), str(threads)], input=lines, capture_output=True, text=True
    )
    sums = [line.split() for line in result.stdout.splitlines()]
    if result.returncode != 0 or len(sums) != len(windows):
        raise RuntimeError(
            f"llama-window-ppl scored {len(sums)} of {len(windows)} windows of {path.name}: "
            f"{result.stderr[-1000:]}"
        )
    return math.exp(sum(float(nll) for nll, _ in sums) / sum(int(n) for _, n in sums))
