"""Cutting token streams to a context window: truncation, sliding window, packing.

Seed 000 §2.4 "超过窗口怎么办": hard truncation keeps the first max_len tokens; a sliding
window of stride < max_len overlaps neighbouring chunks so no token is lost; packing puts
several short documents into one block and records which document each token belongs to,
so attention can be masked per document and positions restart per document. Here `stride`
is the step between window starts, as in the seed's 步长 (Hugging Face's `stride` argument is
the overlap instead; with the seed's 512/256 the two agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PAD_DOCUMENT_ID = -1  # document id of padding tokens in a packed block


def _check_max_len(max_len: int) -> None:
    if max_len < 1:
        raise ValueError(f"max_len={max_len} must be at least 1 (the block length in tokens)")


def truncate(ids: Sequence[int], max_len: int) -> list[int]:
    """Hard truncation: the first max_len ids; the rest is dropped."""
    _check_max_len(max_len)
    return list(ids[:max_len])


def window_starts(n_tokens: int, max_len: int, stride: int) -> list[int]:
    """Start offsets of the sliding windows over n_tokens tokens (see `sliding_windows`)."""
    _check_max_len(max_len)
    if not 1 <= stride <= max_len:
        raise ValueError(
            f"stride={stride} must be in 1..max_len={max_len}: windows overlap by "
            f"max_len - stride tokens, and a stride above max_len would skip tokens"
        )
    if n_tokens == 0:
        return []
    if n_tokens <= max_len:
        return [0]
    starts = list(range(0, n_tokens - max_len + 1, stride))
    if starts[-1] != n_tokens - max_len:
        # Align one last window to the end so the tail is not lost (it overlaps more).
        starts.append(n_tokens - max_len)
    return starts


def sliding_windows(ids: Sequence[int], max_len: int, stride: int) -> list[list[int]]:
    """Windows of max_len ids starting at 0, stride, 2*stride, ...; the last one ends at the
    end of ids. Consecutive windows overlap by max_len - stride (the last by at least that).
    A sequence of at most max_len ids is one window; an empty one gives no windows."""
    starts = window_starts(len(ids), max_len, stride)
    return [list(ids[start : start + max_len]) for start in starts]


@dataclass
class PackedBlock:
    """One block of packed documents, all three lists of the same length (max_len)."""

    input_ids: list[int] = field(default_factory=list)
    document_ids: list[int] = field(default_factory=list)  # 0, 0, 1, 1, 1, 2, ..., -1 for padding
    position_ids: list[int] = field(default_factory=list)  # restarts at 0 for every document

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_documents(self) -> int:
        return len({d for d in self.document_ids if d != PAD_DOCUMENT_ID})


def pack(docs: Sequence[Sequence[int]], max_len: int, pad_id: int = 0) -> list[PackedBlock]:
    """Pack documents, in order, into blocks of exactly max_len tokens.

    Greedy: a document goes into the current block if it fits, otherwise the current block
    is padded to max_len and a new one starts. Documents are never cut at a block edge (the
    seed packs at document boundaries); only a document longer than max_len is split into
    pieces of max_len, and each piece is its own document with positions from 0. Padding
    tokens are pad_id with document id -1. The non-padding tokens of the blocks, read in
    order, are exactly the documents concatenated. Empty documents are skipped.
    """
    _check_max_len(max_len)
    blocks: list[PackedBlock] = []
    current = PackedBlock()

    def close(block: PackedBlock) -> None:
        n_pad = max_len - len(block)
        block.input_ids += [pad_id] * n_pad
        block.document_ids += [PAD_DOCUMENT_ID] * n_pad
        block.position_ids += [0] * n_pad
        blocks.append(block)

    for doc in docs:
        for start in range(0, len(doc), max_len):
            piece = list(doc[start : start + max_len])
            if len(current) + len(piece) > max_len:
                close(current)
                current = PackedBlock()
            document_id = current.document_ids[-1] + 1 if current.document_ids else 0
            current.input_ids += piece
            current.document_ids += [document_id] * len(piece)
            current.position_ids += range(len(piece))
    if len(current):
        close(current)
    return blocks
