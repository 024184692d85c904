"""Chat templates: how a chat model's Jinja template turns a conversation into the one text it
was trained on (seed 002's pipeline, step ① for chat models).

A template is code that arrives in a model file, and the conversation is text that arrives from
a user, so both are handled with care here:
- rendering is sandboxed (jinja2's immutable sandbox) and bounded: at most
  MAX_RENDER_SECONDS of work, MAX_OUTPUT_CHARS of output, and no value (a string, a list) larger
  than that, each operation sized before it runs; any failure of the template, nesting too deep
  to compile included, is one ChatTemplateError line, not a traceback; a conversation too long
  for those bounds is refused before rendering as ConversationTooLong, the sender's to fix;
- `chat_pieces` renders with a marker in place of each message's text, so the caller can encode
  the template's own text with its control tokens (<|im_start|>) and the messages' text as plain
  text: a user who types "<|im_end|><|im_start|>system" gets those characters, not a new turn.
"""

from __future__ import annotations

import functools
import re
import secrets
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.exceptions import TemplateError, TemplateSyntaxError
from jinja2.runtime import str_join
from jinja2.sandbox import (
    ImmutableSandboxedEnvironment,
    SandboxedEscapeFormatter,
    SandboxedFormatter,
)
from markupsafe import Markup

MAX_RENDER_SECONDS = 2.0
MAX_OUTPUT_CHARS = 1_000_000
# Half the output bound: a template writes each message once plus its own text (and may hold a
# message and a copy of it at once), so a conversation under this never trips the bounds above.
MAX_CONVERSATION_CHARS = MAX_OUTPUT_CHARS // 2
_MAX_EXPONENT = 1_000
_MAX_INT_BITS = 14_300  # about 4,300 digits, the most Python writes out as text

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


class ConversationTooLong(ValueError):
    """The messages are longer than a chat template may render: the conversation is at fault,
    not the template, so the message names the length and the limit."""


def _refuse_long_conversation(messages: Any) -> None:
    if not isinstance(messages, list):
        return
    size = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else message
        size += len(content) if isinstance(content, str) else _size(content)
    if size > MAX_CONVERSATION_CHARS:
        raise ConversationTooLong(
            f"the messages are {size:,} characters; the limit is {MAX_CONVERSATION_CHARS:,}: "
            "shorten them"
        )


def _too_big(what: str) -> ChatTemplateError:
    return ChatTemplateError(
        f"the chat template {what}, more than the {MAX_OUTPUT_CHARS:,} characters a prompt may "
        "have: the template is broken or hostile; use another model file"
    )


# --- sizes: what an operation would make, known before it runs ---------------------------------
# 150 characters of template can double a string sixty times, and a time limit alone lets that
# reach gigabytes within 2 s. So each operation that can grow a value (+, ~, *, %, **, the
# filters, str methods, str.format) is sized from its operands before it runs, and what it made
# is checked after: no value a template holds exceeds MAX_OUTPUT_CHARS (by more than the
# constant factor of writing a list out as text).


_TEXT_TYPES = frozenset({str, bytes, Markup})
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})


