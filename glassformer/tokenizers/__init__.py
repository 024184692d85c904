"""Tokenizers: characters, byte-level BPE, and the tokenizers of pretrained models.

Seed 002 "token ≠ 字" (pipeline step ①): a model sees token ids, not characters. A byte-level
BPE may split one Chinese character or emoji across several tokens (streaming them back out as
text is glassformer.detokenize's job). A tokenizer file is read and run with guards
(tokenizers/guards.py); how much text one token can cover is tokenizers/span.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from glassformer import json_input, templates
from glassformer.tokenizers.guards import _hf_encode, read_tokenizer_json

TOKENIZER_FILE = "tokenizer.json"
ENDOFTEXT = "<|endoftext|>"
# The spellings an end-of-text token goes by (GPT-2, T5/BART/Llama, ChatML, BERT): a tokenizer
# file names no EOS, so the first of these among its special tokens is taken as the EOS.
EOS_SPELLINGS = (ENDOFTEXT, "</s>", "<|im_end|>", "<eos>", "[SEP]")
AUTO = "auto"
REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode writes for bytes that are not (yet) a char
_N_BYTES = 256  # a byte-level BPE starts from one token per byte value


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of glassformer needs from a tokenizer (char or BPE)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: str | Path) -> Path: ...


def _as_int_list(ids: Any) -> list[int]:
    # Accept torch tensors and numpy arrays as well as lists: generation hands back tensors.
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte value -> the printable character standing for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    unprintable = [b for b in range(_N_BYTES) if b not in chars]
    chars.update({b: chr(_N_BYTES + n) for n, b in enumerate(unprintable)})
    return chars


def _check_ids(ids: list[int], vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if i < 0 or i >= vocab_size)
        raise ValueError(
            f"token id {bad} is outside the vocabulary: ids must be in 0..{vocab_size - 1} "
            f"(vocab_size={vocab_size}); was the model trained with this tokenizer?"
        )


class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of the training text's chars."""

    def __init__(self, chars: Sequence[str]) -> None:
        chars = list(chars)
        not_single = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if not_single:
            raise ValueError(
                f"CharTokenizer vocabulary entries must be single characters, got "
                f"{not_single[:3]!r}; build it with CharTokenizer.from_text(text)"
            )
        if len(set(chars)) != len(chars):
            dupes = sorted({c for c in chars if chars.count(c) > 1})
            raise ValueError(f"CharTokenizer vocabulary repeats {dupes[:5]!r}: list each once")
        if not chars:
            raise ValueError("CharTokenizer needs at least one character in its vocabulary")
        self.chars = chars
        self._index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        if not text:
            raise ValueError("CharTokenizer.from_text got an empty text: pass the training text")
        return cls(sorted(set(text)))

    # A vocabulary of characters has no special tokens.
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # add_special_tokens: as the other tokenizers take it; a char vocabulary has none to add
        try:
            return [self._index[c] for c in text]
        except KeyError:
            unknown = sorted({c for c in text if c not in self._index})
            raise ValueError(
                f"{len(unknown)} character(s) not in the vocabulary, e.g. {unknown[:5]!r}: a "
                f"CharTokenizer only knows the {self.vocab_size} characters of its training "
                f"text; remove them or build the tokenizer from a text that contains them"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        ids = _as_int_list(ids)
        _check_ids(ids, self.vocab_size)
        return "".join(self.chars[i] for i in ids)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"glassformer_tokenizer": "char", "chars": self.chars}
        path.write_text(json.dumps(payload, ensure_ascii=False), encoding="utf-8")
        return path

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def _find_eos(hf_tokenizer: HFTokenizer) -> str | None:
    """The first of EOS_SPELLINGS that is one of the tokenizer's special tokens, or None."""
    special = {
        token.content for token in hf_tokenizer.get_added_tokens_decoder().values() if token.special
    }
    return next((token for token in EOS_SPELLINGS if token in special), None)


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) around a Hugging Face `tokenizers.Tokenizer`.

    Byte-level means any Unicode string encodes and decodes back exactly: every byte has a
    token, there is no normalizer, and the pre-tokenizer adds no prefix space. Text that
    contains a special token's spelling (e.g. "<|endoftext|>") encodes to that special id.
    eos_token: the special token that ends a text; "auto" takes the first of EOS_SPELLINGS
    among the special tokens (so a tokenizer trained with "</s>" stops generation there).
    """

    # Only an end-of-text token: no BOS is prepended and padding is the batcher's job.
    bos_token_id: int | None = None
    pad_token_id: int | None = None

    def __init__(
        self, hf_tokenizer: HFTokenizer, eos_token: str | None = AUTO, source: Path | None = None
    ) -> None:
        if not isinstance(hf_tokenizer, HFTokenizer):
            raise TypeError(
                f"BPETokenizer wraps a tokenizers.Tokenizer, got {type(hf_tokenizer).__name__}; "
                f"to read a tokenizer.json use BPETokenizer.from_file(path) or load_tokenizer(path)"
            )
        self.hf = hf_tokenizer
        self.source = source  # the file it was read from, named in errors
        if eos_token == AUTO:
            eos_token = _find_eos(hf_tokenizer)
        self._eos_token_id = None if eos_token is None else hf_tokenizer.token_to_id(eos_token)

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int,
        special_tokens: Sequence[str] = (ENDOFTEXT,),
    ) -> BPETokenizer:
        minimum = _N_BYTES + len(special_tokens)
        if vocab_size < minimum:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: a byte-level BPE needs {_N_BYTES} byte "
                f"tokens plus {len(special_tokens)} special token(s); use vocab_size >= {minimum}"
            )
        hf = HFTokenizer(models.BPE())
        # No normalizer and no prefix space: leading spaces, "\r\n" and NUL must survive exactly.
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(special_tokens),
            # Seed all 256 bytes even if the training text lacks some: no input is ever unknown.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer=trainer)
        return cls(hf)

    @classmethod
    def from_file(cls, path: str | Path, eos_token: str | None = AUTO) -> BPETokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}: expected a tokenizer.json")
        hf = read_tokenizer_json(
            path, "re-save it with BPETokenizer.save or point at the right file"
        )
        return cls(hf, eos_token=eos_token, source=path)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        _check_ids([int(token_id)], self.vocab_size)
        return self.hf.id_to_token(int(token_id))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # add_special_tokens=False by default: no post-processor tokens, so decode(encode(s)) == s.
        return _hf_encode(self.hf, text, add_special_tokens, self.source)

    def decode(self, ids: Sequence[int]) -> str:
        ids = _as_int_list(ids)
        _check_ids(ids, self.vocab_size)  # the Rust side silently skips unknown ids
        return self.hf.decode(ids, skip_special_tokens=False)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(path))
        return path

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, eos_token_id={self.eos_token_id})"


class PretrainedTokenizer:
    """The tokenizer of a pretrained model: any Hugging Face tokenizer.json (BPE, WordPiece,
    Unigram) plus what tokenizer_config.json adds: special tokens and the chat template.

    encode() adds the model's special tokens by default (Llama's BOS, BERT's [CLS] ... [SEP]),
    as transformers does; chat prompts are rendered by `apply_chat_template` and encoded with
    add_special_tokens=False because the template already spells them out.
    """

    def __init__(
        self,
        hf_tokenizer: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        source: Path | None = None,
    ) -> None:
        self.hf = hf_tokenizer
        self.source = source  # the tokenizer.json it was read from, named in errors
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.chat_template = chat_template
        self._plain_hf: HFTokenizer | None = None  # a copy that reads special tokens as text
        self.uncovered_bytes = self._uncovered_bytes()

    def _uncovered_bytes(self) -> bytes:
        """Byte values a byte-level BPE without fallback cannot encode: the Rust side drops
        them without a word (SmolLM2 lacks 21, e.g. 0x04 and the lead byte 0xF1)."""
        model = self.hf.model
        byte_level = type(self.hf.decoder).__name__ == "ByteLevel"
        if not byte_level or type(model).__name__ != "BPE" or model.byte_fallback:
            return b""
        vocab = self.hf.get_vocab()
        return bytes(b for b, char in byte_level_chars().items() if char not in vocab)

    @classmethod
    def from_folder(cls, folder: str | Path) -> PretrainedTokenizer:
        folder = Path(folder)
        file = folder / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {folder}: glassformer reads the fast-tokenizer file; "
                "re-save the tokenizer with transformers (tokenizer.save_pretrained) to get one"
            )
        hf = read_tokenizer_json(file, "re-save it with transformers' tokenizer.save_pretrained")
        # Some files (all-MiniLM-L6-v2's) switch on fixed padding/truncation to 128 tokens;
        # transformers ignores those unless asked, and so does encode(): padding is the
        # batcher's job, and silent truncation would change the model's input.
        hf.no_padding()
        hf.no_truncation()
        config_file = folder / "tokenizer_config.json"
        config = _read_tokenizer_config(config_file) if config_file.is_file() else {}

        def token(key: str) -> str | None:
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{config_file}: {key}={value!r} must be a token string")
            return value

        return cls(
            hf,
            bos_token=token("bos_token"),
            eos_token=token("eos_token"),
            pad_token=token("pad_token"),
            chat_template=templates.read_chat_template(config.get("chat_template"), config_file),
            source=file,
        )

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.hf.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    def encode(
        self, text: str, add_special_tokens: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of `text`. parse_special=False reads control-token spellings in the text
        (<|im_start|>) as plain characters: what a user typed can then never become a token
        that the model takes for structure."""
        if self.uncovered_bytes:
            self._check_covered(text)
        if parse_special:
            return _hf_encode(self.hf, text, add_special_tokens, self.source)
        if self._plain_hf is None:
            self._plain_hf = HFTokenizer.from_str(self.hf.to_str())
            self._plain_hf.encode_special_tokens = True
        return _hf_encode(self._plain_hf, text, add_special_tokens, self.source)

    def _check_covered(self, text: str) -> None:
        data = text.encode("utf-8", errors="surrogatepass")
        if data.translate(None, self.uncovered_bytes) != data:
            index, char = next(
                (i, c)
                for i, c in enumerate(text)
                if set(c.encode("utf-8", errors="surrogatepass")) & set(self.uncovered_bytes)
            )
            raise ValueError(
                f"text has {char!r} (U+{ord(char):04X}) at index {index}, whose UTF-8 bytes "
                "this vocabulary cannot encode (it would be dropped without a trace): remove "
                "or replace that character"
            )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = _as_int_list(ids)
        _check_ids(ids, self.vocab_size)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as text, rendered by the model's own Jinja chat template (sandboxed,
        bounded in time and size). To encode a conversation use encode_chat instead."""
        return templates.render_chat(self, messages, add_generation_prompt, template_kwargs)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        parse_special_in_content: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The conversation's token ids: the template's text with its control tokens, the
        messages' text as plain text (unless parse_special_in_content; templates.encode_chat).
        template_kwargs: further template variables, e.g. {"enable_thinking": False}."""
        return templates.encode_chat(
            self, messages, add_generation_prompt, parse_special_in_content, template_kwargs
        )

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.hf.save(str(directory / TOKENIZER_FILE))
        config = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "chat_template": self.chat_template,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        config = {k: v for k, v in config.items() if v is not None}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return directory / TOKENIZER_FILE

    def __repr__(self) -> str:
        return f"PretrainedTokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r})"


