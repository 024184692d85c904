"""Building the C kernels: which SIMD widths the CPU runs, the compiler flags for them, and
the compile itself, once per (sources, flags, compiler, CPU model) into the per-user cache
(~/.cache/glassformer/kernels). `load(avx512)` hands back the library with every entry point's
ctypes signature declared; glassformer.kernels decides when to ask for it (the switch) and what
to do without it (torch).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "matvec.c", HERE / "decode.c")  # built into one library
HEADERS = tuple(
    HERE / name
    for name in (
        *("simd.h", "groups.h", "a8.h", "amx.h"),
        *("tiles_a8.h", "tiles_split.h", "attention.h", "step.h"),
    )
)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
AVX512_FLAGS = ("-mavx512f", "-mavx512bw")  # 16-lane loops, where the CPU has them
VNNI_FLAGS = ("-mavx512vnni",)  # a8.h's byte dot products in one instruction, where it has those
# the tile unit: amx.h's int4 products, tiles_a8.h's byte ones, tiles_split.h's bf16 ones
AMX_FLAGS = ("-mamx-tile", "-mamx-int8", "-mamx-bf16", "-DGLASSFORMER_AMX")
# AMD's CPUs: the one-row fp32 and bf16 dots leave their weights to the hardware prefetcher
# (simd.h's FLOAT_PREFETCH, where the figures are)
AMD_FLAGS = ("-DFLOAT_PREFETCH=0",)


def has_amx() -> bool:
    """Whether the CPU has the tile unit with byte and bf16 products (Intel Xeons from Sapphire
    Rapids on)."""
    return {"amx_tile", "amx_int8", "amx_bf16", "avx512f", "avx512bw"} <= cpu_flags()


def cpu_info(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo ("flags", "vendor_id", "model name"); empty off
    Linux or off x86."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == field:
            return value.strip()
    return ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty off Linux or off x86)."""
    return set(cpu_info("flags").split())


def build_flags(avx512: bool | None = None, amx: bool = False) -> tuple[str, ...]:
    """Compiler flags: AVX2 + FMA, plus AVX-512 where `avx512` (default: where the CPU has
    it), plus the tile unit's where `amx` too."""
    if avx512 is None:
        avx512 = "avx512" in simd_widths()
    flags = FLAGS + (AMD_FLAGS if cpu_info("vendor_id") == "AuthenticAMD" else ())
    if not avx512:
        return flags
    vnni = VNNI_FLAGS if "avx512_vnni" in cpu_flags() else ()
    return flags + AVX512_FLAGS + vnni + (AMX_FLAGS if amx else ())


def compiler() -> str | None:
    """The C compiler: $CC, else cc or gcc on PATH; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def missing_on_this_machine() -> str | None:
    """What this machine lacks to build and run the kernels (an x86-64 Linux CPU with AVX2,
    FMA and F16C, a C compiler), or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the CPU is {platform.machine() or 'unknown'}, not x86-64"
    if not Path("/proc/cpuinfo").exists():
        return "no /proc/cpuinfo to read the CPU's AVX2/FMA/F16C flags from (not Linux)"
    if "avx2" not in simd_widths():
        return "the CPU has no AVX2/FMA/F16C"
    if compiler() is None:
        return "no C compiler (cc or gcc) on PATH"
    return None


def simd_widths() -> list[str]:
    """The SIMD widths this CPU runs the kernels at: ["avx2", "avx512"], ["avx2"] or []."""
    flags = cpu_flags()
    return [
        width
        for width, needs in (("avx2", {"avx2", "fma", "f16c"}), ("avx512", {"avx512f", "avx512bw"}))
        if needs <= flags
    ]


def cache_dir() -> Path:
    """Where built libraries are kept: $XDG_CACHE_HOME (else ~/.cache)/glassformer/kernels."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "glassformer" / "kernels"


def compile_library(flags: tuple[str, ...]) -> Path:
    """Compile the C files once per (sources, flags, compiler, CPU model); return the .so path."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    cpu = cpu_info("model name")
    key = hashlib.sha256(
        "\n".join(
            [*(f.read_text() for f in SOURCES + HEADERS), " ".join(flags), version, cpu]
        ).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent build or an interrupted one never
    # leaves a half-written library under the final name.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / "kernels.so"
        command = [cc, *flags, *map(str, SOURCES), "-lm", "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed on the kernels: {result.stderr.strip()}")
        os.replace(built, target)
    return target


def load(avx512: bool, amx: bool = False) -> ctypes.CDLL:
    """The kernels built with or without the AVX-512 loops (and with or without amx.h's tile
    unit products), each entry point's arguments declared; OSError or RuntimeError when they
    cannot be built or loaded."""
    library = ctypes.CDLL(str(compile_library(build_flags(avx512=avx512, amx=amx))))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for storage in ("f32", "bf16", "int8"):
        function = getattr(library, f"matvec_{storage}")
        # x, w, scale, y, rows, in, out, group, n_threads
        function.argtypes = [pointer] * 4 + [size] * 4 + [ctypes.c_int]
        function.restype = None
    # x, w, scale, mins, y, rows, in, out, n_threads
    library.matvec_q4.argtypes = [pointer] * 5 + [size] * 3 + [ctypes.c_int]
    library.matvec_q4.restype = None
    # w, scale, out, rows, in, group, n_threads / w, scale, mins, out, rows, in, n_threads
    library.dequant_int8.argtypes = [pointer] * 3 + [size] * 3 + [ctypes.c_int]
    library.dequant_q4.argtypes = [pointer] * 4 + [size] * 2 + [ctypes.c_int]
    library.dequant_int8.restype = library.dequant_q4.restype = None
    # x, rows, weight, storage, scale, mins, in, out, group, round_inputs, y, n_threads -> 1
    # done, 0 not here
    library.matmul_tiles.argtypes = [pointer, size, pointer, size, pointer, pointer]
    library.matmul_tiles.argtypes += [size] * 4 + [pointer, ctypes.c_int]
    library.matmul_tiles.restype = ctypes.c_int
    library.argmax_rows.argtypes = [pointer, size, size, pointer]  # x, rows, n, out
    library.argmax_rows.restype = size  # the rows holding a NaN
    library.all_finite.argtypes = [pointer, size]  # x, n
    library.all_finite.restype = ctypes.c_int
    # 1: the tile unit built in and granted by Linux; -1: built in, refused; 0: not built in
    library.glassformer_amx.argtypes = []
    library.glassformer_amx.restype = ctypes.c_int
    return library
