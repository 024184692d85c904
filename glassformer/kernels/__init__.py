"""Hand-written matrix-vector kernels for batch-1 decoding (seed 000 §2.5.1: memory-bound).

`matvec(x, weight, scale, mins)` computes x @ weight.T (int8: times group scales; int4: packed
nibbles times group scales plus group mins) with the C loops in matvec.c when the input has few
rows and the CPU has AVX2/FMA. Many rows (prefill) of an int8 or int4 weight go to the tile
unit's bf16 products where the CPU has AMX (x in three exact bf16 pieces: tiles_split.h), else
to an fp32 matmul (`linear`: oneDNN's or MKL's) one dequantized slice at a time (the C loop
fills a small reused buffer), as fp32 weights' many rows do whole; anything else (other
CPUs, no C compiler, GPUs) goes to torch's F.linear on the dequantized weight, which is also
the reference the tests hold the kernels to.

The C files are compiled on first use with the system C compiler into a cache folder keyed by
the sources, flags and CPU (~1 s; kernels/build.py), and called through ctypes on the tensors'
memory. A plain C shared object rather than a torch C++ extension: it builds in a second
instead of a minute, and needs no torch headers.

One switch, the environment variable GLASSFORMER_KERNELS, read at import: `on` (the default:
AVX-512 loops where the CPU has them, else AVX2, and on the tile unit where the CPU has AMX:
int4 decode products, amx.h, and w8a8/w4a8 products of many rows, tiles_a8.h), `avx512` (the
AVX-512 loops without the tile unit), `avx2` (the AVX2 loops even on an AVX-512 CPU, so one
machine can test every width) or `off` (`0` too: torch everywhere, as on a machine that cannot
build the kernels).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from glassformer.kernels import build
from glassformer.kernels.build import simd_widths

# Most activation rows the kernel takes per storage; more go to torch's matmul. The loop
# converts each weight once per row, so with bf16 weights several rows are faster on oneDNN's
# bf16 matmul (measured: batch 8 at 0.93x transformers through the kernel).
MAX_ROWS = {torch.float32: 8, torch.bfloat16: 1, torch.int8: 8, torch.uint8: 8}
Q4_GROUP = 32  # int4 (uint8 storage, two weights a byte): weights per scale and min
_STORAGES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "int8"}


def _switch(value: str) -> str:
    """GLASSFORMER_KERNELS's value as one of "on", "avx512", "avx2" and "off"."""
    switches = {"": "on", "1": "on", "on": "on", "avx512": "avx512", "avx2": "avx2"}
    switches |= {"0": "off", "off": "off"}
    if value.strip().lower() not in switches:
        raise ValueError(
            f"GLASSFORMER_KERNELS={value!r} is not a setting: use on (the default), avx512 "
            "(without the AMX tile unit), avx2 (the AVX2 loops even on an AVX-512 CPU) or off "
            "(torch's F.linear everywhere)"
        )
    return switches[value.strip().lower()]


# The kernels in use: "on", "avx512", "avx2" or "off". Tests set it per test (monkeypatch) to check
# both SIMD widths and the fallback in one process; each setting has its own library.
SWITCH = _switch(os.environ.get("GLASSFORMER_KERNELS", "on"))


def missing() -> str | None:
    """What keeps the kernels off before any build is tried: the switch, the CPU (x86-64 with
    AVX2, FMA and F16C) or the C compiler; None where they should build and run."""
    return "GLASSFORMER_KERNELS=off" if SWITCH == "off" else build.missing_on_this_machine()


def _library() -> ctypes.CDLL | None:
    """The compiled kernels for SWITCH, or None when they cannot be had here."""
    return _load(SWITCH)


