"""The retriever's half of RAG: an encoder that turns text into unit vectors.

Seed 002: 「RAG 里管检索的 embedding 模型，多数是 encoder 系的后代」. The vectors are exactly
`glassformer embed`'s: the tokenizer's ids with its special tokens ([CLS] ... [SEP]), cut to
the model's context keeping the closing token, mean-pooled and L2-normalized
(infer/embed.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from glassformer.infer.embed import embed


@dataclass
class Encoder:
    model: nn.Module
    tokenizer: object
    name: str  # what the store records: the alias or path it was loaded from

    @classmethod
    def load(cls, name: str) -> Encoder:
        from glassformer.interop.pretrained import from_pretrained

        model, tokenizer = from_pretrained(name)
        if tokenizer is None:
            raise ValueError(f"--embed-model {name} has no tokenizer.json: RAG needs one")
        if model.cfg.family != "bert":
            raise ValueError(
                f"--embed-model {name} is a {model.cfg.family!r} model, not an encoder: "
                "retrieval embeds with an encoder such as minilm"
            )
        return cls(model.eval(), tokenizer, name)

    @property
    def dim(self) -> int:
        return self.model.cfg.d_model

    def ids(self, text: str) -> list[int]:
        """The ids `glassformer embed` encodes for `text`."""
        ids = self.tokenizer.encode(text)
        limit = self.model.cfg.max_seq_len
        return ids if len(ids) <= limit else ids[: limit - 1] + ids[-1:]

    @torch.no_grad()
    def encode(
        self,
        texts: Sequence[str],
        batch_size: int = 32,
        progress: Callable[[int], object] | None = None,
    ) -> np.ndarray:
        """(N, dim) float32 unit vectors. Texts are embedded in batches of similar length
        (sorted by token count, so little of a batch is padding) and returned in the given
        order; progress(n) is called after each batch with the texts done in it."""
        sequences = [self.ids(t) for t in texts]
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        out = np.empty((len(sequences), self.dim), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            vectors = embed(self.model, [sequences[i] for i in batch], batch_size=batch_size)
            out[batch] = vectors.float().numpy()
            if progress is not None:
                progress(len(batch))
        return out
