"""BERT's training tasks (seed 000 §6.3): masked-LM pretraining and sequence classification.

Both feed the trainer [CLS] text [SEP] rows padded to the block size with a padding mask. The
MLM task corrupts 15% of the real tokens per step (data/mlm.py) and scores the model against
the unigram entropy of what it must predict; the genre task labels First Folio speeches with
their play's genre (data/genre.py) and scores accuracy against always guessing the majority.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence

import torch
from tokenizers import AddedToken
from torch import nn

from glassformer.config import ConfigError, ModelConfig
from glassformer.data import batch_indices, train_val_split, window_starts
from glassformer.data.genre import GENRES, genre_split
from glassformer.data.mlm import mask_tokens, mlm_generator
from glassformer.interop.checkpoint import read_config, resolve_checkpoint
from glassformer.tokenizers import BPETokenizer, load_tokenizer, require_token_ids
from glassformer.train.config import RunConfig
from glassformer.train.tasks import Task, load_documents, unigram_entropy

PAD, CLS, SEP, MASK = "[PAD]", "[CLS]", "[SEP]", "[MASK]"
BERT_SPECIAL_TOKENS = (PAD, CLS, SEP, MASK)  # ids 0..3 in a tokenizer trained here
VAL_MASK_SEED = 20181011  # validation masks are fixed across runs (BERT's arXiv date)


def train_bert_tokenizer(texts: Sequence[str], vocab_size: int) -> BPETokenizer:
    """A byte-level BPE with BERT's special tokens. [MASK] strips the space before it (as
    RoBERTa's <mask> does), so "to [MASK]" asks for the token " be", spelled as in training."""
    special = [AddedToken(t, special=True, lstrip=t == MASK) for t in BERT_SPECIAL_TOKENS]
    return BPETokenizer.train(texts, vocab_size=vocab_size, special_tokens=special)


class SpecialIds:
    """The ids of [PAD] [CLS] [SEP] [MASK] in a tokenizer (ours or a Hugging Face BERT's)."""

    def __init__(self, tokenizer) -> None:
        self.pad, self.cls, self.sep, self.mask = require_token_ids(
            tokenizer,
            BERT_SPECIAL_TOKENS,
            "a BERT task (let the task train its tokenizer, or use a BERT checkpoint's)",
        )
        self.all = [self.pad, self.cls, self.sep, self.mask]


