"""Weights in 2 MB pages for decoding (seed 000 §2.5.1: decode streams every weight once).

The CPU finds each page of memory through its TLB, a small cache of address translations. With
the usual 4 KB pages, streaming SmolLM2's 540 MB of fp32 weights crosses 132,000 pages, and
each new one that misses the TLB costs a page-table walk; with 2 MB pages it crosses 258. On
this 2-core machine one read of a 1 GiB tensor ran at 26-28 GB/s from 4 KB pages and 32-34
GB/s from 2 MB pages, so each decoded token can be that much faster.

torch allocates in 4 KB pages (unless THP_MEM_ALLOC_ENABLE=1 is set before its first
allocation), so `to_huge_pages(model)` moves the model's parameters and buffers (each of at least
`min_bytes`, 16 KB) end to end into one fresh private mapping that Linux is asked to back with
transparent huge pages (madvise(MADV_HUGEPAGE)), and points each tensor at its place:
`tensor.data = moved`, so every module, tied weight and optimizer that holds the tensor sees the
new memory. One mapping for all of them, not one each: most of a small model's matrices are
under 2 MB (of SmolLM2's four a layer, three in bf16, all four in int8 and int4), and a
tensor's own mapping holds its whole 2 MB pages only, its tail in 4 KB pages. Those tails are
the last rows, the second thread's share of a matrix-vector product: the fused step's thread 1
spent 12.1 against thread 0's 8.5 million cycles a token in SmolLM2's bf16 gate/up matrix (3.5
MB: one huge page and a tail), and thread 0 waited for it. Elsewhere (other systems, huge pages
off, tensors off the CPU) nothing moves.

    moved = to_huge_pages(model)   # bytes moved (Engine(model, huge_pages=True) calls it)

The KV cache is read as a decode step's weights are: each row's keys and values, every layer,
every step (32 rows of SmolLM2 at position 145 read 107 MB of fp16 keys and values a step).
It is too large to copy (gigabytes for a server's rows), so `advise_in_place` asks Linux to
back the 2 MB pages it already has with huge ones (madvise MADV_HUGEPAGE, then MADV_COLLAPSE,
Linux 6.1+, which swaps them in now; without it khugepaged does so in its own time). A 32-row
int8 step took 102-104 ms against 106 with the cache in 4 KB pages.
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from pathlib import Path

import torch
from torch import Tensor, nn

HUGE_PAGE = 2**21  # bytes: x86-64's transparent huge page
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def supported() -> bool:
    """Whether this system gives transparent huge pages to a mapping that asks (Linux, with
    THP "always" or "madvise")."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return False
    try:
        return "[never]" not in _SETTING.read_text()
    except OSError:
        return False


def huge_page_empty(nbytes: int) -> Tensor:
    """An uninitialised uint8 tensor of `nbytes` that starts on a 2 MB boundary of its own
    private mapping, every 2 MB page that holds it advised to be a huge page."""
    region, start = _huge_mapping(nbytes)
    # A storage of exactly nbytes (the slice holds `region` alive), so that sizes read from the
    # storage (quant.weight_bytes) count the tensor, not the mapping's alignment slack.
    return torch.frombuffer(memoryview(region)[start : start + nbytes], dtype=torch.uint8)


ALIGN = 64  # bytes: each moved tensor starts on a cache line
_ARENAS: dict[int, int] = {}  # start -> end of each live mapping made here


def to_huge_pages(model: nn.Module, min_bytes: int = 16 * 2**10) -> int:
    """Move every CPU parameter and buffer of at least `min_bytes` that owns its memory into
    one mapping of huge pages (see the module docstring); returns the bytes moved, 0 where
    unsupported. Tied tensors move once and stay tied; a tensor moved already stays where it
    is, so a second call moves nothing."""
    if not supported():
        return 0
    tensors: dict[int, Tensor] = {}  # by identity: a tied tensor once
    for module in model.modules():
        for registry in (module._parameters, module._buffers):
            for tensor in registry.values():
                if _movable(tensor, min_bytes):
                    tensors[id(tensor)] = tensor
    if not tensors:
        return 0
    offsets, total = [], 0
    for tensor in tensors.values():
        offsets.append(total)
        total += -(-tensor.nbytes // ALIGN) * ALIGN
    region, start = _huge_mapping(total)
    view = memoryview(region)
    for tensor, offset in zip(tensors.values(), offsets, strict=True):
        at = start + offset
        # a storage of exactly the tensor's bytes (quant.weight_bytes counts storages)
        target = torch.frombuffer(view[at : at + tensor.nbytes], dtype=torch.uint8)
        target = target.view(tensor.dtype).view(tensor.shape)
        with torch.no_grad():
            target.copy_(tensor)
        tensor.data = target
    return sum(tensor.nbytes for tensor in tensors.values())


def _huge_mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private mapping with `nbytes` from a 2 MB boundary on, every 2 MB page that holds them
    advised (the last one too: at most 2 MB of memory that holds nothing), and that start."""
    region = mmap.mmap(-1, nbytes + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    start = -base % HUGE_PAGE  # a multiple of 4 KB: mmap returns whole pages
    region.madvise(mmap.MADV_HUGEPAGE, start, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    _ARENAS[base + start] = base + start + nbytes
    weakref.finalize(region, _ARENAS.pop, base + start, None)  # unmapped: forget the range
    return region, start


MADV_COLLAPSE = 25  # Linux 6.1+; Python's mmap module names it from 3.12 on


def advise_in_place(tensor: Tensor) -> int:
    """Ask for the whole 2 MB pages inside a CPU tensor's memory to be huge pages, where it
    lies (see the module docstring); returns the bytes advised, 0 where unsupported."""
    if not supported() or tensor.device.type != "cpu":
        return 0
    start = tensor.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    end = (start + tensor.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= first:
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if madvise(first, end - first, mmap.MADV_HUGEPAGE) != 0:
        return 0
    madvise(first, end - first, MADV_COLLAPSE)  # an older kernel refuses: khugepaged will do
    return end - first


def _movable(tensor: Tensor | None, min_bytes: int) -> bool:
    return (
        type(tensor) in (Tensor, nn.Parameter)  # not a DTensor (FSDP) or other subclass
        and tensor.device.type == "cpu"
        and tensor.nbytes >= min_bytes
        and tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.nbytes  # not a view into a larger one
        and not any(start <= tensor.data_ptr() < end for start, end in _ARENAS.items())
    )
