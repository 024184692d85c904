"""What a chat template may make, and the size of what an operation would make, known before it
runs: the limits, the errors for passing them, and one estimate per operation that can grow a
value (+, *, %, **, the filters, str methods). templates/sandbox.py calls these from jinja's
sandbox; the chat-facing API is templates/__init__.py's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from markupsafe import Markup

MAX_OUTPUT_CHARS = 1_000_000
# Half the output bound: a template writes each message once plus its own text (and may hold a
# message and a copy of it at once), so a conversation under this never trips the bounds above.
MAX_CONVERSATION_CHARS = MAX_OUTPUT_CHARS // 2
_MAX_EXPONENT = 1_000
_MAX_INT_BITS = 14_300  # about 4,300 digits, the most Python writes out as text


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


# The functions above that size things: the sandbox runs them untraced (sandbox.py's _UNTRACED).
SIZING = (
    _size,
    _lines_and_depth,
    _checked,
    _materialized,
    _number,
    _printf_size,
    _refuse_growth,
    _refuse_sizes,
    _refuse_binop,
    _bits,
    *_FILTER_SIZES.values(),
    *_METHOD_SIZES.values(),
)
