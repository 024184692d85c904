"""Weights moved into 2 MB pages (infer/huge_pages.py): the kernel's own account of the mapping
(/proc/self/smaps: the huge-page flag on the advised range), the same numbers and the same
model output afterwards, tied weights still one tensor, and the fused step on moved weights."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from conftest import needs_kernels, tiny_model

from glassformer.infer.engine import Engine
from glassformer.infer.huge_pages import (
    HUGE_PAGE,
    advise_in_place,
    huge_page_empty,
    supported,
    to_huge_pages,
)

pytestmark = pytest.mark.skipif(not supported(), reason="needs Linux transparent huge pages")


def _mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping in /proc/self/smaps that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_every_page_of_the_tensor_is_advised_and_the_slack_is_not():
    tensor = huge_page_empty(3 * HUGE_PAGE + 12345)
    assert tensor.data_ptr() % HUGE_PAGE == 0 and tensor.numel() == 3 * HUGE_PAGE + 12345
    assert tensor.untyped_storage().nbytes() == tensor.numel()  # no slack counted as weights
    # madvise splits the mapping: "hg" (MADV_HUGEPAGE) on the 4 pages that hold the tensor,
    # its tail's included, and not past them.
    assert "hg" in _mapping_flags(tensor.data_ptr())
    assert "hg" in _mapping_flags(tensor.data_ptr() + 3 * HUGE_PAGE + 12344)
    assert "hg" not in _mapping_flags(tensor.data_ptr() + 4 * HUGE_PAGE)


MODEL = dict(vocab_size=300, d_model=64, n_kv_heads=None, d_ff=128, tie_embeddings=True, scale=1)


def test_moved_weights_keep_their_values_ties_and_output():
    model = tiny_model(**MODEL)
    ids = torch.tensor([[5, 17, 200, 3]])
    with torch.inference_mode():
        before = model(ids)
    values = {name: t.clone() for name, t in model.state_dict().items()}
    small = model.final_norm.weight
    moved = to_huge_pages(model, min_bytes=4096)  # every matrix of this small model
    assert moved == sum(t.nbytes for t in model.parameters() if t.nbytes >= 4096)
    assert model.lm_head.weight is model.tok_emb.weight  # still one tensor
    assert model.tok_emb.weight.data_ptr() % HUGE_PAGE == 0
    assert model.final_norm.weight is small and small.data_ptr() % HUGE_PAGE != 0  # 256 bytes
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, values[name]), name
    with torch.inference_mode():
        assert torch.equal(model(ids), before)
    assert to_huge_pages(model, min_bytes=4096) == 0  # nothing left to move


def test_every_byte_of_every_moved_tensor_is_advised():
    # Matrices under 2 MB and of no whole number of 2 MB pages (the 300 x 64 embedding, 76.8
    # KB): each lies in advised memory from its first byte to its last, tails included, where
    # a mapping of its own would advise none of it.
    model = tiny_model(**MODEL)
    moved = to_huge_pages(model, min_bytes=4096)
    tensors = {id(t): t for t in model.parameters() if t.nbytes >= 4096}.values()
    assert moved == sum(t.nbytes for t in tensors) > 0
    for tensor in tensors:
        assert tensor.data_ptr() % 64 == 0  # on a cache line
        assert "hg" in _mapping_flags(tensor.data_ptr())
        assert "hg" in _mapping_flags(tensor.data_ptr() + tensor.nbytes - 1)
        assert tensor.untyped_storage().nbytes() == tensor.nbytes  # its own bytes, counted once


@needs_kernels
def test_fused_step_on_moved_weights_decodes_like_the_modules():
    model = tiny_model(**MODEL)
    to_huge_pages(model, min_bytes=4096)
    fast, plain = Engine(model), Engine(model, fast=False)
    assert fast.fused is not None
    a = fast.generate([5, 9, 200], max_new_tokens=12, temperature=0.0).token_ids
    assert a == plain.generate([5, 9, 200], max_new_tokens=12, temperature=0.0).token_ids


def test_an_engine_moves_the_callers_weights_only_when_asked():
    # A 2 MB embedding (8192 x 64 fp32): to_huge_pages would move it. The default Engine, its
    # fused step built and decoding, leaves every tensor in the storage the caller gave it.
    model = tiny_model(vocab_size=8192, d_model=64, n_layers=1, n_kv_heads=None, d_ff=128, scale=1)
    where = {name: t.data_ptr() for name, t in model.state_dict().items()}
    Engine(model).generate([5, 9, 200], max_new_tokens=4, temperature=0.0)
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == where
    Engine(model, huge_pages=True)
    assert model.tok_emb.weight.data_ptr() % HUGE_PAGE == 0


def test_a_tensor_advised_in_place_keeps_its_memory_and_values():
    # 19 whole huge pages lie inside 40 MB plus an odd start; the advice covers those alone.
    # The tensor lies in a fresh anonymous mapping of its own, so the flags of its head are this
    # call's. (A 40 MB clone, above glibc's largest mmap threshold, was once seen in the heap of
    # a CI worker, its head already advised by an earlier test's tensor.)
    memory = mmap.mmap(-1, 40 * 2**20 + 4096)
    tensor = torch.frombuffer(memory, dtype=torch.float32, offset=20, count=10 * 2**20)
    tensor.copy_(torch.arange(10 * 2**20, dtype=torch.float32))
    copy, where = tensor.clone(), tensor.data_ptr()
    advised = advise_in_place(tensor)
    first = -(-where // HUGE_PAGE) * HUGE_PAGE
    assert advised == (where + tensor.nbytes) // HUGE_PAGE * HUGE_PAGE - first >= 2 * HUGE_PAGE
    assert tensor.data_ptr() == where and torch.equal(tensor, copy)
    assert "hg" in _mapping_flags(first) and "hg" in _mapping_flags(first + advised - 1)
    assert first == where or "hg" not in _mapping_flags(where)  # the head before the first page
    assert advise_in_place(torch.zeros(1000)) == 0  # no whole 2 MB page inside


def test_an_engine_with_huge_pages_advises_its_kv_cache():
    # A cache of 48 MB, above glibc's largest mmap threshold (32 MB), so a mapping of its own
    # (a smaller one may reuse heap memory that an earlier tensor's advice already marked; in CI
    # even a plain Engine's 48 MB cache was seen marked, so only the advised one is checked).
    model = tiny_model(vocab_size=300, d_model=64, n_layers=2, n_kv_heads=None, d_ff=128,
                       max_seq_len=2048)  # fmt: skip
    engine = Engine(model, max_rows=4, huge_pages=True)
    engine.reserve(48, 2048)
    k = engine.cache.k
    inside = -(-k.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    assert k.nbytes > 32 * 2**20 and "hg" in _mapping_flags(inside)
