"""Tokenizers (seed 002 "token ≠ 字"): char and byte-level BPE round trips, saving and loading,
and the streaming decoder that never emits half a UTF-8 character."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from glassformer.detokenize import IncrementalDecoder
from glassformer.tokenizers import (
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
)

MIXED_TEXT = (
    "The cat sat on the mat. 那只猫没跳上桌子因为它太累了。 Transformers read tokens, not "
    "characters. 注意力机制让每个词一次性看全句。 Emoji too: 😀🐱🚀 and 👩‍💻! "
    "人工智能 Artificial Intelligence. 我们按 token 付费。\n"
)

HARD_STRINGS = [
    "",
    " ",
    "  leading spaces",
    "trailing spaces   ",
    "\t\ttabs\tand\nnewlines\n\n",
    "windows\r\nline\r\nends\r\n",
    "nul\x00byte\x00",
    "你好，世界",
    "😀🐱🚀👩‍💻🏳️‍🌈",
    "e\u0301 combining acute, a\u0308\u0304 stacked marks",
    "\u200b zero width \ufeff bom \u202e rtl",
    "a\ufffdb a real replacement character",
    "<|endoftext|>",
    "before<|endoftext|>after <|endoftext|> ",
    "\U0010ffff \U0001d11e max code point and a clef",
    "ＦＵＬＬＷＩＤＴＨ and ﬁ ligature (no normalizer may touch them)",
    "\x7f\x80\x9f control bytes",
]


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-unicode table, written out from the GPT-2 paper's code: the
    independent reference for what a byte-level token spells."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


BYTE_OF = gpt2_byte_decoder()


def token_bytes(tokenizer: BPETokenizer, token_id: int) -> bytes:
    return bytes(BYTE_OF[c] for c in tokenizer.id_to_token(token_id))


def random_texts(n: int, seed: int) -> list[str]:
    """Random strings over all of Unicode except surrogates, biased toward tricky ranges."""
    rng = random.Random(seed)
    ranges = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    texts = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(0, 30)):
            low, high = rng.choice(ranges)
            chars.append(chr(rng.randint(low, high)))
        texts.append("".join(chars))
    return texts


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train([MIXED_TEXT] * 20, vocab_size=400)


# ---- CharTokenizer -----------------------------------------------------------------------------


def test_char_vocab_is_sorted_unique_characters():
    tok = CharTokenizer.from_text("hello")
    assert tok.chars == ["e", "h", "l", "o"]
    assert tok.vocab_size == 4
    assert tok.encode("hello") == [1, 0, 2, 2, 3]
    assert tok.decode([1, 0, 2, 2, 3]) == "hello"
    assert tok.eos_token_id is None and tok.bos_token_id is None
    assert isinstance(tok, Tokenizer)


def test_char_unknown_character_names_it():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"'z'.*training text"):
        tok.encode("abz")


def test_char_bad_id_names_it_and_vocab_size():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"token id 7 .*vocab_size=3"):
        tok.decode([0, 7])
    with pytest.raises(ValueError, match=r"token id -1 "):
        tok.decode([-1])


def test_char_rejects_bad_vocabularies():
    with pytest.raises(ValueError, match="repeats"):
        CharTokenizer(["a", "b", "a"])
    with pytest.raises(ValueError, match="single characters"):
        CharTokenizer(["ab"])
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer.from_text("")


def test_char_save_writes_documented_json_and_loads(tmp_path):
    tok = CharTokenizer.from_text("héllo 世界")
    path = tok.save(tmp_path / "tok")
    assert path == tmp_path / "tok" / "tokenizer.json"
    assert json.loads(path.read_text(encoding="utf-8")) == {
        "glassformer_tokenizer": "char",
        "chars": [" ", "h", "l", "o", "é", "世", "界"],
    }
    for where in (tmp_path / "tok", path):
        loaded = load_tokenizer(where)
        assert isinstance(loaded, CharTokenizer)
        assert loaded.chars == tok.chars


# ---- BPETokenizer ------------------------------------------------------------------------------


@pytest.mark.parametrize("text", HARD_STRINGS)
def test_bpe_round_trips_hard_strings(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_round_trips_random_unicode(bpe):
    for text in random_texts(300, seed=0):
        assert bpe.decode(bpe.encode(text)) == text


def test_bpe_tokens_spell_the_utf8_bytes(bpe):
    # Independent reference: GPT-2's byte table turns each token back into bytes.
    for text in [*HARD_STRINGS, *random_texts(50, seed=1)]:
        ids = bpe.encode(text)
        assert b"".join(token_bytes(bpe, i) for i in ids) == text.encode("utf-8")


def test_bpe_keeps_leading_space_and_adds_none(bpe):
    # "Ġ" is GPT-2's spelling of the space byte: present only where the text has a space.
    assert not bpe.id_to_token(bpe.encode("hello")[0]).startswith("Ġ")
    assert bpe.id_to_token(bpe.encode(" hello")[0]).startswith("Ġ")


def test_bpe_special_tokens_and_sizes(bpe):
    eos = bpe.token_to_id("<|endoftext|>")
    assert bpe.eos_token_id == eos == 0  # special tokens come first in the trained vocabulary
    assert bpe.bos_token_id is None
    assert bpe.encode("<|endoftext|>") == [eos]
    assert 256 + 1 <= bpe.vocab_size <= 400
    assert bpe.id_to_token(eos) == "<|endoftext|>"
    assert isinstance(bpe, Tokenizer)


def test_bpe_merges_frequent_text(bpe):
    # Trained on MIXED_TEXT, BPE must use fewer tokens than bytes on it (token ≠ byte ≠ char).
    n_tokens = len(bpe.encode(MIXED_TEXT))
    assert n_tokens < len(MIXED_TEXT.encode("utf-8")) / 2


def test_bpe_without_endoftext_has_no_eos():
    tok = BPETokenizer.train(["abc abc"], vocab_size=300, special_tokens=())
    assert tok.eos_token_id is None
    assert tok.decode(tok.encode(" abc\n")) == " abc\n"


def test_bpe_vocab_size_below_bytes_is_refused():
    with pytest.raises(ValueError, match=r"vocab_size=200 .*>= 257"):
        BPETokenizer.train(["abc"], vocab_size=200)


def test_bpe_bad_id_and_surrogate_are_clear_errors(bpe):
    with pytest.raises(ValueError, match=rf"token id {bpe.vocab_size} .*vocab_size="):
        bpe.decode([1, bpe.vocab_size])
    with pytest.raises(ValueError, match="lone surrogate"):
        bpe.encode("a\ud800b")


def test_bpe_save_is_hf_format_and_loads(bpe, tmp_path):
    path = bpe.save(tmp_path)
    payload = json.loads(path.read_text(encoding="utf-8"))
    assert payload["model"]["type"] == "BPE"
    assert payload["normalizer"] is None
    assert payload["pre_tokenizer"] == {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    assert payload["decoder"]["type"] == "ByteLevel"
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, BPETokenizer)
    assert loaded.vocab_size == bpe.vocab_size and loaded.eos_token_id == bpe.eos_token_id
    for text in HARD_STRINGS:
        assert loaded.encode(text) == bpe.encode(text)


def test_bpe_wraps_only_hf_tokenizers():
    with pytest.raises(TypeError, match="from_file"):
        BPETokenizer("tokenizer.json")  # type: ignore[arg-type]


# ---- load_tokenizer errors -----------------------------------------------------------------


def test_load_missing_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)  # a directory without tokenizer.json


def test_load_corrupt_json_names_the_path(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"glassformer_tokenizer": "char", "chars": [', encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json is not valid JSON"):
        load_tokenizer(path)


def test_load_unknown_kind_and_non_hf_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"glassformer_tokenizer": "word"}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"'word' is not known.*'char'"):
        load_tokenizer(path)
    path.write_text('{"something": "else"}', encoding="utf-8")
    with pytest.raises(ValueError, match=r"not a Hugging Face tokenizer\.json"):
        load_tokenizer(path)


# ---- IncrementalDecoder --------------------------------------------------------------------


def stream(tokenizer: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    decoder = IncrementalDecoder(tokenizer)
    return [decoder.push(i) for i in ids], decoder.flush()


def test_multi_token_characters_really_occur(bpe):
    # Without this the streaming tests below would prove nothing.
    ids = bpe.encode(MIXED_TEXT)
    partial = [i for i in ids if "\ufffd" in bpe.decode([i])]
    assert len(partial) >= 2


def test_stream_emits_each_character_as_soon_as_complete(bpe):
    ids = bpe.encode(MIXED_TEXT)
    pieces, rest = stream(bpe, ids)
    assert "".join(pieces) + rest == MIXED_TEXT == bpe.decode(ids)
    assert rest == ""
    assert not any("\ufffd" in piece for piece in pieces)
    # Independent reference: after k tokens, exactly the complete characters of their bytes.
    seen = b""
    emitted = ""
    for token_id, piece in zip(ids, pieces, strict=True):
        seen += token_bytes(bpe, token_id)
        emitted += piece
        assert emitted == seen.decode("utf-8", errors="ignore")


def test_stream_of_random_ids_matches_full_decode(bpe):
    # Random ids make invalid byte sequences: the real U+FFFDs must come out, in place.
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(bpe.vocab_size) for _ in range(rng.randint(0, 40))]
        pieces, rest = stream(bpe, ids)
        assert "".join(pieces) + rest == bpe.decode(ids)


def test_stream_of_random_text_matches(bpe):
    for text in [*HARD_STRINGS, *random_texts(100, seed=2)]:
        pieces, rest = stream(bpe, bpe.encode(text))
        assert "".join(pieces) + rest == text
        if "\ufffd" not in text:
            assert not any("\ufffd" in piece for piece in [*pieces, rest])


def test_flush_returns_a_truncated_character(bpe):
    ids = bpe.encode("😀")
    assert len(ids) >= 2
    decoder = IncrementalDecoder(bpe)
    assert decoder.push(ids[0]) == ""
    assert decoder.flush() == bpe.decode(ids[:1]) == "\ufffd"
    assert decoder.flush() == ""  # flushed state is empty; the decoder can be reused
    assert "".join(decoder.push(i) for i in ids) == "😀"


class CountingTokenizer:
    """Records how many ids each decode call sees, to bound the work per push."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.decode_lengths: list[int] = []

    def decode(self, ids):
        self.decode_lengths.append(len(ids))
        return self.inner.decode(ids)


