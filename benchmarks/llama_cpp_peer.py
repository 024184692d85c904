"""llama.cpp as a benchmark peer, in two forms.

- Its own binaries (llama-server, llama-bench, llama-quantize), built by
  benchmarks/build_llama_cpp.sh into build/llama.cpp/bin (or found in $LLAMA_CPP_BIN): the
  servers' side-by-sides start `llama-server` on a GGUF file (benchmarks/servers.py);
  benchmarks/decode.py times batch-1 decoding with `llama-bench` on the shipped SmolLM2 Q4_1
  file and llama-quantize's requantizations of it (F32, BF16, Q8_0).
- llama-cpp-python (`pip install -e .[bench]`): llama.cpp's requantizations through its
  bindings (llama_model_quantize) into Q4_0 or Q4_K_M for benchmarks/quantization.py. (Its
  0.3.36 wheel built here segfaults in Llama.eval, so nothing here runs a model through it.)

Without either, no peer: the benchmarks run without these rows."""

from __future__ import annotations

import ctypes
import json
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
    are no tokens to compare."""

    def __init__(self, path: Path, threads: int) -> None:
        self.binary = llama_cpp_binary("llama-bench")
        if self.binary is None:
            raise FileNotFoundError("no llama-bench: run bash benchmarks/build_llama_cpp.sh")
        self.path, self.threads = path, threads
        self.bytes_per_token = path.stat().st_size  # nearly all of the file is weights

    def rate(self, prompt: int, new: int, depth: int) -> float:
        """llama-bench's tokens/s for one test: a prompt of `prompt` tokens or `new` generated
        ones, after `depth` tokens already in the cache."""
        command = [self.binary, "-m", self.path, "-t", self.threads, "-p", prompt, "-n", new,
                   "-d", depth, "-r", 1, "-o", "json"]  # fmt: skip
        result = subprocess.run([str(c) for c in command], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"llama-bench failed: {result.stderr[-1000:]}")
        return float(json.loads(result.stdout)[0]["avg_ts"])

    def __call__(self, prompts: list[list[int]], new_tokens: int):
        length = len(prompts[0])
        return length / self.rate(length, 0, 0), self.rate(0, new_tokens, length), None


# llama.cpp's file type for each precision: llama_ftype's names in llama-cpp-python
LLAMA_CPP_TYPES = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_1", "w8a8": "Q8_0",
                   "w4a8": "Q4_1"}  # fmt: skip
_FTYPES = {"F32": "LLAMA_FTYPE_ALL_F32", "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
           "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
           "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}  # fmt: skip


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
    """{kind: a GGUF file} for each kind of _FTYPES or "Q4_1" (the shipped SmolLM2 file),
    requantized by llama.cpp's own llama_model_quantize into `tmp`; {} without llama-cpp-python.
    """
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return {}
    import llama_cpp

    from glassformer.interop.pretrained import resolve

    _quiet_llama_cpp(llama_cpp)
    source = resolve("smollm2")
    files = {"Q4_1": source}
    for kind in kinds:
        if kind in files:
            continue  # the shipped file itself
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = (
            getattr(llama_cpp, _FTYPES[kind]), True, threads)  # fmt: skip
        target = tmp / f"smollm2-{kind}.gguf"
        status = llama_cpp.llama_model_quantize(
            str(source).encode(), str(target).encode(), ctypes.byref(params)
        )
        if status != 0:
            raise RuntimeError(f"llama_model_quantize to {kind} failed with status {status}")
        files[kind] = target
    return {kind: path for kind, path in files.items() if kind in kinds}


def _quiet_llama_cpp(llama_cpp) -> None:
    """Silence llama.cpp's own log (the quantizer prints a line per tensor)."""

    @llama_cpp.llama_log_callback
    def ignore(level, text, user_data):
        pass

    _quiet_llama_cpp.callback = ignore  # kept alive: C holds only the pointer
    llama_cpp.llama_log_set(ignore, ctypes.c_void_p(0))