@functools.cache
def _load(switch: str) -> ctypes.CDLL | None:
    """The kernels built for `switch`, or None (with one warning when a build fails)."""
    if switch == "off" or build.missing_on_this_machine() is not None:
        return None
    avx512 = "avx512" in simd_widths() and switch in ("on", "avx512")
    amx = avx512 and switch == "on" and build.has_amx()
    try:
        return build.load(avx512=avx512, amx=amx)
    except (OSError, RuntimeError) as error:
        if amx:  # a compiler without the tile unit's flags (GCC before 11): the loops alone
            warnings.warn(f"AMX kernels unavailable, int4 on AVX-512: {error}", stacklevel=4)
            return _load("avx512")
        warnings.warn(f"decode kernels unavailable, using torch's F.linear: {error}", stacklevel=4)
        return None


def library() -> ctypes.CDLL:
    """The compiled library (matvec_* and decode_tokens); an error when it cannot be had."""
    found = _library()
    if found is None:
        raise RuntimeError("the C kernels are not available here: check kernels.available()")
    return found


def available() -> bool:
    """Whether the C kernels run on this machine (AVX2/FMA CPU, a C compiler, the switch on)."""
    return _library() is not None


def simd() -> str | None:
    """The SIMD width of the kernels in use: "avx512", "avx2", or None without kernels."""
    if _library() is None:
        return None
    return "avx512" if SWITCH in ("on", "avx512") and "avx512" in simd_widths() else "avx2"


def amx() -> bool:
    """Whether the decode step's int4 products run on the tile unit (amx.h): kernels built
    with it, and Linux granting this process its registers."""
    library = _library()
    return library is not None and library.glassformer_amx() == 1


