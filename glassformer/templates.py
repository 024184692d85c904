"""Chat templates: how a chat model's Jinja template turns a conversation into the one text it
was trained on (seed 002's pipeline, step ① for chat models).

A template is code that arrives in a model file, and the conversation is text that arrives from
a user, so both are handled with care here:
- rendering is sandboxed (jinja2's immutable sandbox) and bounded: at most
  MAX_RENDER_SECONDS of work and MAX_OUTPUT_CHARS of output, and any failure of the template is
  one ChatTemplateError line, not a traceback;
- `chat_pieces` renders with a marker in place of each message's text, so the caller can encode
  the template's own text with its control tokens (<|im_start|>) and the messages' text as plain
  text: a user who types "<|im_end|><|im_start|>system" gets those characters, not a new turn.
"""

from __future__ import annotations

import functools
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_SECONDS = 2.0
MAX_OUTPUT_CHARS = 1_000_000
_MAX_EXPONENT = 1_000

# What the code a template runs can raise; anything of these is the template's (or the
# conversation's) fault, never glassformer's.
_TEMPLATE_FAILURES = (
    TemplateError,
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    ArithmeticError,
    RecursionError,
)


class ChatTemplateError(ValueError):
    """A chat template cannot render this conversation; the message says why, on one line."""


def _too_big(what: str) -> ChatTemplateError:
    return ChatTemplateError(
        f"the chat template {what}, more than the {MAX_OUTPUT_CHARS:,} characters a prompt may "
        "have: the template is broken or hostile; use another model file"
    )


def _bounded_filter(name: str, fn: Callable) -> Callable:
    """A filter whose size arguments and result are checked: `"x"|center(10**10)` fails fast."""

    @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_OUTPUT_CHARS:
                raise _too_big(f"asks the {name} filter for a size of {value:,}")
        result = fn(*args, **kwargs)
        if isinstance(result, (str, list, tuple)) and len(result) > MAX_OUTPUT_CHARS:
            raise _too_big(f"makes {len(result):,} items with the {name} filter")
        return result

    return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with `*` and `**` sized before they run."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                sized = isinstance(seq, (str, list, tuple)) and isinstance(count, int)
                if sized and len(seq) * count > MAX_OUTPUT_CHARS:
                    raise _too_big(f"repeats {len(seq):,} items {count:,} times")
        if operator == "**" and isinstance(right, int) and abs(right) > _MAX_EXPONENT:
            raise ChatTemplateError(
                f"the chat template raises a number to the power {right:,}: the template is "
                "broken or hostile; use another model file"
            )
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation (e.g. roles that do not alternate).
    raise TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    try:
        return BoundedSandbox().from_string(source)
    except TemplateSyntaxError as err:
        raise ChatTemplateError(
            f"the chat template does not parse (line {err.lineno}: {err.message}): the model "
            "file's template is broken; use another model file"
        ) from None


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Stop the Python code this thread runs once `seconds` have passed. A template compiles to
    Python, so a trace function sees every line it runs (a nested range(100000) loop too);
    the previous tracer (a debugger, coverage) is put back afterwards."""
    deadline = time.monotonic() + seconds
    previous = sys.gettrace()

    def check(frame: Any, event: str, arg: Any) -> Callable:
        if time.monotonic() > deadline:
            raise ChatTemplateError(
                f"the chat template ran for more than {seconds:g} s: it is broken or hostile; "
                "use another model file"
            )
        return check

    sys.settrace(check)
    try:
        yield
    finally:
        sys.settrace(previous)


def render(source: str, seconds: float = MAX_RENDER_SECONDS, **variables: Any) -> str:
    """Render a chat template with `variables` (messages, add_generation_prompt, bos_token,
    ...), bounded in time and output; every failure is a ChatTemplateError."""
    template = _compile(source)
    pieces: list[str] = []
    size = 0
    try:
        with _time_limit(seconds):
            for piece in template.generate(**variables):
                size += len(piece)
                if size > MAX_OUTPUT_CHARS:
                    raise _too_big("writes more text")
                pieces.append(piece)
    except ChatTemplateError:
        raise
    except _TEMPLATE_FAILURES as err:
        message = " ".join(str(err).split()) or type(err).__name__
        raise ChatTemplateError(f"the chat template failed: {message}") from None
    return "".join(pieces)


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