def longest_decode(tokenizer: Tokenizer, text: str) -> tuple[int, int, int]:
    ids = tokenizer.encode(text)
    counting = CountingTokenizer(tokenizer)
    pieces, rest = stream(counting, ids)  # type: ignore[arg-type]
    assert "".join(pieces) + rest == text
    return max(counting.decode_lengths), len(counting.decode_lengths), len(ids)


def test_stream_work_per_push_is_bounded(bpe):
    # The window spans the tokens since the last character boundary (tokens that straddle
    # characters chain, but BPE never merges across a space or punctuation) plus one piece of
    # context: its size depends on the text's words, not on how long the stream is.
    longest_short, _, _ = longest_decode(bpe, MIXED_TEXT * 2)
    longest_long, n_decodes, n_ids = longest_decode(bpe, MIXED_TEXT * 40)
    assert n_ids > 1000
    assert longest_long == longest_short <= 16
    assert n_decodes <= 2 * n_ids  # at most two decodes per push


def test_stream_bad_id_raises_and_keeps_state(bpe):
    ids = bpe.encode("猫 cat")
    decoder = IncrementalDecoder(bpe)
    out = decoder.push(ids[0])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.push(bpe.vocab_size + 5)
    out += "".join(decoder.push(i) for i in ids[1:]) + decoder.flush()
    assert out == "猫 cat"