def _read_tokenizer_config(path: Path) -> dict[str, Any]:
    try:
        config = json_input.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): fix or delete the file") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{path} holds a JSON {type(config).__name__}, not an object of tokenizer settings: "
            "fix or delete the file"
        )
    return config


def require_token_ids(tokenizer: Any, tokens: Sequence[str], purpose: str) -> list[int]:
    """The ids of `tokens`, or one error naming every token the tokenizer lacks."""
    ids = [tokenizer.token_to_id(token) for token in tokens]
    missing = [token for token, i in zip(tokens, ids, strict=True) if i is None]
    if missing:
        raise ValueError(
            f"the tokenizer has no {', '.join(missing)}: {purpose} needs {', '.join(tokens)}"
        )
    return ids


def load_tokenizer(path: str | Path) -> CharTokenizer | BPETokenizer:
    """Load a tokenizer saved by `save`: a directory holding tokenizer.json, or the file."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"no tokenizer at {file}: pass a directory holding {TOKENIZER_FILE} or the file itself"
        )
    try:
        payload = json_input.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{file} is not valid JSON ({error}): the tokenizer file is corrupt; re-save it"
        ) from error
    if not isinstance(payload, dict):
        raise ValueError(f"{file} holds a JSON {type(payload).__name__}, not a tokenizer object")
    kind = payload.get("glassformer_tokenizer")
    if kind is None:
        return BPETokenizer.from_file(file)
    if kind != "char":
        raise ValueError(
            f"{file}: glassformer_tokenizer={kind!r} is not known: allowed is 'char' "
            f"(a Hugging Face tokenizer.json has no glassformer_tokenizer key)"
        )
    if not isinstance(payload.get("chars"), list):
        raise ValueError(f"{file}: a char tokenizer needs a 'chars' list; re-save it")
    return CharTokenizer(payload["chars"])
