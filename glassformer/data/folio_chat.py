"""The built-in fine-tuning task: "modernise this First Folio speech" as chat instructions, from
the installed plays, whole plays held out as in configs/folio2modern.toml (train/translation.py:
validation twelfth_night, test macbeth). train/finetune.py tokenizes these records; `glassformer
finetune-data folio` writes them as JSONL."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from glassformer.data.parallel import corpus_split

FOLIO_INSTRUCTION = (
    "Modernise the spelling and punctuation of this speech from Shakespeare's First Folio"
    " (1623). Reply with the modern text only."
)


def folio_chat(folio: str, modern: str | None = None) -> dict[str, Any]:
    """One instruction: the user gives a Folio speech, the assistant (if given) its modern text."""
    messages = [{"role": "user", "content": f"{FOLIO_INSTRUCTION}\n\n{folio}"}]
    if modern is not None:
        messages.append({"role": "assistant", "content": modern})
    return {"messages": messages}


def folio_chat_records(split: str, max_chars: int, limit: int | None = None, seed: int = 0):
    """The chat records of one split of the Folio -> modern corpus, whole plays held out as in
    configs/folio2modern.toml (train/translation.py: validation twelfth_night, test macbeth);
    `limit` keeps that many, drawn at random with `seed` (the same ones every time)."""
    pairs = corpus_split(split, max_chars=max_chars)
    if limit is not None and limit < len(pairs):
        pairs = random.Random(seed).sample(pairs, limit)
    return [folio_chat(pair.folio, pair.modern) for pair in pairs]


def write_folio_jsonl(out_dir: str | Path, max_chars: int) -> dict[str, Path]:
    """train.jsonl, validation.jsonl and test.jsonl of the Folio task in out_dir (each line
    also carries "play")."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split in ("train", "validation", "test"):
        path = out_dir / f"{split}.jsonl"
        lines = [
            json.dumps({**folio_chat(p.folio, p.modern), "play": p.play}, ensure_ascii=False)
            for p in corpus_split(split, max_chars=max_chars)
        ]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        written[split] = path
    return written


FOLIO_TRAIN_EXAMPLES = 2000  # random training pairs tokenized (a short run sees far fewer)
FOLIO_VAL_EXAMPLES = 200
