"""Retrieval: dense (cosine over the encoder's vectors), keyword (BM25) and both fused.

Reciprocal rank fusion (Cormack, Clarke and Büttcher, SIGIR 2009): each list votes
1 / (RRF_K + rank) for each chunk it ranks, rank counted from 1, and the chunks are ordered by
their summed votes. It needs no calibration between a cosine and a BM25 score, which live on
different scales; RRF_K = 60 is the paper's constant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glassformer.rag.encoder import Encoder
from glassformer.rag.store import Store

METHODS = ("fused", "dense", "bm25")
RRF_K = 60
CANDIDATES = 4  # fused: each list contributes CANDIDATES x k chunks to vote on


@dataclass
class Hit:
    chunk: dict  # id, source, chunk, start, end, text, tokens
    score: float  # cosine similarity (dense), BM25 score (bm25) or summed RRF votes (fused)
    ranks: dict[str, int] = field(default_factory=dict)  # its rank in each list, from 1

    def as_json(self) -> dict:
        c = self.chunk
        return {
            "source": c["source"],
            "chunk": c["chunk"],
            "span": [c["start"], c["end"]],
            "score": self.score,
            "ranks": self.ranks,
            "text": c["text"],
        }


def search(store: Store, encoder: Encoder, question: str, k: int, method: str = "fused"):
    """The k best chunks for `question`, best first."""
    if method not in METHODS:
        raise ValueError(f"--method {method!r} is not one of {', '.join(METHODS)}")
    if k < 1:
        raise ValueError(f"--k {k} must be at least 1")
    if not question.strip():
        raise ValueError("the question is empty: ask something")
    store.check_encoder(encoder.name, encoder.dim)
    depth = k if method != "fused" else CANDIDATES * k
    lists = {}
    if method in ("dense", "fused"):
        vector = encoder.encode([question])[0]
        lists["dense"] = store.dense(vector, depth)
    if method in ("bm25", "fused"):
        lists["bm25"] = store.keyword(question, depth)
    if method != "fused":
        ((name, ranked),) = lists.items()
        return [Hit(chunk, score, {name: r}) for r, (chunk, score) in enumerate(ranked, 1)]
    return fuse(lists)[:k]


def fuse(lists: dict[str, list[tuple[dict, float]]], rrf_k: int = RRF_K) -> list[Hit]:
    """Reciprocal rank fusion of ranked (chunk, score) lists; ties keep the first list's order."""
    hits: dict[str, Hit] = {}
    for name, ranked in lists.items():
        for rank, (chunk, _) in enumerate(ranked, 1):
            hit = hits.setdefault(chunk["id"], Hit(chunk, 0.0))
            hit.score += 1.0 / (rrf_k + rank)
            hit.ranks[name] = rank
    return sorted(hits.values(), key=lambda h: -h.score)
