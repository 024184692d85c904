"""Language-modeling examples, resumable batch order, and the train/validation split.

Seed 000 §2.4 (chunking) and §2.2 (teacher forcing): each example is a chunk of
block_size + 1 tokens; the input is chunk[:-1] and the target at every position is the next
token, chunk[1:]. Packed examples carry document and position ids, and targets are -100
(ignored by cross-entropy) wherever the next token belongs to another document or is padding.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from glassformer.data.chunking import PAD_DOCUMENT_ID, pack, truncate, window_starts

CHUNKINGS = ("truncate", "sliding", "pack")
IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


@dataclass
class LMExamples:
    """N language-modeling chunks of block_size + 1 tokens each (shape legend: N examples,
    T = block_size). document_ids is None when every row is one unpadded document piece."""

    tokens: torch.Tensor  # (N, T+1) int64
    chunking: str
    document_ids: torch.Tensor | None = None  # (N, T+1) int64, -1 marks padding
    position_ids: torch.Tensor | None = None  # (N, T+1) int64, packed only

    @property
    def block_size(self) -> int:
        return self.tokens.shape[1] - 1

    def __len__(self) -> int:
        return self.tokens.shape[0]


def _rows(lists: Sequence[Sequence[int]], length: int) -> torch.Tensor:
    return torch.tensor(lists, dtype=torch.long).view(-1, length)  # view: (0, length) if empty


def _padded_rows(
    chunks: list[list[int]], length: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    tokens = _rows([chunk + [pad_id] * (length - len(chunk)) for chunk in chunks], length)
    if all(len(chunk) == length for chunk in chunks):
        return tokens, None
    pad = PAD_DOCUMENT_ID
    document_ids = [[0] * len(chunk) + [pad] * (length - len(chunk)) for chunk in chunks]
    return tokens, _rows(document_ids, length)


def make_lm_examples(
    docs_ids: Sequence[Sequence[int]],
    block_size: int,
    chunking: str,
    stride: int | None = None,
    pad_id: int = 0,
) -> LMExamples:
    """Cut tokenized documents into LM examples of block_size + 1 tokens.

    truncate: the first block_size + 1 tokens of each document.
    sliding: windows of block_size + 1 tokens every `stride` tokens. The default stride,
        block_size, makes neighbours share one token, so every token is a target once (only
        the end-aligned last window repeats some); smaller strides give more context.
    pack: short documents share a block, with document ids and restarting positions.
    Short documents are padded with pad_id (targets -100); a document of fewer than 2 tokens
    has no next-token target and is dropped by truncate and sliding. To teach a model where
    a document ends, append the EOS id to each document before calling this.
    """
    if chunking not in CHUNKINGS:
        raise ValueError(f"chunking={chunking!r} is not known: pick one of {', '.join(CHUNKINGS)}")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be at least 1")
    if stride is not None and chunking != "sliding":
        raise ValueError(
            f"stride={stride} only applies to chunking='sliding', not {chunking!r}; "
            f"drop stride or use chunking='sliding'"
        )
    length = block_size + 1
    if chunking == "pack":
        blocks = pack(docs_ids, length, pad_id=pad_id)
        return LMExamples(
            tokens=_rows([block.input_ids for block in blocks], length),
            chunking=chunking,
            document_ids=_rows([block.document_ids for block in blocks], length),
            position_ids=_rows([block.position_ids for block in blocks], length),
        )
    docs = [doc for doc in docs_ids if len(doc) >= 2]
    if chunking == "truncate":
        chunks = [truncate(doc, length) for doc in docs]
    else:
        stride = block_size if stride is None else stride
        chunks = [
            list(doc[start : start + length])
            for doc in docs
            for start in window_starts(len(doc), length, stride)
        ]
    tokens, document_ids = _padded_rows(chunks, length, pad_id)
    return LMExamples(tokens=tokens, chunking=chunking, document_ids=document_ids)


def lm_targets(tokens: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    """Next-token targets (…, T) of chunks (…, T+1): -100 where the next token is padding or
    starts another document, so no loss crosses a document boundary."""
    targets = tokens[..., 1:].clone()
    if document_ids is not None:
        next_doc = document_ids[..., 1:]
        crosses = (next_doc != document_ids[..., :-1]) | (next_doc == PAD_DOCUMENT_ID)
        targets[crosses] = IGNORE_INDEX
    return targets


def get_batch(examples: LMExamples, indices: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch for these example indices: input_ids and targets (B, T), and for packed
    examples document_ids and position_ids (B, T) of the inputs."""
    tokens = examples.tokens[indices]  # (B, T+1)
    document_ids = None if examples.document_ids is None else examples.document_ids[indices]
    batch = {"input_ids": tokens[:, :-1], "targets": lm_targets(tokens, document_ids)}
    if examples.chunking == "pack":
        assert document_ids is not None and examples.position_ids is not None
        batch["document_ids"] = document_ids[:, :-1]
        batch["position_ids"] = examples.position_ids[indices][:, :-1]
    return batch


@functools.lru_cache(maxsize=4)
def _epoch_permutation(n_examples: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(n_examples, generator=generator)


def batch_indices(n_examples: int, batch_size: int, step: int, seed: int) -> torch.Tensor:
    """Example indices of training step `step`: a pure function of its arguments.

    The run walks through epoch-wise permutations (epoch e shuffled by a generator seeded with
    seed + e), batch_size indices per step, a batch running on into the next epoch when one
    ends. So a run resumed at step s sees exactly the batches an uninterrupted run would.
    """
    if n_examples < 1:
        raise ValueError(f"n_examples={n_examples} must be at least 1: there is nothing to batch")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    if step < 0:
        raise ValueError(f"step={step} must be >= 0 (the first step is 0)")
    parts = []
    position = step * batch_size  # index into the endless stream of shuffled epochs
    end = position + batch_size
    while position < end:
        epoch, offset = divmod(position, n_examples)
        take = min(end - position, n_examples - offset)
        parts.append(_epoch_permutation(n_examples, seed + epoch)[offset : offset + take])
        position += take
    return torch.cat(parts)  # cat copies, so callers cannot alter the cached permutations


Doc = TypeVar("Doc", str, list[int])


def train_val_split(docs: Sequence[Doc], val_fraction: float) -> tuple[list[Doc], list[Doc]]:
    """Split every document: its last val_fraction goes to validation, the rest to training,
    so each document (each play) is represented on both sides."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(
            f"val_fraction={val_fraction} must be in [0, 1): it is the share of every "
            f"document held out for validation, e.g. 0.1"
        )
    train, val = [], []
    for doc in docs:
        cut = len(doc) - round(len(doc) * val_fraction)
        train.append(doc[:cut])
        val.append(doc[cut:])
    return train, val
