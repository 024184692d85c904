"""JSON that a user hands over (config files, adapter configs, data lines, request bodies), read
so that every way it can be broken is a json.JSONDecodeError that says where. Besides bad
syntax, Python's parser fails two more ways: brackets nested deeper than it follows (a
RecursionError) and an integer of more digits than it converts (a bare ValueError).

    data = loads(path.read_text())   # callers keep their `except json.JSONDecodeError`
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

# A string (escapes included, unrolled so that it runs in linear time) or one bracket.
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def loads(text: str | bytes) -> Any:
    """json.loads, with nesting too deep to parse and integers too long to convert raised as a
    json.JSONDecodeError at the place in the text where they are."""
    try:
        return json.loads(text)
    except RecursionError:
        raise _too_deep(_as_text(text)) from None
    except json.JSONDecodeError:
        raise
    except ValueError as err:  # int() refusing a number of more than sys.int_info digits
        doc = _as_text(text)
        found = _long_integer(doc)
        if found is None:
            raise
        raise json.JSONDecodeError(found[0], doc, found[1]) from err


def _as_text(text: str | bytes) -> str:
    return text if isinstance(text, str) else bytes(text).decode("utf-8", errors="replace")


def _too_deep(doc: str) -> json.JSONDecodeError:
    """The error at the first bracket past the parser's depth (or the deepest one, when the
    parser gave up earlier because the caller's own stack was deep already)."""
    limit = sys.getrecursionlimit()
    depth = deepest = deepest_at = 0
    for match in _STRING_OR_BRACKET.finditer(doc):
        bracket = match.group()
        if bracket in "[{":
            depth += 1
            if depth > deepest:
                deepest, deepest_at = depth, match.start()
            if depth > limit:
                break
        elif bracket in "]}":
            depth -= 1
    levels = f"more than {limit:,}" if deepest > limit else f"{deepest:,}"
    return json.JSONDecodeError(
        f"brackets nested {levels} levels deep, more than Python's JSON parser follows",
        doc,
        deepest_at,
    )


def _long_integer(doc: str) -> tuple[str, int] | None:
    """(message, position) of the first integer longer than Python converts, if there is one."""
    limit = sys.get_int_max_str_digits()
    if limit == 0:
        return None
    match = re.search(rf"\d{{{limit + 1},}}", doc)
    if match is None:
        return None
    digits = len(match.group())
    message = f"an integer of {digits:,} digits, more than the {limit:,} Python reads"
    return message, match.start()
