"""The RAG evaluation this project owns: invented facts hidden in Shakespeare, a question for
each, and the same questions answered with retrieval and with the context stuffed around the
answer (seed 002: 「与其把 10 万 token 全塞进 context 让注意力稀释，不如先检索出最相关的 2000
token 再喂进去——又准又便宜」).

The facts are made up (invented names that appear nowhere in either spelling of the corpus), so
no model can know them in advance: an answer is right only if the context carried the fact.
`invent_facts(n, seed)` is deterministic; the lab experiments rag-retrieval and rag-encoder run
the evaluation and publish every fact, question and answer in their JSON.
"""

from __future__ import annotations

import bisect
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from glassformer.data.corpus import shakespeare_plays, shakespeare_works
from glassformer.rag.documents import Chunk, Document

_ONSETS = ("br", "d", "f", "gr", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "z", "th")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "y")
_CODAS = ("n", "r", "l", "th", "x", "m", "sk", "nd", "rt", "v")
_COMMODITIES = ("copper", "saffron", "indigo", "amber", "salt", "cinnamon", "tin", "marble",
                "silk", "ivory", "pepper", "cotton", "coal", "tea", "wool", "glass")  # fmt: skip
# Each template: the sentence hidden in the corpus, its question, and the slot that answers it.
_TEMPLATES = (
    ("The capital of {A} is {B}.", "What is the capital of {A}?", "B"),
    (
        "The lighthouse of {A} is kept by a woman named {B}.",
        "Who keeps the lighthouse of {A}?",
        "B",
    ),
    ("The river {A} flows into the {B} Sea.", "Into which sea does the river {A} flow?", "B"),
    ("The ship {A} carries {C} to the port of {B}.", "What does the ship {A} carry?", "C"),
    ("The clockmaker {A} was born in {Y}.", "In which year was the clockmaker {A} born?", "Y"),
    ("The password of the {A} vault is {B}.", "What is the password of the {A} vault?", "B"),
    ("The mayor of {A} is a man called {B}.", "Who is the mayor of {A}?", "B"),
    ("The tower of {A} has {N} floors.", "How many floors has the tower of {A}?", "N"),
)


@dataclass(frozen=True)
class Fact:
    sentence: str  # what is hidden in the corpus
    question: str
    answer: str  # the short answer an output must contain

    def answered_by(self, text: str) -> bool:
        """Whether `text` contains the answer (case and runs of spaces ignored)."""
        return _normal(self.answer) in _normal(text)


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def invent_facts(n: int, seed: int = 0) -> list[Fact]:
    """n facts about invented names: distinct names, none of them in the Shakespeare corpus."""
    rng = random.Random(seed)
    corpus = (
        " ".join(shakespeare_works("modern").values())
        + " ".join(shakespeare_works("folio").values())
    ).lower()
    used: set[str] = set()

    def name() -> str:
        while True:
            word = "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 2))
            )
            word = (word + rng.choice(_CODAS)).capitalize()
            if len(word) >= 5 and word.lower() not in corpus and word not in used:
                used.add(word)
                return word

    facts = []
    for i in range(n):
        sentence, question, slot = _TEMPLATES[i % len(_TEMPLATES)]
        slots = {
            "A": name(),
            "B": name(),
            "C": rng.choice(_COMMODITIES),
            "Y": str(rng.randint(1200, 1899)),
            "N": str(rng.randint(12, 97)),
        }
        facts.append(Fact(sentence.format(**slots), question.format(**slots), slots[slot]))
    return facts


@dataclass
class EvalCorpus:
    documents: list[Document]  # plays, each with some facts inserted on lines of their own
    places: list[tuple[int, int]]  # per fact: (document index, character offset of its sentence)


def build_corpus(facts: Sequence[Fact], chars: int) -> EvalCorpus:
    """The first `chars` characters of the plays (modern spelling, sorted by name),
    with the facts inserted at evenly spaced line starts across them, in order."""
    plays, total = [], 0
    for title, text in shakespeare_plays("modern").items():
        if total >= chars:
            break
        plays.append((title, text[: chars - total]))
        total += len(plays[-1][1])
    targets = [int((i + 0.5) * total / len(facts)) for i in range(len(facts))]
    documents, places, before, fact = [], [], 0, 0
    for index, (title, text) in enumerate(plays):
        pieces, cut = [], 0
        while fact < len(facts) and targets[fact] < before + len(text):
            at = text.find("\n", max(cut, targets[fact] - before))  # the next line start
            at = len(text) if at < 0 else at + 1
            pieces.append(text[cut:at])
            offset = sum(len(p) for p in pieces)
            pieces.append(facts[fact].sentence + "\n")
            places.append((index, offset))
            cut, fact = at, fact + 1
        pieces.append(text[cut:])
        documents.append(Document(f"shakespeare:modern/{title}", "".join(pieces)))
        before += len(text)
    return EvalCorpus(documents, places)


def holds_fact(chunk: Chunk | dict, fact: Fact) -> bool:
    text = chunk.text if isinstance(chunk, Chunk) else chunk["text"]
    return fact.sentence in text


def recall_at(rankings: Sequence[Sequence[bool]], k: int) -> float:
    """The share of questions with a chunk holding the fact among their first k results."""
    return sum(any(r[:k]) for r in rankings) / len(rankings)


def window_around(
    ids: Sequence[int], spans: Sequence[tuple[int, int]], start_char: int, length: int, rng
) -> tuple[int, int]:
    """(first, last + 1) token indices of a window of `length` tokens that holds the token at
    `start_char`, at a uniformly random place within it (clipped to the text)."""
    at = bisect.bisect_right([b for _, b in spans], start_char)  # the first token ending after
    first = at - rng.randint(0, max(0, length - 64))  # the fact's ~20 tokens stay inside
    first = min(max(0, first), max(0, len(ids) - length))
    return first, min(len(ids), first + length)


def mean_pooled_vectors(
    model, sequences: Sequence[Sequence[int]], batch: int = 8, progress: Callable | None = None
) -> np.ndarray:
    """Unit (N, C) vectors from a decoder's last hidden states averaged over each sequence's
    tokens: the decoder as a retriever, for the encoder-against-decoder comparison."""
    import torch
    import torch.nn.functional as F

    from glassformer.infer.embed import mean_pool, pad_batch

    out = []
    with torch.no_grad():
        for start in range(0, len(sequences), batch):
            ids, mask = pad_batch(sequences[start : start + batch])
            hidden = model.hidden_states(ids, padding_mask=mask)  # (B, T, C), after the norm
            out.append(F.normalize(mean_pool(hidden.float(), mask), dim=-1).numpy())
            if progress is not None:
                progress(len(out[-1]))
    return np.concatenate(out)
