"""The Folio -> modern task, scored: how well a chat model modernises First Folio speeches of a
play it never saw (Macbeth, held out whole as in configs/folio2modern.toml), by chrF and BLEU
(sacrebleu) against the modern edition.

A chat model is asked with the same instruction it is fine-tuned on (train/finetune.py:
folio_chat), zero-shot, or few-shot: k solved examples from the training plays as earlier user
and assistant turns of the conversation, in-context learning (seed 000 §6.2). Decoding is greedy
and stops at the end of the assistant's turn.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from glassformer.data.folio_chat import folio_chat
from glassformer.data.parallel import ParallelPair, corpus_split
from glassformer.infer.engine import Engine
from glassformer.templates import end_of_turn_ids
from glassformer.train.translation import evenly_spaced, score

FOLIO_MAX_CHARS = 120  # the speeches configs/smollm2-lora-folio.toml trains on
MAX_NEW_TOKENS = 96  # a 120-character speech is ~35 tokens; room for a model that rambles


@dataclass(frozen=True)
class Scores:
    chrf: float
    bleu: float
    outputs: list[str]


def held_out_speeches(limit: int | None, max_chars: int = FOLIO_MAX_CHARS) -> list[ParallelPair]:
    """`limit` pairs spread evenly over the held-out test play (all when None)."""
    return evenly_spaced(corpus_split("test", max_chars=max_chars), limit)


def shot_messages(k: int, max_chars: int = FOLIO_MAX_CHARS, seed: int = 0) -> list[dict[str, str]]:
    """k solved examples from the training plays as user/assistant turns (the same every time)."""
    if k == 0:
        return []
    pairs = corpus_split("train", max_chars=max_chars)
    picked = random.Random(seed).sample(pairs, k)
    return [m for p in picked for m in folio_chat(p.folio, p.modern)["messages"]]


def chat_prompts(
    tokenizer: Any, folios: Sequence[str], shots: Sequence[dict] = ()
) -> list[list[int]]:
    """The prompt ids of each speech's instruction after the example turns, ready for the
    assistant's reply (the template's generation prompt)."""
    return [
        tokenizer.encode_chat(
            list(shots) + folio_chat(folio)["messages"], add_generation_prompt=True
        )
        for folio in folios
    ]


@torch.no_grad()
def modernise(
    model: nn.Module,
    tokenizer: Any,
    folios: Sequence[str],
    shots: Sequence[dict] = (),
    max_new_tokens: int = MAX_NEW_TOKENS,
    rows: int = 16,
) -> list[str]:
    """Each speech modernised by a chat model: greedy, `rows` conversations decoded at a time."""
    prompts = chat_prompts(tokenizer, folios, shots)
    stops = end_of_turn_ids(tokenizer)
    slot = min(max(len(p) for p in prompts) + max_new_tokens, model.cfg.max_seq_len)
    engine = Engine(model, max_rows=min(rows, len(prompts)), max_seq_len=slot)
    results = engine.generate_batch(
        prompts, max_new_tokens, temperature=0.0, stop_token_ids=tuple(sorted(stops))
    )
    return [tokenizer.decode([t for t in r.token_ids if t not in stops]).strip() for r in results]


def score_outputs(outputs: Sequence[str], pairs: Sequence[ParallelPair]) -> Scores:
    chrf, bleu = score(outputs, [p.modern for p in pairs])
    return Scores(chrf, bleu, list(outputs))