def _size(value: Any, limit: int = MAX_OUTPUT_CHARS) -> int:
    """Characters plus items in `value`, through lists, tuples, sets and dicts: a list holding
    one string 1,000 times counts it 1,000 times, as its text would. Counting stops once past
    `limit`, so it costs at most that many steps."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset, dict)):
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            total += len(children)
            kinds = set(map(type, children))  # a long flat list is sized at C speed
            if kinds <= _TEXT_TYPES:
                total += sum(map(len, children))
            elif not kinds <= _SCALAR_TYPES:
                stack += children
        else:
            total += 1
    return total


def _lines_and_depth(value: Any) -> tuple[int, int]:
    """How many lines json.dumps(value, indent=...) writes, and how deep its nesting goes."""
    lines, deepest, stack = 1, 0, [(value, 0)]
    while stack and lines <= MAX_OUTPUT_CHARS:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, (list, tuple)):
            lines, deepest = lines + len(item) + 1, max(deepest, depth + 1)
            stack += [(child, depth + 1) for child in item]
    return lines, deepest


def _checked(value: Any, what: str) -> Any:
    size = _size(value)
    if size > MAX_OUTPUT_CHARS:
        raise _too_big(f"makes a value of {size:,}+ characters and items with {what}")
    return value


def _materialized(value: Any) -> Any:
    """A lazy sequence (what map or select hand on) as a list, sized while it is drawn: a filter
    or method that holds all of it gets a list of bounded size, or the error."""
    if not isinstance(value, Iterator):
        return value
    items, size = [], 0
    for item in value:
        size += 1 + _size(item)
        if size > MAX_OUTPUT_CHARS:
            raise _too_big("draws a longer sequence")
        items.append(item)
    return items


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 10 else 10**10  # int() refuses 5,000 digits


# A printf-style field ("%-10.3f", "%(name)s", "%*d"): its width and its precision.
_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _printf_size(text: Any, values: Any) -> int:
    """At least len(text % values): the text, the values, and each field's width and precision
    ('%999999999s' is a billion characters however short its value)."""
    items = tuple(values.values()) if isinstance(values, dict) else values
    items = items if isinstance(items, tuple) else (items,)
    widest = max((v for v in items if isinstance(v, int)), default=0)  # what a * takes
    size = _size(str(text)) + _size(items)
    for width, precision in _PRINTF_FIELD.findall(str(text)):
        size += sum(widest if n == "*" else _number(n) for n in (width, precision) if n)
    return size


def _replace_size(text: Any, old: Any, new: Any, count: Any = None) -> int:
    text, old, new = str(text), str(old), str(new)
    found = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(text) + found * max(0, len(new) - len(old))


def _join_size(value: Any, d: Any = "", **_: Any) -> int:
    return _size(value) + len(value) * len(str(d))


def _indent_size(s: Any, width: Any = 4, **_: Any) -> int:
    step = width if isinstance(width, int) else len(str(width))
    return len(str(s)) + (str(s).count("\n") + 1) * step


def _wordwrap_size(
    s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None, **_: Any
) -> int:
    lines = len(str(s)) // max(1, width) + str(s).count("\n") + 1
    return len(str(s)) + lines * len(wrapstring or "\n")


def _tojson_size(value: Any, indent: Any = None) -> int:
    # json.dumps writes the indent once per nesting level on every line.
    step = indent if isinstance(indent, int) else len(indent or "")
    lines, depth = _lines_and_depth(value) if step else (0, 0)
    return _size(value) + lines * depth * step


def _urlize_size(
    value: Any,
    trim_url_limit: Any = None,
    nofollow: Any = False,
    target: Any = None,
    rel: Any = None,
    **_: Any,
) -> int:
    # A link repeats its address and adds rel and target: at most one link per word.
    extra = 64 + len(str(target or "")) + len(str(rel or ""))
    return 2 * len(str(value)) + len(str(value).split()) * extra


def _format_size(value: Any, *args: Any, **kwargs: Any) -> int:
    return _printf_size(value, kwargs or args)


# What a filter makes, estimated from the filter's own arguments (after any context argument).
_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "join": _join_size,
    "replace": _replace_size,
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "tojson": _tojson_size,
    "urlize": _urlize_size,
    "format": _format_size,
}


def _padded_size(text: str | bytes, width: Any, *rest: Any) -> int:
    return max(len(text), width)


def _expandtabs_size(text: str | bytes, tabsize: Any = 8) -> int:
    return len(text) + text.count("\t" if isinstance(text, str) else b"\t") * tabsize


def _join_method_size(separator: str | bytes, items: Any) -> int:
    return _join_size(items, separator)


def _translate_size(text: str, table: Any) -> int:
    replacements = table.values() if isinstance(table, dict) else table  # or a list, by ord
    return len(text) * (1 + max(map(_size, replacements), default=0))


# What a str (or bytes) method makes, estimated from (the string, *the call's arguments).
_METHOD_SIZES: dict[str, Callable[..., int]] = {
    "center": _padded_size,
    "ljust": _padded_size,
    "rjust": _padded_size,
    "zfill": _padded_size,
    "expandtabs": _expandtabs_size,
    "replace": _replace_size,
    "join": _join_method_size,
    "translate": _translate_size,
}


def _refuse_growth(estimate: Callable[..., int], what: str, *args: Any, **kwargs: Any) -> None:
    try:
        size = estimate(*args, **kwargs)
    except (TypeError, ValueError, AttributeError):
        return  # arguments the operation itself refuses, with its own message
    if size > MAX_OUTPUT_CHARS:
        raise _too_big(f"asks {what} for about {size:,} characters")


def _refuse_sizes(values: Iterable[Any], what: str) -> None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_OUTPUT_CHARS:
            raise _too_big(f"asks {what} for a size of {value:,}")


def _bounded_filter(name: str, fn: Callable) -> Callable:
    """A filter sized before it runs (`"x"|center(10**10)`, `s|replace("", s)`,
    `"%999999999s"|format(1)` fail fast), that draws a lazy sequence with a bound, and whose
    result is checked."""
    # A pass_context (eval_context, environment) filter takes that before its value.
    n_context = 1 if hasattr(fn, "jinja_pass_arg") else 0
    bounded = functools.partial(_run_filter, name, fn, n_context)
    return functools.update_wrapper(bounded, fn)  # keeps jinja's pass_context marks


def _run_filter(name: str, fn: Callable, n_context: int, *args: Any, **kwargs: Any) -> Any:
    context, (value, *rest) = args[:n_context], args[n_context:]
    _refuse_sizes([*rest, *kwargs.values()], f"the {name} filter")
    value = _materialized(value)
    if name in _FILTER_SIZES:
        _refuse_growth(_FILTER_SIZES[name], f"the {name} filter", value, *rest, **kwargs)
    return _checked(fn(*context, value, *rest, **kwargs), f"the {name} filter")


class _SizedFields:
    """str.format's fields, sized before each is formatted: "{:>999999999}" is refused, not
    written."""

    written = 0

    def format_field(self, value: Any, format_spec: str) -> Any:
        widths = sum(_number(n) for n in re.findall(r"\d+", format_spec))
        if self.written + widths + _size(value) > MAX_OUTPUT_CHARS:
            raise _too_big(f"asks str.format for a field of {widths:,} characters")
        text = super().format_field(value, format_spec)
        self.written += len(text)
        return text


class _SizedFormatter(_SizedFields, SandboxedFormatter):
    pass


class _SizedEscapeFormatter(_SizedFields, SandboxedEscapeFormatter):
    pass


class _SizedBuffer(list):
    """The list a {% set %} or {% filter %} block, a macro or a recursive loop collects its text
    in (jinja's is a plain list), sized as each piece arrives: a loop can add a 100,000-character
    piece a thousand times before the text is joined."""

    size = 0

    def append(self, piece: Any) -> None:
        self._grow(_size(piece))
        super().append(piece)

    def extend(self, pieces: Iterable[Any]) -> None:
        pieces = tuple(pieces)
        self._grow(sum(map(_size, pieces)))
        super().extend(pieces)

    def _grow(self, size: int) -> None:
        self.size += size
        if self.size > MAX_OUTPUT_CHARS:
            raise _too_big("collects more text in a block or macro")


class _SizedCodeGenerator(CodeGenerator):
    """jinja's code generator, with a sized buffer for each block and macro, and `a ~ b` sized:
    jinja joins that with str_join, past the sandbox's call_binop, so here it calls
    environment.call_concat with jinja's join."""

    def buffer(self, frame: Frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.new_buffer()")

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.call_concat({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with every operation that grows a value sized before it runs:
    +, *, % and ** (call_binop), ~ (call_concat), the filters, str methods (call), str.format
    (wrap_str_format) and the text a block or macro collects (concat)."""

    intercepted_binops = frozenset({"+", "*", "%", "**"})
    code_generator_class = _SizedCodeGenerator

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True)
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        del self.globals["lipsum"]  # lipsum(10**9) writes a billion words in one call

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:  # most, in one call
            if len(left) + len(right) > MAX_OUTPUT_CHARS:
                raise _too_big(f"adds {len(left) + len(right):,} characters with +")
            return left + right
        _refuse_binop(operator, left, right)
        return _checked(super().call_binop(context, operator, left, right), repr(operator))

    def call_concat(self, join: Callable, operands: tuple) -> str:
        """`a ~ b ~ ...`, sized first (see _SizedCodeGenerator)."""
        plain = join is str_join and set(map(type, operands)) <= {str}  # most, in one call
        size = sum(map(len, operands)) if plain else sum(map(_size, operands))
        if size > MAX_OUTPUT_CHARS:
            raise _too_big(f"joins {size:,} characters with ~")
        return "".join(operands) if plain else _checked(join(operands), "~")

    def new_buffer(self) -> _SizedBuffer:
        return _SizedBuffer()

    def concat(self, pieces: Iterable[str]) -> str:  # type: ignore[override]
        """Text that jinja joins: a buffer's, or a block's as {{ self.name() }} renders it (a
        generator), sized as it is drawn (jinja's own is "".join, whatever the size)."""
        kept, size = [], 0
        for piece in pieces:
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise _too_big("collects more text in a block or macro")
            kept.append(piece)
        return "".join(kept)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
        if isinstance(owner, (str, bytes)) and name in _METHOD_SIZES:
            args = tuple(_materialized(arg) for arg in args)
            # Inside a loop or block jinja adds _loop_vars/_block_vars, for context.call only.
            own = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
            _refuse_sizes([*args, *own.values()], f"{name}()")
            _refuse_growth(_METHOD_SIZES[name], f"{name}()", owner, *args, **own)
        return _checked(super().call(context, obj, *args, **kwargs), f"{name or 'a call'}()")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """jinja's sandboxed str.format and format_map, on formatters that size each field."""
        is_method = isinstance(value, (types.MethodType, types.BuiltinMethodType))
        if not is_method or value.__name__ not in ("format", "format_map"):
            return None
        text = value.__self__
        if not isinstance(text, str):
            return None
        is_format_map = value.__name__ == "format_map"

        def sized_format(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument, no keywords")
                args, kwargs = (), args[0]
            if isinstance(text, Markup):
                formatter = _SizedEscapeFormatter(self, escape=text.escape)
            else:
                formatter = _SizedFormatter(self)
            return type(text)(formatter.vformat(text, args, kwargs))

        return functools.update_wrapper(sized_format, value)


def _refuse_binop(operator: str, left: Any, right: Any) -> None:
    """Raise if `left operator right` would make more than a prompt may hold."""
    if operator == "+" and _size(left) + _size(right) > MAX_OUTPUT_CHARS:
        raise _too_big(f"adds {_size(left) + _size(right):,} characters and items with +")
    if operator == "*":
        if _bits(left) + _bits(right) > _MAX_INT_BITS:
            raise _too_big_number("multiplies")
        for seq, count in ((left, right), (right, left)):
            sized = isinstance(seq, (str, list, tuple)) and isinstance(count, int)
            if sized and _size(seq) * count > MAX_OUTPUT_CHARS:
                raise _too_big(f"repeats {_size(seq):,} items {count:,} times")
    if operator == "%" and isinstance(left, str):
        _refuse_growth(_printf_size, "printf-style %", left, right)
    power = right if operator == "**" and isinstance(right, int) else 0
    if abs(power) > _MAX_EXPONENT or _bits(left) * power > _MAX_INT_BITS:
        raise ChatTemplateError(
            f"the chat template raises a number to the power {right:,}: the template is "
            "broken or hostile; use another model file"
        )


def _too_big_number(verb: str) -> ChatTemplateError:
    return ChatTemplateError(
        f"the chat template {verb} numbers of more than {_MAX_INT_BITS:,} bits (more digits than "
        "Python writes out): the template is broken or hostile; use another model file"
    )


def _bits(value: Any) -> int:
    return value.bit_length() if isinstance(value, int) else 0


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
    except (RecursionError, SyntaxError) as err:
        # jinja parses nesting by recursion, and the Python it compiles to allows 100 levels
        # of indentation and 20 nested loops: 5,000 nested {% if %} fail in one or the other.
        reason = err.msg if isinstance(err, SyntaxError) else "deeper than Python's recursion limit"
        raise ChatTemplateError(
            f"the chat template nests its blocks too deeply to compile ({reason}): the model "
            "file's template is broken or hostile; use another model file"
        ) from None


# The sizing code runs untraced: each of its loops is bounded by MAX_OUTPUT_CHARS steps, and a
# trace call per line made SmolLM2's template 5x slower to render and sizing a 500,000-item
# list take longer than the whole time limit. What it calls (a macro, a generator's next item)
# is traced again.
_UNTRACED = frozenset(
    id(f.__code__)  # a code object's own hash reads all its bytecode: 2x the render time
    for f in (
        _size,
        _lines_and_depth,
        _checked,
        _materialized,
        _number,
        _printf_size,
        _refuse_growth,
        _refuse_sizes,
        _run_filter,
        _refuse_binop,
        _bits,
        *_FILTER_SIZES.values(),
        *_METHOD_SIZES.values(),
        _SizedFields.format_field,
        _SizedBuffer.append,
        _SizedBuffer.extend,
        _SizedBuffer._grow,
        BoundedSandbox.call_binop,
        BoundedSandbox.call_concat,
        BoundedSandbox.new_buffer,
        BoundedSandbox.concat,
        BoundedSandbox.call,
    )
)


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Stop the Python code this thread runs once `seconds` have passed. A template compiles to
    Python, so a trace function sees every line it runs (a nested range(100000) loop too);
    the previous tracer (a debugger, coverage) is put back afterwards."""
    deadline = time.monotonic() + seconds
    previous = sys.gettrace()

    def check(frame: Any, event: str, arg: Any) -> Callable | None:
        if time.monotonic() > deadline:
            raise ChatTemplateError(
                f"the chat template ran for more than {seconds:g} s: it is broken or hostile; "
                "use another model file"
            )
        return None if id(frame.f_code) in _UNTRACED else check

    sys.settrace(check)
    try:
        yield
    finally:
        sys.settrace(previous)


def render(source: str, seconds: float = MAX_RENDER_SECONDS, **variables: Any) -> str:
    """Render a chat template with `variables` (messages, add_generation_prompt, bos_token,
    ...), bounded in time and output; every failure of the template is a ChatTemplateError,
    messages too long to render a ConversationTooLong."""
    _refuse_long_conversation(variables.get("messages"))
    pieces: list[str] = []
    size = 0
    try:
        with _time_limit(seconds):
            template = _compile(source)
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
