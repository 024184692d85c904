"""The text `glassformer serve` hands back, as the official openai client sees it, with the real
SmolLM2 (a byte-level BPE: one emoji is two or more tokens): a reply cut in the middle of a
character never shows U+FFFD (streamed or not), and logprobs give each token's exact bytes,
checked against the tokenizer's own vocabulary and decode. And a conversation too long to
render is a length error that names the limit, while a hostile template keeps its own message.
"""

from __future__ import annotations

import codecs
import re

import openai
import pytest
from serving import start_server, stop_server
from transformers.convert_slow_tokenizer import bytes_to_unicode

from glassformer.detokenize import IncrementalDecoder
from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf
from glassformer.interop.pretrained import resolve
from glassformer.templates import (
    MAX_CONVERSATION_CHARS,
    ChatTemplateError,
    ConversationTooLong,
    render,
)

EMOJI = "😀😃😄😁😆😅😀😃😄😁😆😅"  # SmolLM2 answers it with more emoji, byte piece by piece
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def server():
    process, url = start_server(["--model", "smollm2", "--max-batch", "2"])
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def vocabulary() -> tuple[object, dict[int, bytes], dict[bytes, int]]:
    """SmolLM2's tokenizer, and each id's bytes read from its vocabulary with GPT-2's byte
    alphabet as transformers spells it (not glassformer's copy)."""
    tokenizer = tokenizer_from_gguf(read_gguf(resolve("smollm2")))
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    bytes_of = {}
    for token, token_id in tokenizer.hf.get_vocab(with_added_tokens=True).items():
        known = all(c in byte_of for c in token)  # else an added token spelled as text
        bytes_of[token_id] = bytes(byte_of[c] for c in token) if known else token.encode()
    return tokenizer, bytes_of, {data: token_id for token_id, data in bytes_of.items()}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none")


def ends_mid_character(data: bytes) -> bool:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(data, final=False)
    return bool(decoder.getstate()[0])  # bytes held for a character still to complete


def first_cut(pieces: list[bytes]) -> int:
    """The smallest k whose first k token pieces end inside a character."""
    cuts = [k for k in range(1, len(pieces) + 1) if ends_mid_character(b"".join(pieces[:k]))]
    assert cuts, f"no token of {pieces} ends inside a character: pick another prompt"
    return cuts[0]


def chat(url: str, max_tokens: int, **kwargs):
    return client(url).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": EMOJI}], max_tokens=max_tokens,
        temperature=0, **kwargs,
    )  # fmt: skip


def test_chat_cut_mid_character_drops_it_streamed_and_not(server, vocabulary):
    tokenizer, bytes_of, id_of = vocabulary
    probe = chat(server, 12, logprobs=True).choices[0].logprobs.content
    k = first_cut([bytes(entry.bytes) for entry in probe])

    reply = chat(server, k, logprobs=True, top_logprobs=3).choices[0]
    assert reply.finish_reason == "length"
    entries = reply.logprobs.content
    ids = [id_of[bytes(entry.bytes)] for entry in entries]  # a KeyError: bytes no token has
    assert ids == [id_of[bytes(entry.bytes)] for entry in probe[:k]]  # greedy: the same start
    decoded = tokenizer.decode(ids)
    assert decoded.endswith("\ufffd")  # the tokenizer shows the cut character as U+FFFD
    assert "\ufffd" not in reply.message.content
    assert reply.message.content == decoded[:-1]  # everything else, exactly
    joined = b"".join(bytes(entry.bytes) for entry in entries)
    assert joined == b"".join(bytes_of[i] for i in ids)
    assert joined.decode("utf-8", errors="ignore") == reply.message.content

    streamed = list(chat(server, k, stream=True))
    deltas = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(deltas) == reply.message.content
    assert not any("\ufffd" in delta for delta in deltas)


