"""Structured output at the API: response_format and tool calls, as constraints on the engine.

response_format {"type": "json_object"} or {"type": "json_schema", ...} becomes the row's
json_schema. Tools are constrained output plus the chat template: the reply's tool calls are
written in the Hermes form Qwen's models are trained on,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and a grammar holds the model to it: tool_choice "required" or a named function allows only
calls (to any tool, or to that one); "auto" leaves the text free until the model writes
"<tool_call>", after which the call must be well-formed (llguidance's lazy trigger). A chat
template that knows tools (Qwen3's) describes them itself; for one that does not (SmolLM2's)
the tools are described in the system turn, so such a model is only forced to be well-formed.
ToolCallStream then turns the reply text back into OpenAI's tool_calls, streamed as deltas.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
# Tool calls are written compactly with the separators of json.dumps, the form Qwen's models
# were trained on, so the call's header is always the same bytes and can be read while streaming.
CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
HEADER = re.compile(r'\s*\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')


class ToolError(ValueError):
    """A tools/tool_choice/response_format the server refuses (a 400 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# --- response_format ------------------------------------------------------------------------


def response_format_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON Schema a response_format asks for (None: free text)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ToolError(
                'response_format json_schema needs {"name": ..., "schema": {...}}',
                "response_format",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise ToolError("response_format's schema must be a JSON object", "response_format")
        return schema
    raise ToolError(
        f"response_format type {kind!r} is not supported: use text, json_object or json_schema",
        "response_format",
    )


# --- tools ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        """OpenAI's form, as chat templates and the system turn show it."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and how they may be called."""

    tools: tuple[Tool, ...]
    choice: str  # "auto", "required" or the one tool's name
    parallel: bool

    @property
    def callable(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    def grammar(self) -> str:
        """The Lark grammar (llguidance's dialect) of the reply."""
        schema = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in self.callable
            ],
            "x-guidance": CALL_JSON,
        }
        opening, closing = json.dumps(OPEN + "\n"), json.dumps("\n" + CLOSE)
        body = f"%json {json.dumps(schema)} {closing}"
        more = '("\\n" call)*' if self.parallel else ""
        rules = f"call: {opening} body\nbody: {body}\n"
        if self.choice != "auto":
            return f"start: call {more}\n{rules}"
        # Free text, or text up to "<tool_call>" (a lazy lexeme: it ends at the first one),
        # after which only well-formed calls may follow.
        return (
            "%llguidance {}\n"
            f"start: TEXT | first {more}\n"
            "first: opened body\n"
            f"opened[lazy]: TEXT {opening}\n"
            "TEXT: /(.|\\n)*/\n"
            f"{rules}"
        )

    def system_turn(self) -> str:
        """The tools described for a chat template that cannot render them."""
        lines = "\n".join(json.dumps(t.spec(), ensure_ascii=False) for t in self.tools)
        rule = {
            "auto": "When a tool would help, call it",
            "required": "Call one of the tools now",
        }.get(self.choice, f"Call the tool {self.choice} now")
        return (
            f"You can call these tools:\n<tools>\n{lines}\n</tools>\n{rule}: reply with\n"
            f'{OPEN}\n{{"name": <tool name>, "arguments": <arguments object>}}\n{CLOSE}'
        )


def tool_use(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolUse | None:
    """The request's tools, checked; None when no tool may be called (none given, or
    tool_choice "none")."""
    if tools is None:
        if tool_choice not in (None, "none"):
            message = "tool_choice needs tools: send the tools it chooses among"
            raise ToolError(message, "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools must be a non-empty list of functions", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"{len(tools)} tools: at most {MAX_TOOLS} are allowed", "tools")
    checked: list[Tool] = []
    for i, entry in enumerate(tools):
        checked.append(_tool(entry, f"tools.{i}"))
    names = [t.name for t in checked]
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ToolError(f"two tools are named {twice!r}: give each a unique name", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ToolError(
                'tool_choice names a function as {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in names:
            raise ToolError(
                f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})",
                "tool_choice",
            )
        choice = name
    elif choice == "none":
        return None
    elif choice not in ("auto", "required"):
        raise ToolError(
            f"tool_choice={choice!r}: use none, auto, required or a named function",
            "tool_choice",
        )
    return ToolUse(tuple(checked), choice, True if parallel is None else parallel)


def _tool(entry: Any, param: str) -> Tool:
    if not isinstance(entry, dict) or entry.get("type") != "function":
        raise ToolError('each tool is {"type": "function", "function": {...}}', param)
    function = entry.get("function")
    if not isinstance(function, dict):
        raise ToolError('a tool needs "function": {"name": ..., "parameters": {...}}', param)
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolError(
            f"tool name {name!r} is not allowed: use 1-64 letters, digits, _ or -", param
        )
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise ToolError(f"the parameters of {name!r} must be a JSON Schema object", param)
    description = function.get("description", "")
    if not isinstance(description, str):
        raise ToolError(f"the description of {name!r} must be a string", param)
    return Tool(name, description, parameters)


def message_dict(message: Any) -> dict[str, Any]:
    """A request's ChatMessage as a chat template reads it (developer turns are system turns)."""
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def conversation(messages: list[dict], use: ToolUse | None, template: str) -> tuple[list, dict]:
    """The messages and template variables to render: a template that knows tools gets them
    (and the calls and results as it expects them); for one that does not, calls are written
    as the reply text they were, results as <tool_response> user turns (Qwen's form), and the
    tools go in the system turn."""
    knows_tools = "tools" in template
    rendered = []
    for message in messages:
        calls = message.get("tool_calls")
        if knows_tools:
            if calls:
                message = {**message, "content": message.get("content") or ""}
            rendered.append(message)
        elif message["role"] == "tool":
            text = f"<tool_response>\n{message['content']}\n</tool_response>"
            rendered.append({"role": "user", "content": text})
        elif calls:
            written = "\n".join(call_text(c["function"]) for c in calls)
            content = message.get("content") or ""
            rendered.append({"role": "assistant", "content": f"{content}{written}"})
        else:
            rendered.append(message)
    if use is None:
        return rendered, {}
    if knows_tools:
        return rendered, {"tools": [t.spec() for t in use.tools]}
    if rendered and rendered[0]["role"] == "system":
        first = rendered[0]
        rendered[0] = {**first, "content": f"{first['content']}\n\n{use.system_turn()}"}
    else:
        rendered.insert(0, {"role": "system", "content": use.system_turn()})
    return rendered, {}


def call_text(function: dict[str, Any]) -> str:
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


# --- the reply as content and tool calls ---------------------------------------------------------


def _held(text: str, marker: str) -> int:
    """How many characters at the end of text could begin `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Reads a reply as it streams: text outside <tool_call> blocks is content; each block
    becomes a tool call whose header (id, name) is sent once its name is written and whose
    arguments follow as deltas, as OpenAI streams them."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # how far the text has been read
        self.calls: list[dict[str, Any]] = []  # id, name, arguments (as sent so far)
        self.args_at: int | None = None  # where the open call's arguments start
        self.in_call = False
        self.after_call = False

    def push(self, piece: str) -> tuple[str, list[dict]]:
        """New reply text -> (content to show, tool-call deltas)."""
        self.text += piece
        content, deltas = "", []
        while True:
            if not self.in_call:
                if self.after_call:  # the newline between two calls is not content
                    if self.pos == len(self.text):
                        return content, deltas
                    self.pos += self.text.startswith("\n", self.pos)
                    self.after_call = False
                found = self.text.find(OPEN, self.pos)
                if found < 0:
                    end = len(self.text) - _held(self.text[self.pos :], OPEN)
                    content += self.text[self.pos : end]
                    self.pos = end
                    return content, deltas
                content += self.text[self.pos : found]
                self.pos, self.in_call, self.args_at = found + len(OPEN), True, None
            closed = self.text.find(CLOSE, self.pos)
            if self.args_at is None:
                end = closed if closed >= 0 else len(self.text)
                header = HEADER.match(self.text, self.pos, end)
                if header is None:
                    return content, deltas
                self.args_at = header.end()
                call = {"id": f"call_{secrets.token_hex(12)}", "name": header.group(1)}
                self.calls.append({**call, "arguments": ""})
                deltas.append(self._delta(call | {"arguments": ""}))
            call = self.calls[-1]
            if closed < 0:  # arguments so far, less a tail that may be the call's ending
                body = self.text[self.args_at :]
                body = body[: len(body) - _held(body, "}\n" + CLOSE)]
            else:
                body = self.text[self.args_at : closed].rstrip()
                body = body[:-1] if body.endswith("}") else body  # the call's own brace
            new = body[len(call["arguments"]) :]
            if new:
                call["arguments"] += new
                deltas.append(self._delta({"arguments": new}))
            if closed < 0:
                return content, deltas
            self.pos, self.in_call, self.after_call = closed + len(CLOSE), False, True

    def finish(self) -> tuple[str, list[dict]]:
        """The reply ended: a held tail that never became <tool_call> is content."""
        if self.in_call:
            return "", []
        content = self.text[self.pos :]
        self.pos = len(self.text)
        return content, []

    def _delta(self, fields: dict) -> dict:
        index = len(self.calls) - 1
        function = {k: fields[k] for k in ("name", "arguments") if k in fields}
        delta: dict[str, Any] = {"index": index}
        if "id" in fields:
            delta |= {"id": fields["id"], "type": "function"}
        return delta | {"function": function}

    def tool_calls(self) -> list[dict]:
        """The finished calls in OpenAI's message form."""
        return [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in self.calls
        ]
