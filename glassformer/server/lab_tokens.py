"""What each token of the lab's attention explorer is (server/lab.py, seed 002 "token ≠ 字"): a
whole piece of text, the vocabulary's unknown token (MiniLM's [UNK] stands for any character its
vocabulary lacks), or a byte piece (byte-level BPE cuts a character like 猫 into pieces of its
UTF-8 bytes, none a character alone). The page marks them, so a row of [UNK] is not read as the
model looking at 猫.
"""

from __future__ import annotations

import re
from typing import Any

from glassformer.tokenize import model_vocabulary

TOKEN, UNK, BYTE = "token", "unk", "byte"
SPLIT_LABEL = re.compile(r"\(\d+/\d+\)$")  # inspect.token_texts' "猫(1/3)"


def unk_token(tokenizer: Any) -> tuple[str, int] | None:
    """The vocabulary's unknown token and its id (WordPiece's [UNK]), if it has one."""
    hf = getattr(tokenizer, "hf", None)
    token = getattr(getattr(hf, "model", None), "unk_token", None)
    token_id = hf.token_to_id(token) if token else None
    return None if token_id is None else (token, token_id)


def token_kinds(tokenizer: Any, ids: list[int]) -> list[str]:
    """One of "token", "unk", "byte" per id."""
    vocabulary = model_vocabulary(tokenizer, "")
    unk = unk_token(tokenizer)
    kinds = []
    for token_id in ids:
        if unk is not None and token_id == unk[1]:
            kinds.append(UNK)
            continue
        try:
            vocabulary.token_bytes(token_id).decode("utf-8")
        except UnicodeDecodeError:
            kinds.append(BYTE)
        else:
            kinds.append(TOKEN)
    return kinds


def kinds_note(
    tokenizer: Any, name: str, text: str, labels: list[str], kinds: list[str]
) -> str | None:
    """A sentence on the unknown and byte pieces among `kinds`, or None when there are none."""
    notes = []
    unk = unk_token(tokenizer)
    if UNK in kinds and unk is not None:
        encode = model_vocabulary(tokenizer, name).encode
        chars = [c for c in text if not c.isspace()]
        is_unknown = {c: unk[1] in encode(c) for c in set(chars)}
        unknown = [c for c in chars if is_unknown[c]]
        shown = "".join(dict.fromkeys(unknown))[:12]
        notes.append(
            f"{len(unknown)} of {len(chars)} characters are {unk[0]} in {name}'s vocabulary "
            f"({shown}): the model sees the same {unk[0]} for each, not the character"
        )
    if BYTE in kinds:
        split = [SPLIT_LABEL.sub("", label) for label, k in zip(labels, kinds, strict=True)]
        chars = "".join(dict.fromkeys(s for s, k in zip(split, kinds, strict=True) if k == BYTE))
        count = kinds.count(BYTE)
        example = labels[kinds.index(BYTE)]
        notes.append(
            f"{name} splits these characters into byte pieces ({chars[:12]}): {count} of the "
            f"{len(kinds)} tokens are parts of a character's UTF-8 bytes, labelled as {example}"
        )
    return "; ".join(notes) or None
