"""The OpenAI protocol at the edge (seed 002: "这正是你天天调的 API 参数"): typed request models,
validated before anything reaches the engine, and the OpenAI-style error object for a request
that does not fit.

Every request model forbids fields it does not know, so a parameter this server does not
implement (echo, prediction, audio, ...) is a 400 that names it, never silently
ignored. The fields of OpenAI's schema that cannot change the output here (store, metadata,
user, ...) are accepted, type-checked, and listed back as ignored (Ignorable). Values are
checked strictly (a temperature of "0.7" or an n of 1.5 is refused, not cast).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from glassformer import json_input
from glassformer.infer.sampling import normalize_logit_bias

# --- errors -------------------------------------------------------------------------------------


class APIError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status,
            message,
            param,
            kind,
            code,
        )
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.kind, "param": self.param}
        return {"error": {**error, "code": self.code}}


def engine_stopped() -> APIError:
    """The 503 for work handed to an engine thread that has stopped: /v1's requests and the
    lab's forwards say the same."""
    return APIError(
        503,
        "the engine has stopped (the server is shutting down): retry on a running server",
        kind="server_error",
        code="engine_stopped",
    )


def parse_json(raw: bytes) -> Any:
    """The request body as JSON, or a 400 that says where it is broken."""
    try:
        return json_input.loads(raw)
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not UTF-8 text: send JSON") from None
    except json.JSONDecodeError as err:
        raise APIError(
            400,
            f"the request body is not valid JSON ({err.msg} at line {err.lineno} column "
            f'{err.colno}): send a JSON object such as {{"model": ..., "messages": [...]}}',
            code="invalid_json",
        ) from None


def validate(model: type[BaseModel], data: Any) -> Any:
    """data as `model`, or a 400 naming the first field that does not fit and how to fix it."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _field_error(model, err) from None


def _field_error(model: type[BaseModel], err: ValidationError) -> APIError:
    first = err.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        known = ", ".join(sorted(model.model_fields))
        message = (
            f"unknown or unsupported field {param!r}: this server does not implement it, so it "
            f"refuses it rather than ignore it; remove it (the fields it accepts: {known})"
        )
        return APIError(400, message, param, code="unsupported_field")
    if first["type"] == "missing":
        return APIError(400, f"{param!r} is required", param, code="missing_field")
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    given = first.get("input")
    shown = json.dumps(given)[:80] if _jsonable(given) else type(given).__name__
    return APIError(400, f"{param}={shown} is not allowed: {message}", param, code="invalid_value")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# --- requests -----------------------------------------------------------------------------------


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Ignorable(Strict):
    """Fields of OpenAI's request schema that clients send by default and that cannot change
    the output of this server: accepted, and named in the reply's x-glassformer-ignored-fields
    header (gate.py) so no one believes they took effect."""

    user: str | None = None  # an end-user id (OpenAI records it for abuse checks)
    safety_identifier: str | None = None  # user's successor in OpenAI's schema
    store: bool | None = None  # keep the completion on OpenAI's side for distillation/evals
    metadata: dict[str, str] | None = None  # tags for stored completions
    service_tier: str | None = None  # OpenAI's processing tier: this server has one
    prompt_cache_key: str | None = None  # a routing hint: the prefix cache here needs none
    parallel_tool_calls: bool | None = None  # read by a chat request with tools (server/tools.py)

    @property
    def ignored_fields(self) -> list[str]:
        """The ignorable fields this request set, in the order of the schema."""
        return [name for name in Ignorable.model_fields if name in self.model_fields_set]


class StreamOptions(Strict):
    include_usage: bool = False


def _stop_list(value: Any) -> list[str] | None:
    """OpenAI's stop: a string or a list of up to 4 non-empty strings."""
    if value is None:
        return None
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, list) or not all(isinstance(s, str) for s in entries):
        raise ValueError("give a string or a list of strings")
    if len(entries) > 4 or not all(entries):
        raise ValueError("give at most 4 stop strings, none of them empty")
    return entries