def pack_q4_tiles(weight: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    """An int4 matrix in amx.h's order, for the tile unit, as one stream of bytes: its whole
    blocks of 16 rows (the rest stay with the row-by-row products), groups paired (a zero group
    after an odd count), each block and pair 768 bytes. Their first 512: chunk c's low nibbles
    are the tile's row 2c and its high nibbles row 2c + 1, tile row kk holding q[n][4kk..4kk+3]
    for the block's rows n; then the pair's scales and mins, (2 groups, 16 rows) floats each.
    weight: (out, in / 2) uint8 in GGUF's order (byte j of a group: weight j low, j + 16 high);
    scales, mins: (out, in / 32). Returns (out // 16, pairs, 768) uint8."""
    out, groups = scales.shape
    blocks, pairs = out // 16, (groups + 1) // 2
    packed = weight[: 16 * blocks].reshape(blocks * 16, groups, 16)
    q = torch.cat([packed & 0x0F, packed >> 4], dim=2)  # (rows, groups, 32) in column order
    q = F.pad(q, (0, 0, 0, 2 * pairs - groups)).reshape(blocks, 16, pairs, 16, 4)
    # (block, pair, tile row kk, weight row n, 4 columns) -> chunks of two tile rows
    tiles = q.permute(0, 2, 3, 1, 4).reshape(blocks, pairs, 8, 2, 64)
    nibbles = (tiles[:, :, :, 0] | (tiles[:, :, :, 1] << 4)).reshape(blocks, pairs, 512)

    def by_pair(values: Tensor) -> Tensor:  # (blocks, pairs, 2 groups, 16 rows) as bytes
        values = F.pad(values[: 16 * blocks].float(), (0, 2 * pairs - groups))
        values = values.reshape(blocks, 16, pairs, 2).permute(0, 2, 3, 1).contiguous()
        return values.view(torch.uint8).reshape(blocks, pairs, 128)

    return torch.cat([nibbles, by_pair(scales), by_pair(mins)], dim=2).contiguous()


def in_features(weight: Tensor) -> int:
    """Columns of the matrix a stored weight stands for (int4 packs two a byte)."""
    return weight.shape[1] * (2 if weight.dtype == torch.uint8 else 1)


def can_use(x: Tensor, weight: Tensor, scale: Tensor | None = None) -> bool:
    """Whether matvec(x, weight, scale) will take the kernel rather than F.linear."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return (
        0 < rows <= MAX_ROWS.get(weight.dtype, 0)
        and x.device.type == "cpu"
        and weight.dim() == 2
        and x.shape[-1] == in_features(weight)
        and weight.is_contiguous()
        and _group_size(weight, scale) % 32 == 0  # the C loop steps 32 columns at a time
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and available()
    )


def _group_size(weight: Tensor, scale: Tensor | None) -> int:
    """Columns per scale: all of a row (per-channel, or no scale) or in_features / groups."""
    if weight.dtype == torch.uint8:
        return Q4_GROUP
    if scale is None or scale.dim() == 1:
        return weight.shape[1]
    return weight.shape[1] // scale.shape[1]


def dequantize(
    weight: Tensor, scale: Tensor | None, dtype: torch.dtype, mins: Tensor | None = None
) -> Tensor:
    """The weight as `dtype` floats: int8 times its scales (out,) or (out, groups); int4 (uint8,
    two nibbles a byte in GGUF's order) times its group scales plus its group mins; other
    storages cast."""
    if weight.dtype == torch.uint8:
        out_features = weight.shape[0]
        blocks = weight.view(out_features, -1, Q4_GROUP // 2)  # (out, G, 16)
        q = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1).float()  # (out, G, 32)
        w = q * scale.view(out_features, -1, 1) + mins.view(out_features, -1, 1)
        return w.view(out_features, -1).to(dtype)
    if scale is None:
        return weight.to(dtype)
    out_features, in_features = weight.shape
    groups = scale.reshape(out_features, -1)  # (out, G)
    w = weight.to(torch.float32).view(out_features, groups.shape[1], -1) * groups[..., None]
    return w.view(out_features, in_features).to(dtype)


def matvec(
    x: Tensor, weight: Tensor, scale: Tensor | None = None, mins: Tensor | None = None
) -> Tensor:
    """x (..., in) @ weight (out, in).T, the weight dequantized by `scale` (and `mins`) when
    given.

    weight is fp32, bf16, int8 or int4 (uint8 (out, in / 2)); int8 needs scale: (out,) per
    output row, or (out, G) per row and group of in/G columns; int4 needs scale and mins, both
    (out, in / 32). The result has x's dtype."""
    if weight.dtype in (torch.int8, torch.uint8) and scale is None:
        raise ValueError("a quantized weight needs its scales: matvec(x, weight, scale)")
    if weight.dtype == torch.uint8 and mins is None:
        raise ValueError("an int4 weight needs its group mins: matvec(x, weight, scale, mins)")
    if torch.compiler.is_compiling():
        # torch.compile cannot trace a ctypes call: it sees one opaque op instead (below).
        return matvec_op(x, weight, scale, mins)
    if not can_use(x, weight, scale):
        if _can_slice(x, weight, scale):  # many rows of an int8 or int4 weight (prefill)
            y = _on_tiles(False, x, weight, scale, mins)  # the tile unit, else slices
            return y if y is not None else _matmul_by_slices(x, weight, scale, mins)
        if _bf16_in_fp32(x, weight):  # many rows of a bf16 model, no bf16 products (prefill)
            return _bf16_by_slices(x, weight)
        return linear(x, dequantize(weight, scale, x.dtype, mins))
    x2d = x.reshape(-1, x.shape[-1])  # (rows, in)
    if x2d.dtype != torch.float32 or not x2d.is_contiguous():
        x2d = x2d.to(torch.float32).contiguous()
    scale, mins = (None if t is None else t.to(torch.float32).contiguous() for t in (scale, mins))
    rows, n_in, n_out = x2d.shape[0], x2d.shape[1], weight.shape[0]
    y = torch.empty(rows, n_out, dtype=torch.float32)
    if weight.dtype == torch.uint8:
        library().matvec_q4(
            x2d.data_ptr(),
            weight.data_ptr(),
            scale.data_ptr(),
            mins.data_ptr(),
            y.data_ptr(),
            rows,
            n_in,
            n_out,
            torch.get_num_threads(),
        )
    else:
        getattr(library(), f"matvec_{_STORAGES[weight.dtype]}")(
            x2d.data_ptr(),
            weight.data_ptr(),
            None if scale is None else scale.data_ptr(),
            y.data_ptr(),
            rows,
            n_in,
            n_out,
            _group_size(weight, scale),
            torch.get_num_threads(),
        )
    y = y.view(*x.shape[:-1], n_out)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def matmul_a8(
    x: Tensor, weight: Tensor, scale: Tensor, mins: Tensor | None = None
) -> Tensor | None:
    """x (..., in) @ W.T for an int8 W (scale: (out, G)) or an int4 one (uint8, scale and mins)
    whose inputs are rounded to int8 in groups of 32 first (w8a8 and w4a8: nn/quant.py's
    round_to_int8), on the tile unit (tiles_a8.h): each group's products summed in integers.
    None where that does not run here (no tile unit, a tensor off the CPU or not float32,
    gradients, torch.compile's tracing): the caller rounds x and takes matvec."""
    return _on_tiles(True, x, weight, scale, mins)


def _on_tiles(
    round_inputs: bool, x: Tensor, weight: Tensor, scale: Tensor, mins: Tensor | None
) -> Tensor | None:
    """x (..., in) @ W.T for an int8 or int4 W on the tile unit (matmul_tiles: x rounded to int8
    first, tiles_a8.h, or not, tiles_split.h), or None where that does not run here."""
    n_in, n_out = in_features(weight), weight.shape[0]
    if (
        torch.compiler.is_compiling()
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.shape[-1] != n_in
        or n_in % 32
        or _group_size(weight, scale) % 32
        or not weight.is_contiguous()
        or torch.is_grad_enabled()
        or not amx()
    ):
        return None
    x2d = x.reshape(-1, n_in).contiguous()
    scale = scale.to(torch.float32).contiguous()
    if mins is not None:
        mins = mins.to(torch.float32).contiguous()
    y = torch.empty(x2d.shape[0], n_out)
    done = library().matmul_tiles(
        x2d.data_ptr(),
        x2d.shape[0],
        weight.data_ptr(),
        3 if weight.dtype == torch.uint8 else 2,  # step.h's Q4 and INT8
        scale.data_ptr(),
        None if mins is None else mins.data_ptr(),
        n_in,
        n_out,
        _group_size(weight, scale),
        int(round_inputs),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y.view(*x.shape[:-1], n_out) if done else None


@functools.cache
def _cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD"), or "" where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    ids = (line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id"))
    return next(ids, "")


def _prefill_matmul(value: str, vendor: str) -> str:
    """GLASSFORMER_PREFILL_MATMUL's value as "onednn" or "mkl"; unset, by the CPU's maker."""
    value = value.strip().lower()
    if value in ("onednn", "mkl"):
        return value
    if value:
        raise ValueError(
            f"GLASSFORMER_PREFILL_MATMUL={value!r} is not a setting: use onednn or mkl, or leave "
            "it unset for the faster one on this CPU (MKL on Intel, oneDNN elsewhere)"
        )
    return "mkl" if vendor == "GenuineIntel" else "onednn"


def prefill_matmul() -> str:
    """Which library takes prefill's fp32 matmuls: "mkl" (torch's F.linear) or "onednn"
    (kernels.linear). Each wins on one maker's CPUs (benchmarks/prefill_matmul.py, SmolLM2's
    whole prefill, 2 threads): on a 2-core AMD machine oneDNN 1.18-1.25x faster; on a 2-core
    Intel Xeon MKL 1.03-1.32x faster from 4 to 256 tokens. GLASSFORMER_PREFILL_MATMUL=onednn
    or mkl chooses; oneDNN needs a torch built with it."""
    choice = _prefill_matmul(os.environ.get("GLASSFORMER_PREFILL_MATMUL", ""), _cpu_vendor())
    return choice if choice == "mkl" or _onednn_linear() is not None else "mkl"


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., in) @ weight (out, in).T for many rows: oneDNN's fp32 matmul where it applies
    (CPU, fp32, inference, and prefill_matmul() chose it), else F.linear (MKL). Both are fp32
    matmuls."""
    if (
        x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and prefill_matmul() == "onednn"
    ):
        return _onednn_linear()(x, weight, None, "none", [], "")
    return F.linear(x, weight)


@functools.cache
def bf16_products() -> bool:
    """Whether the CPU multiplies bf16 numbers itself (AVX-512 BF16, or AMX's bf16 tiles), so
    that torch's bf16 matmuls run on them."""
    return bool({"avx512_bf16", "amx_bf16"} & build.cpu_flags())


def _bf16_in_fp32(x: Tensor, weight: Tensor) -> bool:
    return (
        x.dtype == weight.dtype == torch.bfloat16
        and x.device.type == weight.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not bf16_products()
    )


def _bf16_by_slices(x: Tensor, weight: Tensor) -> Tensor:
    """x (..., in) @ W.T for bf16 x and W on a CPU without bf16 products, as torch's bf16
    matmul defines it (fp32 sums of the exact products, rounded to bf16 at the end) but on
    fp32 matmuls: x and SLICE_WEIGHTS of W's values at a time widened to fp32 (exactly: a bf16
    is an fp32's top half). There torch's bf16 matmul has no instructions of its own to run on:
    a bf16 SmolLM2's 128-token prefill took 1.8 s on a Zen 3 EPYC, its fp32 one 0.4 s
    (docs/performance.md)."""
    x2d = x.reshape(-1, x.shape[-1]).float()
    y = torch.empty(x2d.shape[0], weight.shape[0], dtype=torch.float32)
    step = max(1, SLICE_WEIGHTS // weight.shape[1])
    for start in range(0, weight.shape[0], step):
        y[:, start : start + step] = linear(x2d, weight[start : start + step].float())
    return y.to(torch.bfloat16).view(*x.shape[:-1], weight.shape[0])


class FastLinears(TorchFunctionMode):
    """Within `with FastLinears():`, every F.linear (so every nn.Linear) of fp32 inference
    takes `linear` above. The Engine wraps its prefill in it when `applies(model)`: the model's
    modules stay plain nn.Linear, and only the matmul under them changes. The mode sees every
    torch call in Python (about 2,300 in a SmolLM2 forward, some 15 ms), so models without fp32
    nn.Linear layers (bf16, int8, int4: no gain to win) go without it."""

    @staticmethod
    def applies(model: torch.nn.Module) -> bool:
        """Whether `model` has fp32 nn.Linear layers on the CPU whose matmuls this mode moves
        (and prefill_matmul() chose oneDNN for them)."""
        return prefill_matmul() == "onednn" and any(
            type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.is_cpu
            for m in model.modules()
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            y = linear(x, weight)
            return y if bias is None else y + bias
        return func(*args, **kwargs)


@functools.cache
def _onednn_linear():
    """torch's oneDNN linear on dense fp32 tensors (the op torch.compile's CPU code calls),
    or None where this torch build has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


# Weights dequantized at a time when many rows meet an int8/int4 matrix (prefill): 8 MB of
# fp32, which stays in cache between the C loop that writes it and the matmul that reads it,
# and holds every matrix of a small model whole. Dequantizing whole matrices instead writes a
# fresh fp32 copy of each (SmolLM2 int8, 128-token prefill: 337 ms against 217 ms in fp32,
# 87 ms of it in the dequantizing ops; sliced: 234 ms).
SLICE_WEIGHTS = 1 << 21
_scratch = threading.local()  # one buffer per thread: the server decodes in worker threads


def _can_slice(x: Tensor, weight: Tensor, scale: Tensor | None) -> bool:
    return (
        weight.dtype in (torch.int8, torch.uint8)
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.is_contiguous()
        and _group_size(weight, scale) % 32 == 0
        and not torch.is_grad_enabled()
        and available()
    )


def _matmul_by_slices(x: Tensor, weight: Tensor, scale: Tensor, mins: Tensor | None) -> Tensor:
    """x (..., in) @ W.T for an int8 or int4 W and many rows of x, without a float copy of W:
    the C loop dequantizes a slice of W's rows into a small buffer, the fp32 matmul takes that
    slice (y[:, slice] = x @ W[slice].T), and the next slice reuses the buffer."""
    n_in, n_out = in_features(weight), weight.shape[0]
    x2d = x.reshape(-1, n_in)
    y = None  # the output, when W takes more than one slice
    step = max(1, SLICE_WEIGHTS // n_in)  # weight rows per slice
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < step * n_in:
        buffer = _scratch.buffer = torch.empty(max(step * n_in, SLICE_WEIGHTS))
    scale = scale.to(torch.float32).contiguous().view(n_out, -1)
    mins = None if mins is None else mins.to(torch.float32).contiguous().view(n_out, -1)
    library, threads = _library(), torch.get_num_threads()
    group = _group_size(weight, scale)
    for start in range(0, n_out, step):
        rows = min(step, n_out - start)
        w = buffer[: rows * n_in].view(rows, n_in)
        source, scales = weight[start].data_ptr(), scale[start].data_ptr()
        if weight.dtype == torch.uint8:
            library.dequant_q4(
                source, scales, mins[start].data_ptr(), w.data_ptr(), rows, n_in, threads
            )
        else:
            library.dequant_int8(source, scales, w.data_ptr(), rows, n_in, group, threads)
        part = linear(x2d, w)  # (rows of x, rows of this slice)
        if rows == n_out:
            return part.view(*x.shape[:-1], n_out)
        if y is None:
            y = torch.empty(x2d.shape[0], n_out, dtype=torch.float32)
        y[:, start : start + rows] = part
    return y.view(*x.shape[:-1], n_out)


def argmax(x: Tensor) -> Tensor:
    """x.argmax(dim=-1) for a 2-D float32 CPU tensor (greedy decoding's pick), through
    matvec.c's argmax_rows where the kernels are built: the same index, the first of equal
    largest values, in a tenth of torch's time over a vocabulary. Anything else, and a row
    holding a NaN, goes to torch."""
    found = _for_float32(x) if x.dim() == 2 and x.shape[1] > 0 else None
    if found is None:
        return x.argmax(dim=-1)
    x = x.contiguous()
    picks = torch.empty(x.shape[0], dtype=torch.int64)
    if found.argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], picks.data_ptr()):
        nan = picks < 0
        picks[nan] = x[nan].argmax(dim=-1)
    return picks


def all_finite(x: Tensor) -> bool | None:
    """Whether no value of a contiguous float32 CPU tensor is NaN or infinite, through
    matvec.c's all_finite (one pass, one thread: meant for a step's logits); None where the
    kernels are not built or x is anything else (the caller asks torch)."""
    found = _for_float32(x) if x.is_contiguous() else None
    return None if found is None else bool(found.all_finite(x.data_ptr(), x.numel()))


def _for_float32(x: Tensor) -> ctypes.CDLL | None:
    """The library, for a float32 CPU tensor outside torch.compile; else None."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return _library()


@torch.library.custom_op("glassformer::matvec", mutates_args=())
def matvec_op(
    x: Tensor, weight: Tensor, scale: Tensor | None, mins: Tensor | None = None
) -> Tensor:
    """matvec as a torch operator, so a compiled graph (glassformer/infer/compiled.py) calls
    the C kernel as one node instead of breaking at ctypes. Runs eagerly: plain matvec."""
    return matvec(x, weight, scale, mins)


@matvec_op.register_fake
def _matvec_shape(
    x: Tensor, weight: Tensor, scale: Tensor | None, mins: Tensor | None = None
) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
