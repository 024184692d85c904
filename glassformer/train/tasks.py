"""Training tasks: what the trainer feeds the model and how it scores it.

A task owns the corpus, the tokenizer and the examples, and hands the trainer batches that go
straight into `model.loss(**batch)`. The trainer itself (optimizer, schedule, checkpoints,
exact resume) is the same for every family; a batch is a pure function of (seed, step) so that
resuming repeats an uninterrupted run. task_table.py names every task.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from glassformer.config import ModelConfig
from glassformer.data import (
    batch_indices,
    get_batch,
    make_lm_examples,
    shakespeare_plays,
    split_paragraphs,
    train_val_split,
)
from glassformer.data.corpus import read_text_file
from glassformer.tokenizers import BPETokenizer, CharTokenizer
from glassformer.train.config import RunConfig


def load_documents(data_cfg) -> list[str]:
    """The corpus as a list of documents (plays, files or paragraphs)."""
    if data_cfg.corpus == "shakespeare":
        docs = list(shakespeare_plays(data_cfg.spelling).values())
    else:
        path = Path(data_cfg.corpus)
        files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(
                f"data.corpus={data_cfg.corpus!r} is neither 'shakespeare' nor a .txt file or a "
                "folder of .txt files"
            )
        docs = [read_text_file(f) for f in files]
    if data_cfg.documents == "paragraph":
        docs = [p for doc in docs for p in split_paragraphs(doc)]
    return docs


def build_tokenizer(data_cfg, documents: list[str]):
    if data_cfg.tokenizer == "char":
        return CharTokenizer.from_text("".join(documents))
    return BPETokenizer.train(documents, vocab_size=data_cfg.bpe_vocab_size)


def unigram_entropy(docs_ids: list[list[int]]) -> float:
    """Entropy in nats of the token frequency distribution: the loss of a model that ignores
    context entirely. A model that learned something must beat it."""
    counts = Counter(t for ids in docs_ids for t in ids)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


class Task:
    """The interface the trainer uses. Subclasses fill in the data."""

    name: ClassVar[str] = ""
    baseline_name: str = "baseline"
    baseline_loss: float | None = None
    tokenizer: Any

    def model_config(self, run: RunConfig) -> ModelConfig:
        return run.model_config(self.tokenizer.vocab_size)

    @property
    def n_train(self) -> int:
        raise NotImplementedError

    def train_batch(self, step: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
        """The batch of one (micro-)step: a pure function of (step, batch_size, seed)."""
        raise NotImplementedError

    def val_batches(self, batch_size: int, n_batches: int) -> Iterator[dict[str, torch.Tensor]]:
        """A fixed set of validation batches, the same at every evaluation."""
        raise NotImplementedError

    def tokens_in(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"].numel()


class LanguageModelingTask(Task):
    """Next-token prediction over chunked documents (seed 000 §2.2, §2.4): GPT and RNN."""

    name = "lm"
    baseline_name = "unigram entropy"

    def __init__(self, run: RunConfig, tokenizer=None) -> None:
        docs = load_documents(run.data)
        self.tokenizer = tokenizer or build_tokenizer(run.data, docs)
        block_size = run.model_config(self.tokenizer.vocab_size).max_seq_len
        docs_ids = [self.tokenizer.encode(doc) for doc in docs]
        train_docs, val_docs = train_val_split(docs_ids, run.data.val_fraction)
        self.baseline_loss = unigram_entropy(train_docs)
        stride = run.data.stride if run.data.chunking == "sliding" else None
        self.train_examples = make_lm_examples(train_docs, block_size, run.data.chunking, stride)
        self.val_examples = make_lm_examples(val_docs, block_size, "sliding", block_size)
        if len(self.train_examples) == 0 or len(self.val_examples) == 0:
            raise ValueError(
                f"the corpus gives {len(self.train_examples)} training and "
                f"{len(self.val_examples)} validation blocks of {block_size + 1} tokens: use a "
                "larger corpus or a smaller model.max_seq_len"
            )

    @property
    def n_train(self) -> int:
        return len(self.train_examples)

    def train_batch(self, step: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
        return get_batch(self.train_examples, batch_indices(self.n_train, batch_size, step, seed))

    def val_batches(self, batch_size: int, n_batches: int) -> Iterator[dict[str, torch.Tensor]]:
        n = len(self.val_examples)
        picks = torch.linspace(0, n - 1, min(n, batch_size * n_batches)).round().long()
        for chunk in picks.split(batch_size):
            yield get_batch(self.val_examples, chunk)