def test_stream_char_tokenizer_is_one_char_per_push():
    tok = CharTokenizer.from_text("to be or not")
    assert stream(tok, tok.encode("not to be")) == (list("not to be"), "")


def test_stream_context_dependent_decoder():
    # A Llama-style Metaspace decoder drops the leading space of the *first* token only, so
    # decoding token by token without context would be wrong; the window's context fixes it.
    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    hf.train_from_iterator(["the cat sat on the mat and the hat"] * 5, trainer=trainer)
    tok = BPETokenizer(hf)
    ids = tok.encode("the cat sat on the hat")
    pieces, rest = stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids) == "the cat sat on the hat"


@pytest.mark.parametrize(
    ("specials", "eos"),
    [
        (("<|endoftext|>",), "<|endoftext|>"),
        (("<pad>", "<s>", "</s>"), "</s>"),  # the translation task's tokenizer
        (("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
        (("<pad>", "<mask>"), None),
    ],
)
def test_bpe_finds_its_eos_among_the_special_tokens(tmp_path, specials, eos):
    tok = BPETokenizer.train(["to be or not to be"], vocab_size=270, special_tokens=specials)
    expected = None if eos is None else tok.token_to_id(eos)
    assert tok.eos_token_id == expected
    assert BPETokenizer.from_file(tok.save(tmp_path)).eos_token_id == expected
    assert BPETokenizer(tok.hf, eos_token=None).eos_token_id is None  # asked for none
