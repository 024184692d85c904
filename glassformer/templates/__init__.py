"""Chat templates: how a chat model's Jinja template turns a conversation into the one text it
was trained on (seed 002's pipeline, step ① for chat models).

A template is code that arrives in a model file, and the conversation is text that arrives from
a user, so both are handled with care here:
- rendering is sandboxed (jinja2's immutable sandbox, templates/sandbox.py) and bounded
  (templates/bounds.py): at most MAX_RENDER_SECONDS of work, MAX_OUTPUT_CHARS of output, and no
  value (a string, a list) larger than that, each operation sized before it runs; any failure
  of the template, nesting too deep to compile included, is one ChatTemplateError line, not a
  traceback; a conversation too long for those bounds is refused before rendering as
  ConversationTooLong, the sender's to fix;
- `chat_pieces` renders with a marker in place of each message's text, so the caller can encode
  the template's own text with its control tokens (<|im_start|>) and the messages' text as plain
  text: a user who types "<|im_end|><|im_start|>system" gets those characters, not a new turn.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from glassformer.templates.bounds import (
    MAX_CONVERSATION_CHARS,
    MAX_OUTPUT_CHARS,
    ChatTemplateError,
    ConversationTooLong,
)
from glassformer.templates.sandbox import MAX_RENDER_SECONDS, render

__all__ = [
    "END_OF_TURN_TOKENS",
    "MAX_CONVERSATION_CHARS",
    "MAX_OUTPUT_CHARS",
    "MAX_RENDER_SECONDS",
    "THINK_END",
    "THINK_START",
    "ChatTemplateError",
    "ConversationTooLong",
    "chat_pieces",
    "encode_chat",
    "end_of_turn_ids",
    "read_chat_template",
    "render",
    "render_chat",
]


def chat_pieces(
    source: str, messages: list[dict[str, Any]], **variables: Any
) -> list[tuple[str, bool]] | None:
    """The rendered conversation as (text, is_message_text) pieces in order, or None when the
    template does not pass each message's text through unchanged (it edits or repeats it).

    Each string content is replaced by a unique marker before rendering; the markers are then
    found again in the output, which tells template text from message text exactly, and the
    pieces must join into the template's own rendering of the real conversation."""
    nonce = secrets.token_hex(4)
    markers: dict[str, str] = {}
    marked = []
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str):
            marker = f"\ue000{nonce}:{index}\ue001"
            markers[marker] = content
            message = {**message, "content": marker}
        marked.append(message)
    text = render(source, messages=marked, **variables)
    pieces: list[tuple[str, bool]] = []
    rest = text
    for marker, content in markers.items():
        before, found, rest = rest.partition(marker)
        if not found or marker in rest:
            return None
        pieces += [(before, False), (content, True)]
    pieces.append((rest, False))
    # A marker can pass through an edit that changes the text (|upper leaves digits alone):
    # the pieces count only if they spell exactly what the template writes for the real text.
    if "".join(piece for piece, _ in pieces) != render(source, messages=messages, **variables):
        return None
    return [(piece, is_text) for piece, is_text in pieces if piece]


# --- the tokens a template writes around turns and thoughts ---------------------------------------

# Tokens that end an assistant turn in common chat templates, besides the tokenizer's EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>")
# The markers around a thinking model's chain of thought (Qwen3, DeepSeek-R1; infer/thinking.py).
THINK_START, THINK_END = "<think>", "</think>"


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """The ids that end an assistant's turn: the tokenizer's EOS and whichever of
    END_OF_TURN_TOKENS its vocabulary holds."""
    stops = {tokenizer.eos_token_id}
    if hasattr(tokenizer, "token_to_id"):
        stops |= {tokenizer.token_to_id(t) for t in END_OF_TURN_TOKENS}
    return {i for i in stops if i is not None}


# --- a tokenizer's conversations ----------------------------------------------------------------


def read_chat_template(value: Any, path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates (some
    models ship several) of which the one named "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(
        f"{path}: chat_template must be a string (or a list of named templates with a "
        f"'default' one), got {type(value).__name__}: fix or delete the entry"
    )


def _template_and_variables(tokenizer: Any, add_generation_prompt: bool) -> tuple[str, dict]:
    if not tokenizer.chat_template:
        raise ValueError("this tokenizer has no chat template: use plain generation instead")
    variables = {
        "add_generation_prompt": add_generation_prompt,
        "bos_token": tokenizer.bos_token or "",
        "eos_token": tokenizer.eos_token or "",
    }
    return tokenizer.chat_template, variables


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """A PretrainedTokenizer's conversation as the text its chat template writes.
    template_kwargs: further template variables (Qwen3's enable_thinking)."""
    source, variables = _template_and_variables(tokenizer, add_generation_prompt)
    return render(source, messages=messages, **variables, **(template_kwargs or {}))


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    parse_special_in_content: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """A conversation's token ids: the template's own text is encoded with its control tokens,
    each message's text as plain text, so typed "<|im_start|>" stays characters. With
    parse_special_in_content the whole rendered text is encoded as one (raw templates).
    template_kwargs: further template variables (Qwen3's enable_thinking)."""
    source, variables = _template_and_variables(tokenizer, add_generation_prompt)
    variables = {**variables, **(template_kwargs or {})}
    if not parse_special_in_content:
        pieces = chat_pieces(source, messages, **variables)
        if pieces is not None:
            ids: list[int] = []
            for text, is_message in pieces:
                ids += tokenizer.encode(
                    text, add_special_tokens=False, parse_special=not is_message
                )
            return ids
        _refuse_control_text(tokenizer, messages)  # the template edits the text: can't split it
    text = render(source, messages=messages, **variables)
    return tokenizer.encode(text, add_special_tokens=False)


def _refuse_control_text(tokenizer: Any, messages: list[dict[str, Any]]) -> None:
    added = tokenizer.hf.get_added_tokens_decoder().values()
    controls = [token.content for token in added if token.special]
    for message in messages:
        content = message.get("content")
        found = [t for t in controls if isinstance(content, str) and t in content]
        if found:
            raise ValueError(
                f"a {message.get('role')} message contains the control token {found[0]!r}, and "
                "this chat template rewrites message text, so it cannot be kept as plain text: "
                "remove it (or opt in to raw control tokens)"
            )
