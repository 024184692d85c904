"""How much text one token can cover: where a tokenizer bounds it, a text too long for a context
is known before it is tokenized (the finetuning data's check); where it does not, a cap on how
sparse a text that fits may be.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from glassformer.tokenizers import CharTokenizer

# Normalizers and pre-tokenizers that never drop a character: they keep, add, split or replace
# one character by one or more (Replace only where its content is no shorter than its pattern).
# With only these, and a BPE that gives every character a token (byte-level or byte fallback),
# each character of a text lies inside the string of some token of its encoding.
_KEEPING_NORMALIZERS = {"Prepend", "NFD", "NFKD", "Lowercase", "ByteLevel", "Replace"}
_KEEPING_PRE_TOKENIZERS = {
    "ByteLevel",
    "Metaspace",
    "Digits",
    "Punctuation",
    "Split",
    "UnicodeScripts",
}


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, where that bounds every encoding:
    a text of N characters then has at least N / longest_token_chars tokens, so a text too long
    for a context is known before it is tokenized. None where a tokenizer may drop or merge text
    without a token each (a whitespace pre-tokenizer, WordPiece's one [UNK] per unknown word, a
    strip normalizer, special tokens that swallow the spaces beside them)."""
    if isinstance(tokenizer, CharTokenizer):
        return 1
    hf = getattr(tokenizer, "hf", None)
    if not isinstance(hf, HFTokenizer) or not _keeps_every_char(hf):
        return None
    return max(map(len, hf.get_vocab(with_added_tokens=True)), default=None)


# Real text averages a few characters a token (about 4 in English, fewer in Chinese); 100
# (WordPiece's own longest word) is 25 times that, so no real example is refused, and at most
# max_seq_len x 100 characters are ever tokenized (8,192 positions: 0.8 MB, about a second).
SPARSE_TEXT_CHARS_PER_TOKEN = 100


def chars_per_token_cap(tokenizer: Any) -> int:
    """For a tokenizer whose encodings no length bounds (longest_token_chars is None): the most
    characters a token may stand for on average in a text that is taken to fit a context. Such a
    tokenizer drops text (spaces, control characters) or turns a whole unknown word into one
    [UNK], so only tokenizing counts its tokens; a text sparser than this is mostly what the
    model never sees. The longest of: the vocabulary's longest token, WordPiece's longest word,
    SPARSE_TEXT_CHARS_PER_TOKEN."""
    hf = getattr(tokenizer, "hf", None)
    if not isinstance(hf, HFTokenizer):
        return SPARSE_TEXT_CHARS_PER_TOKEN
    longest = max(map(len, hf.get_vocab(with_added_tokens=True)), default=0)
    word = getattr(hf.model, "max_input_chars_per_word", None) or 0
    return max(SPARSE_TEXT_CHARS_PER_TOKEN, longest, word)


def _keeps_every_char(hf: HFTokenizer) -> bool:
    model = hf.model
    if type(model).__name__ != "BPE":
        return False
    pre = json.loads(hf.pre_tokenizer.__getstate__()) if hf.pre_tokenizer is not None else None
    normalizer = json.loads(hf.normalizer.__getstate__()) if hf.normalizer is not None else None
    pres = _parts(pre, "pretokenizers")
    byte_level = any(p.get("type") == "ByteLevel" for p in pres)
    every_char_known = model.byte_fallback or byte_level or (model.unk_token and not model.fuse_unk)
    swallowing = any(t.lstrip or t.rstrip for t in hf.get_added_tokens_decoder().values())
    return (
        bool(every_char_known)
        and not swallowing
        and all(_keeps(p, _KEEPING_PRE_TOKENIZERS) for p in pres)
        and all(_keeps(n, _KEEPING_NORMALIZERS) for n in _parts(normalizer, "normalizers"))
    )


def _parts(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer as the list of its steps (a Sequence's, or itself)."""
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [p for part in component.get(key, []) for p in _parts(part, key)]
    return [component]


def _keeps(step: dict[str, Any], keeping: set[str]) -> bool:
    kind = step.get("type")
    if kind not in keeping or str(step.get("behavior", "")).lower() == "removed":
        return False
    if kind == "Replace":  # a literal pattern by content at least as long; no regex
        pattern = step.get("pattern", {}).get("String")
        return isinstance(pattern, str) and len(step.get("content", "")) >= len(pattern)
    return True