def encode_all(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of many texts, without special tokens; in parallel when the tokenizer wraps a
    Hugging Face one (tens of thousands of speeches)."""
    hf = getattr(tokenizer, "hf", None)
    if isinstance(tokenizer, BPETokenizer) and hf is not None:
        return [e.ids for e in hf.encode_batch(list(texts), add_special_tokens=False)]
    return [tokenizer.encode(text) for text in texts]


def bert_rows(
    pieces: Sequence[Sequence[int]], block_size: int, ids: SpecialIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """[CLS] piece [SEP] padded to block_size: ids (N, T) and padding mask (N, T), True = real.
    Pieces longer than block_size - 2 are cut (the caller chunks them first if that matters)."""
    rows, masks = [], []
    for piece in pieces:
        row = [ids.cls, *piece[: block_size - 2], ids.sep]
        rows.append(row + [ids.pad] * (block_size - len(row)))
        masks.append([True] * len(row) + [False] * (block_size - len(row)))
    tokens = torch.tensor(rows, dtype=torch.long).view(-1, block_size)
    return tokens, torch.tensor(masks, dtype=torch.bool).view(-1, block_size)


def _with_padding(batch: dict[str, torch.Tensor], padding_mask: torch.Tensor) -> dict:
    """Cut the columns no row uses (short speeches need not pay for the whole block) and add
    the padding mask only where some row is still padded: a mask costs attention time."""
    width = int(padding_mask.sum(1).max())
    for key, value in batch.items():
        if value.dim() == 2:
            batch[key] = value[:, :width]
    padding_mask = padding_mask[:, :width]
    if not bool(padding_mask.all()):
        batch["padding_mask"] = padding_mask
    return batch


def _check_bert(cfg: ModelConfig, task: str) -> None:
    if cfg.family != "bert":
        raise ConfigError(
            f'data.task={task!r} trains an encoder: set model.family = "bert" (got '
            f"{cfg.family!r}), e.g. configs/bert-shakespeare.toml"
        )


class MaskedLanguageModelingTask(Task):
    """BERT pretraining: windows of the corpus as [CLS] window [SEP], 15% of tokens masked."""

    name = "mlm"
    baseline_name = "unigram entropy"

    def __init__(self, run: RunConfig, tokenizer=None) -> None:
        if tokenizer is None and run.data.tokenizer != "bpe":
            raise ConfigError(
                f'data.tokenizer={run.data.tokenizer!r}: the mlm task needs "bpe" (a byte-level '
                "BPE trained with [PAD] [CLS] [SEP] [MASK])"
            )
        docs = load_documents(run.data)
        self.tokenizer = tokenizer or train_bert_tokenizer(docs, run.data.bpe_vocab_size)
        self.ids = SpecialIds(self.tokenizer)
        self.nsp = run.data.nsp
        self.block_size = self.model_config(run).max_seq_len
        if self.block_size < 3:
            raise ConfigError(f"model.max_seq_len={self.block_size} leaves no room for text")
        docs_ids = encode_all(self.tokenizer, docs)
        train_docs, val_docs = train_val_split(docs_ids, run.data.val_fraction)
        # Masked targets are a uniform sample of the real tokens, so their unigram entropy is
        # that of the training text: what a model that ignores context scores.
        self.baseline_loss = unigram_entropy(train_docs)
        stride = run.data.stride or self.block_size - 2
        self.train_pieces = self._windows(train_docs, stride)
        self.val_pieces = self._windows(val_docs, self.block_size - 2)
        self.train_rows, self.train_pad = bert_rows(self.train_pieces, self.block_size, self.ids)
        self.val_rows, self.val_pad = bert_rows(self.val_pieces, self.block_size, self.ids)
        if len(self.train_rows) == 0 or len(self.val_rows) == 0:
            raise ValueError(
                f"the corpus gives {len(self.train_rows)} training and {len(self.val_rows)} "
                "validation rows: use a larger corpus or a smaller model.max_seq_len"
            )

    def _windows(self, docs_ids: list[list[int]], stride: int) -> list[list[int]]:
        width = self.block_size - 2
        return [
            doc[start : start + width]
            for doc in docs_ids
            for start in window_starts(len(doc), width, min(stride, width))
        ]

    def model_config(self, run: RunConfig) -> ModelConfig:
        cfg = run.model_config(self.tokenizer.vocab_size)
        _check_bert(cfg, self.name)
        if not cfg.mlm_head:
            raise ConfigError("data.task='mlm' needs the masked-LM head: set model.mlm_head = true")
        if self.nsp:
            if cfg.type_vocab_size < 2:
                raise ConfigError("data.nsp needs segments A and B: set model.type_vocab_size = 2")
            cfg = cfg.replace(nsp_head=True, pooler=True)
        return cfg.replace(pad_token_id=self.ids.pad)

    @property
    def n_train(self) -> int:
        return len(self.train_rows)

    def _pairs(self, pieces, picks, generator) -> dict[str, torch.Tensor]:
        """[CLS] A [SEP] B [SEP] rows for next-sentence prediction: A is the first half of a
        window; B is its second half (label 0, IsNext) or, for half of the rows, the second
        half of another window (label 1, NotNext), as in BERT's pretraining data."""
        width = self.block_size - 3  # room for [CLS] and two [SEP]
        not_next = torch.rand(len(picks), generator=generator) < 0.5
        others = torch.randint(len(pieces) - 1, (len(picks),), generator=generator)
        tokens, types, labels = [], [], []
        for k, i in enumerate(picks.tolist()):
            piece = pieces[i][:width]
            a, b = piece[: len(piece) // 2], piece[len(piece) // 2 :]
            if not_next[k]:
                j = int(others[k]) + int(others[k] >= i)  # any window but this one
                other = pieces[j][:width]
                b = other[len(other) // 2 :][: width - len(a)]
            row = [self.ids.cls, *a, self.ids.sep, *b, self.ids.sep]
            tokens.append(row)
            types.append([0] * (len(a) + 2) + [1] * (len(b) + 1))
            labels.append(int(not_next[k]))
        rows, pad = bert_rows([t[1:-1] for t in tokens], self.block_size, self.ids)
        type_ids = torch.zeros_like(rows)
        for r, t in enumerate(types):
            type_ids[r, : len(t)] = torch.tensor(t)
        batch = self._masked(rows, pad, generator)
        batch["token_type_ids"] = type_ids[:, : batch["input_ids"].shape[1]]
        batch["nsp_labels"] = torch.tensor(labels)
        return batch

    def _masked(self, rows, padding_mask, generator) -> dict[str, torch.Tensor]:
        input_ids, targets = mask_tokens(
            rows,
            mask_token_id=self.ids.mask,
            special_ids=self.ids.all,
            vocab_size=self.tokenizer.vocab_size,
            generator=generator,
        )
        return _with_padding({"input_ids": input_ids, "targets": targets}, padding_mask)

    def train_batch(self, step: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
        picks = batch_indices(self.n_train, batch_size, step, seed)
        if self.nsp:
            return self._pairs(self.train_pieces, picks, mlm_generator(seed, step))
        return self._masked(
            self.train_rows[picks], self.train_pad[picks], mlm_generator(seed, step)
        )

    def val_batches(self, batch_size: int, n_batches: int) -> Iterator[dict[str, torch.Tensor]]:
        n = len(self.val_rows)
        picks = torch.linspace(0, n - 1, min(n, batch_size * n_batches)).round().long()
        for i, chunk in enumerate(picks.split(batch_size)):
            yield self._masked(
                self.val_rows[chunk], self.val_pad[chunk], mlm_generator(VAL_MASK_SEED, i)
            )

    def evaluate(self, model: nn.Module, batch_size: int = 32, n_batches: int = 50) -> dict:
        losses = []
        with torch.no_grad():
            for batch in self.val_batches(batch_size, n_batches):
                losses.append(model.loss(**batch).ce_loss.item())
        return {"val_loss": sum(losses) / len(losses), "baseline_loss": self.baseline_loss}


class GenreTask(Task):
    """First Folio genre (comedy / history / tragedy) of a speech; whole plays held out."""

    name = "genre"
    baseline_name = "class-prior entropy"

    def __init__(self, run: RunConfig, tokenizer=None) -> None:
        train, test = genre_split()
        if tokenizer is None and run.train.init_from:
            tokenizer = load_tokenizer(resolve_checkpoint(run.train.init_from))
        self.tokenizer = tokenizer or train_bert_tokenizer(
            [text for text, _, _ in train], run.data.bpe_vocab_size
        )
        self.ids = SpecialIds(self.tokenizer)
        self.block_size = self.model_config(run).max_seq_len
        self.train_rows, self.train_pad, self.train_labels = self._encode(train)
        self.test_rows, self.test_pad, self.test_labels = self._encode(test)
        self.train_plays = sorted({play for _, _, play in train})
        self.test_plays = sorted({play for _, _, play in test})
        counts = Counter(self.train_labels.tolist())
        total = sum(counts.values())
        self.baseline_loss = -sum(c / total * math.log(c / total) for c in counts.values())
        self.majority = counts.most_common(1)[0][0]  # the majority class of the training plays

    def _encode(self, examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, pad = bert_rows(
            encode_all(self.tokenizer, [text for text, _, _ in examples]), self.block_size, self.ids
        )
        return rows, pad, torch.tensor([label for _, label, _ in examples], dtype=torch.long)

    def model_config(self, run: RunConfig) -> ModelConfig:
        if run.train.init_from:
            # Fine-tuning: the pretrained encoder's shape; its masked-LM head is not needed.
            cfg = read_config(run.train.init_from)
        else:
            cfg = run.model_config(self.tokenizer.vocab_size)
        _check_bert(cfg, self.name)
        return cfg.replace(
            n_classes=len(GENRES), pooler=True, mlm_head=False, pad_token_id=self.ids.pad
        )

    @property
    def n_train(self) -> int:
        return len(self.train_rows)

    def _batch(self, rows, pad, labels, picks) -> dict[str, torch.Tensor]:
        return _with_padding({"input_ids": rows[picks], "labels": labels[picks]}, pad[picks])

    def train_batch(self, step: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
        picks = batch_indices(self.n_train, batch_size, step, seed)
        return self._batch(self.train_rows, self.train_pad, self.train_labels, picks)

    def val_batches(self, batch_size: int, n_batches: int) -> Iterator[dict[str, torch.Tensor]]:
        # The held-out plays, an evenly spread subset for the trainer's running loss.
        n = len(self.test_rows)
        picks = torch.linspace(0, n - 1, min(n, batch_size * n_batches)).round().long()
        for chunk in picks.split(batch_size):
            yield self._batch(self.test_rows, self.test_pad, self.test_labels, chunk)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch_size: int = 64) -> dict:
        """Accuracy on every speech of the held-out plays, next to the majority baseline."""
        model.eval()
        predictions = []
        for chunk in torch.arange(len(self.test_rows)).split(batch_size):
            batch = self._batch(self.test_rows, self.test_pad, self.test_labels, chunk)
            hidden = model(batch["input_ids"], padding_mask=batch.get("padding_mask"))
            predictions.append(model.classify(hidden).argmax(-1))
        predicted = torch.cat(predictions)
        correct = predicted == self.test_labels
        result = {
            "accuracy": correct.float().mean().item(),
            "majority_accuracy": (self.test_labels == self.majority).float().mean().item(),
            "majority_class": GENRES[self.majority],
            "n_test": len(self.test_labels),
        }
        for index, genre in enumerate(GENRES):
            of_genre = self.test_labels == index
            result[f"accuracy_{genre}"] = correct[of_genre].float().mean().item()
        return result