def _logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias}. JSON keys are strings, so each must spell a
    whole number; the biases and the entry count follow SamplingParams' own rule (sampling.py),
    and the route checks the ids against the vocabulary."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError('give an object from token ids to biases, e.g. {"50256": -100}')
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ValueError(f'the key {key!r} is not a token id: use whole numbers, e.g. "50256"')
        pairs.append((int(key), bias))
    return dict(normalize_logit_bias(pairs))


class SamplingFields(Ignorable):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    min_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # vLLM's and llama.cpp's extras (the CLI's flags of the same names); stop_token_ids are
    # checked against the vocabulary by the route, which knows it.
    repetition_penalty: float = Field(1.0, gt=0, le=10, allow_inf_nan=False)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False  # generate all max_tokens: no end-of-sequence or end-of-turn stop
    # vLLM's min_tokens: no end-of-sequence, stop token or stop string before this many tokens
    # (the route checks it against max_tokens); OpenAI's logit_bias, biases in [-100, 100].
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[int, float] | None = None
    # Structured output (server/tools.py): {"type": "json_object"} or {"type": "json_schema",
    # "json_schema": {"name": ..., "schema": {...}, "strict": true}}; checked by the route.
    response_format: dict[str, Any] | None = None
    # vLLM's cache_salt: this request's rows share cached keys/values (the prefix cache,
    # server/scheduler.py) only with requests of the same salt, so no other client can time
    # whether its prompt was seen.
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    _check_stop = field_validator("stop", mode="before")(lambda cls, v: _stop_list(v))
    _check_bias = field_validator("logit_bias", mode="before")(lambda cls, v: _logit_bias(v))


class CompletionRequest(SamplingFields):
    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(_whole(i) for i in value):
            return value
        if isinstance(value, list) and len(value) == 1:
            return cls._one_prompt(value[0])
        raise ValueError(
            "give one prompt: a non-empty string or a list of token ids (for several prompts, "
            "send several requests; for several completions of one prompt, use n)"
        )


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    # An assistant turn that called tools, and a tool's result answering one of its calls
    # (OpenAI's form: {"id", "type": "function", "function": {"name", "arguments"}}).
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> str | None:
        """A string, or a list of text parts (joined); images and audio are refused."""
        if value is None:
            return None
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            texts = []
            for part in value:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise ValueError("this server reads text only: give {'type': 'text', ...}")
                if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                    raise ValueError("a text part is {'type': 'text', 'text': '...'}")
                texts.append(part["text"])
            return "".join(texts)
        raise ValueError("give the message text as a string (or a list of text parts)")


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json(cls, value: str) -> str:
        try:
            json.loads(value)
        except ValueError:
            raise ValueError("a tool call's arguments must be JSON text") from None
        return value


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ChatMessage.model_rebuild()


class ChatTemplateKwargs(Strict):
    """vLLM's chat_template_kwargs; Qwen3's enable_thinking is the one read here."""

    enable_thinking: bool = True


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # A thinking model (<think> ... </think>): at most this many thinking tokens; 0 answers at
    # once, as chat_template_kwargs={"enable_thinking": false} does.
    thinking_budget: int | None = Field(None, ge=0)
    chat_template_kwargs: ChatTemplateKwargs | None = None
    # OpenAI's function calling (server/tools.py checks them and builds the grammar)
    tools: list[Any] | None = None
    tool_choice: Any = None

    @property
    def ignored_fields(self) -> list[str]:
        ignored = super().ignored_fields
        return [f for f in ignored if not (f == "parallel_tool_calls" and self.tools)]

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a prompt, or a conversation formatted by the chat template."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)


class DetokenizeRequest(Strict):
    model: str
    tokens: list[int]


class EmbeddingRequest(Ignorable):
    model: str
    input: Any
    encoding_format: Literal["float", "base64"] = "float"

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, value: Any) -> list[str] | list[list[int]]:
        """A string, a list of strings, a list of token ids, or a list of such lists."""
        if isinstance(value, str) and value:
            return [value]
        if isinstance(value, list) and value:
            if all(isinstance(s, str) and s for s in value):
                return value
            if all(_whole(i) for i in value):
                return [value]
            if all(isinstance(s, list) and s and all(_whole(i) for i in s) for s in value):
                return value
        raise ValueError(
            "give a non-empty string, a list of non-empty strings, or token ids (a list of "
            "whole numbers, or a list of such lists)"
        )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