def token_string(data: bytes) -> str:
    """How logprobs spell a token: its text, or "bytes:" and escapes when it is part of a
    character (OpenAI's legacy completions spelling)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + data.decode("utf-8", errors="backslashreplace")


def test_chat_logprobs_give_each_tokens_bytes_and_no_replacement_chars(server, vocabulary):
    tokenizer, bytes_of, id_of = vocabulary
    reply = chat(server, 8, logprobs=True, top_logprobs=4).choices[0]
    entries = reply.logprobs.content
    ids = [id_of[bytes(entry.bytes)] for entry in entries]
    assert any(ends_mid_character(bytes_of[i]) for i in ids)  # byte pieces really occur
    # The concatenated bytes are the tokens' text: the tokenizer's own decode of those ids.
    joined = b"".join(bytes(entry.bytes) for entry in entries)
    assert joined.decode("utf-8", errors="replace") == tokenizer.decode(ids)
    for entry in entries:
        assert "\ufffd" not in entry.token
        assert entry.token == token_string(bytes(entry.bytes))
        assert entry.top_logprobs[0].bytes == entry.bytes  # greedy: the likeliest one
        for top in entry.top_logprobs:
            assert "\ufffd" not in top.token
            assert top.token == token_string(bytes(top.bytes))
            assert bytes(top.bytes) in id_of  # exact bytes of a real token


def parse_token(token: str) -> bytes:
    """A completions logprobs token back to its bytes."""
    if not token.startswith("bytes:"):
        return token.encode("utf-8")
    parts = re.split(r"\\x([0-9a-f]{2})", token.removeprefix("bytes:"))
    return b"".join(
        bytes([int(part, 16)]) if i % 2 else part.encode("utf-8") for i, part in enumerate(parts)
    )


def test_completion_cut_mid_character_and_its_logprobs(server, vocabulary):
    tokenizer, bytes_of, id_of = vocabulary
    complete = client(server).completions.create
    probe = complete(model="smollm2", prompt=EMOJI, max_tokens=8, temperature=0, logprobs=2)
    pieces = [parse_token(t) for t in probe.choices[0].logprobs.tokens]
    k = first_cut(pieces)
    choice = complete(model="smollm2", prompt=EMOJI, max_tokens=k, temperature=0, logprobs=2)
    choice = choice.choices[0]
    ids = [id_of[parse_token(t)] for t in choice.logprobs.tokens]
    decoded = tokenizer.decode(ids)
    assert decoded.endswith("\ufffd") and "\ufffd" not in choice.text
    assert choice.text == decoded[:-1]
    assert not any("\ufffd" in t for top in choice.logprobs.top_logprobs for t in top)
    # text_offset: where each token starts in the text, in whole characters
    expected = [
        len(b"".join(bytes_of[i] for i in ids[:j]).decode("utf-8", errors="ignore"))
        for j in range(len(ids))
    ]
    assert choice.logprobs.text_offset == expected
    streamed = complete(model="smollm2", prompt=EMOJI, max_tokens=k, temperature=0, stream=True)
    texts = [c.choices[0].text for c in streamed if c.choices]
    assert "".join(texts) == choice.text and not any("\ufffd" in t for t in texts)


def test_finish_drops_only_an_incomplete_last_character(vocabulary):
    tokenizer, bytes_of, id_of = vocabulary
    cases = {  # ids -> what the bytes decode to once an incomplete tail is left out
        tuple(tokenizer.encode("ok 😀")[:-1]): "ok ",  # cut inside the emoji
        tuple(tokenizer.encode("ok \ufffd")): "ok \ufffd",  # the character U+FFFD itself
        (*tokenizer.encode("ok "), id_of[b"\x80"]): "ok \ufffd",  # a byte no character begins
    }
    for ids, expected in cases.items():
        data = b"".join(bytes_of[i] for i in ids)
        reference = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data)
        assert reference == expected
        decoder = IncrementalDecoder(tokenizer)
        assert "".join(decoder.push(i) for i in ids) + decoder.finish() == expected
        assert tokenizer.decode(list(ids)).endswith("\ufffd")  # what flush() would have shown


def test_a_one_megabyte_message_is_a_length_error_naming_the_limit(server):
    message = "a" * 2**20
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": message}], max_tokens=1
        )
    error = caught.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"{2**20:,} characters" in error["message"]
    assert f"{MAX_CONVERSATION_CHARS:,}" in error["message"]
    assert "hostile" not in error["message"]


def test_conversation_length_and_hostile_templates_get_their_own_errors():
    long = [{"role": "user", "content": "x" * (MAX_CONVERSATION_CHARS + 1)}]
    with pytest.raises(ConversationTooLong, match=f"{MAX_CONVERSATION_CHARS + 1:,} characters"):
        render(TEMPLATE, messages=long)
    just_under = [{"role": "user", "content": "x" * MAX_CONVERSATION_CHARS}]
    assert len(render(TEMPLATE, messages=just_under)) == MAX_CONVERSATION_CHARS + len("<user>")
    hostile = "{% for i in range(2000) %}{{ 'x' * 999 }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="broken or hostile"):
        render(hostile, messages=[{"role": "user", "content": "hi"}])
