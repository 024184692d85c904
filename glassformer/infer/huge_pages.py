"""Weights in 2 MB pages for decoding (seed 000 §2.5.1: decode streams every weight once).

The CPU finds each page of memory through its TLB, a small cache of address translations. With
the usual 4 KB pages, streaming SmolLM2's 540 MB of fp32 weights crosses 132,000 pages, and
each new one that misses the TLB costs a page-table walk; with 2 MB pages it crosses 258. On
this 2-core machine one read of a 1 GiB tensor ran at 26-28 GB/s from 4 KB pages and 32-34
GB/s from 2 MB pages, so each decoded token can be that much faster.

torch allocates in 4 KB pages (unless THP_MEM_ALLOC_ENABLE=1 is set before its first
allocation), so `to_huge_pages(model)` moves each parameter and buffer of at least 2 MB into a
fresh private mapping that Linux is asked to back with transparent huge pages
(madvise(MADV_HUGEPAGE)), and points the tensor at it: `tensor.data = moved`, so every module,
tied weight and optimizer that holds the tensor sees the new memory. Only a mapping's whole
2 MB pages are advised; its tail stays in 4 KB pages and costs no extra memory. Elsewhere
(other systems, huge pages off, tensors off the CPU) nothing moves.

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
    private mapping, its whole 2 MB pages advised to be huge pages."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    start = -base % HUGE_PAGE  # a multiple of 4 KB: mmap returns whole pages
    advised = nbytes // HUGE_PAGE * HUGE_PAGE
    if advised:
        region.madvise(mmap.MADV_HUGEPAGE, start, advised)
    # A storage of exactly nbytes (the slice holds `region` alive), so that sizes read from the
    # storage (quant.weight_bytes) count the tensor, not the mapping's alignment slack.
    return torch.frombuffer(memoryview(region)[start : start + nbytes], dtype=torch.uint8)


def to_huge_pages(model: nn.Module, min_bytes: int = HUGE_PAGE) -> int:
    """Move every CPU parameter and buffer of at least `min_bytes` that owns its memory into
    huge pages (see the module docstring); returns the bytes moved, 0 where unsupported. Tied
    tensors move once and stay tied; a tensor already on a 2 MB boundary is left where it is,
    so a second call moves nothing."""
    if not supported():
        return 0
    moved = 0
    for module in model.modules():
        for registry in (module._parameters, module._buffers):
            for tensor in registry.values():
                if not _movable(tensor, min_bytes):
                    continue
                with torch.no_grad():
                    target = huge_page_empty(tensor.nbytes).view(tensor.dtype).view(tensor.shape)
                    target.copy_(tensor)
                tensor.data = target
                moved += tensor.nbytes
    return moved


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
        and tensor.data_ptr() % HUGE_PAGE != 0  # not moved already (a tied tensor's 2nd visit)
    )
