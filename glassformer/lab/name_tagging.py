"""The lab's named-entity task (seed 000 §6.3's 命名实体识别) on the installed plays: tag each
character of the dialogue 1 when it belongs to a character's name ("Helena", "Parolles"), else 0.
A name is a one-word speech header ("HELENA.") that the dialogue never writes in lower case, so
"King" and "Page" are not names. Headers and stage directions are removed and whitespace
collapsed, so nothing but the words is left. Per play: train on the first 75%, validate on the
next 10%, test on the last 15%. exp_bert_vs_gpt_classification trains its twin taggers on it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from glassformer.lab.fit import Batch, step_generator
from glassformer.tokenizers import CharTokenizer

SPLITS = {"train": 0.75, "val": 0.10, "test": 0.15}  # of every play, in this order
NAME_SHARE = 0.5  # training windows that hold a name: names are 1% of the words
HEADER = re.compile(r"^([A-Z][A-Z' ]*)\.\s*$", re.MULTILINE)  # a speech header: "HELENA."
STAGE = re.compile(r"\[[^\]]*\]")  # "[Enter PAROLLES.]"
WORD = re.compile(r"[A-Za-z']+")


def dialogue(text: str) -> str:
    """A play's spoken words: speech headers and stage directions removed, whitespace single."""
    return re.sub(r"\s+", " ", STAGE.sub(" ", HEADER.sub(" ", text))).strip()


def speaker_names(plays: list[str]) -> frozenset[str]:
    """The one-word speech headers ("HELENA." -> "Helena") that no play's dialogue writes in lower
    case: proper names, not roles like "King" or words like "Page"."""
    headers = {h for text in plays for h in HEADER.findall(text) if " " not in h}
    lower = {w for text in plays for w in WORD.findall(dialogue(text)) if w.islower()}
    return frozenset(h.title() for h in headers if h.lower() not in lower)


def name_tags(text: str, names: frozenset[str]) -> list[int]:
    """1 for every character of a word in `names`, 0 elsewhere."""
    tags = [0] * len(text)
    for match in WORD.finditer(text):
        if match.group() in names:
            tags[match.start() : match.end()] = [1] * (match.end() - match.start())
    return tags


def word_spans(text: str) -> Tensor:
    """(N, 2) [start, end) of every word."""
    return torch.tensor([m.span() for m in WORD.finditer(text)], dtype=torch.long).view(-1, 2)


@dataclass(frozen=True)
class Split:
    ids: Tensor  # (N,) character ids
    tags: Tensor  # (N,) 1 inside a name
    words: Tensor  # (W, 2) word spans

    @property
    def name_starts(self) -> Tensor:
        return self.words[self.tags[self.words[:, 0]] == 1, 0]


@dataclass(frozen=True)
class NameData:
    tokenizer: CharTokenizer
    names: frozenset[str]
    splits: dict[str, Split]


def cut(text: str) -> list[str]:
    """text in SPLITS' proportions, each cut at a space so no word is split."""
    pieces, start, at = [], 0, 0.0
    for share in SPLITS.values():
        at += share
        end = len(text) if at >= 1 - 1e-9 else text.find(" ", int(len(text) * at))
        end = len(text) if end < 0 else end
        pieces.append(text[start:end])
        start = end
    return pieces


@lru_cache(maxsize=2)
def name_data(chars_per_play: int | None = None) -> NameData:
    """Every play's dialogue (its first chars_per_play characters, None: whole), cut into train,
    val and test; each split the plays' pieces joined by a space."""
    from glassformer.data.corpus import shakespeare_plays

    plays = list(shakespeare_plays("modern").values())
    names = speaker_names(plays)
    pieces = [cut(dialogue(p)[:chars_per_play]) for p in plays]
    texts = {split: " ".join(p[i] for p in pieces) for i, split in enumerate(SPLITS)}
    tokenizer = CharTokenizer.from_text("".join(texts.values()))
    splits = {
        split: Split(
            torch.tensor(tokenizer.encode(t)), torch.tensor(name_tags(t, names)), word_spans(t)
        )
        for split, t in texts.items()
    }
    return NameData(tokenizer, names, splits)


def window_batch(split: Split, batch_size: int, length: int, generator: torch.Generator) -> Batch:
    """batch_size windows of `length` characters with their tags; a NAME_SHARE of them placed
    to hold a name's first character somewhere in their first half."""
    starts = torch.randint(0, len(split.ids) - length, (batch_size,), generator=generator)
    named = torch.rand(batch_size, generator=generator) < NAME_SHARE
    mentions = split.name_starts
    if len(mentions) and named.any():
        pick = mentions[torch.randint(0, len(mentions), (int(named.sum()),), generator=generator)]
        back = torch.randint(0, length // 2, (len(pick),), generator=generator)
        starts[named] = (pick - back).clamp(0, len(split.ids) - length)
    rows = starts[:, None] + torch.arange(length)  # (B, T)
    return {"input_ids": split.ids[rows], "targets": split.tags[rows]}


def batches(split: Split, batch_size: int, length: int, seed: int) -> Callable[[int], Batch]:
    """batch(step) for fit(): a pure function of (seed, step), the same for both models."""

    def batch(step: int) -> Batch:
        return window_batch(split, batch_size, length, step_generator(seed, step))

    return batch
