"""The sandbox a chat template renders in: jinja2's immutable sandbox with every operation that
can grow a value sized first (templates/bounds.py), the text a block collects sized as it
grows, and a time limit on the Python the template compiles to. `render` is its one entry.
"""

from __future__ import annotations

import functools
import re
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
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

from glassformer.templates.bounds import (
    _FILTER_SIZES,
    _METHOD_SIZES,
    MAX_OUTPUT_CHARS,
    SIZING,
    ChatTemplateError,
    _checked,
    _materialized,
    _number,
    _refuse_binop,
    _refuse_growth,
    _refuse_long_conversation,
    _refuse_sizes,
    _size,
    _too_big,
)

MAX_RENDER_SECONDS = 2.0

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
        *SIZING,
        _run_filter,
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
