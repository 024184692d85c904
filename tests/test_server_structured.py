"""Structured output over the API (issue 35), with the official openai client against a real
`glassformer serve --model smollm2`: response_format's JSON modes, tool calls (required, a
named function, streamed as deltas, a tool's result in the next turn), and the 400s for
constraints that do not compile, after which the server keeps serving."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import jsonschema
import openai
import pytest
from serving import start_server, stop_server

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CALC = {
    "type": "object",
    "properties": {"expression": {"type": "string", "maxLength": 40}},
    "required": ["expression"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "calculator", "description": "Arithmetic",
                                      "parameters": CALC}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "calculator": CALC}
ASK_WEATHER = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def client():
    process, url = start_server(["--model", "smollm2"])
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stop_server(process)


def chat(client, messages, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 60} | kwargs
    return client.chat.completions.create(model="smollm2", messages=messages, **kwargs)


def test_json_schema_replies_validate(client):
    messages = [{"role": "user", "content": "Which city is the capital of France?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    reply = chat(client, messages, response_format=fmt, n=3, temperature=0.8, seed=1)
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), CITY)
        assert choice.finish_reason == "stop"
    greedy = json.loads(chat(client, messages, response_format=fmt).choices[0].message.content)
    assert greedy["city"] == "Paris"


def test_json_object_mode_replies_with_an_object(client):
    messages = [{"role": "user", "content": "Give the name and age of a cat, in JSON."}]
    reply = chat(client, messages, response_format={"type": "json_object"}, max_tokens=100)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_a_schema_that_cannot_finish_in_max_tokens_ends_with_length(client):
    schema = {"type": "object", "properties": {"essay": {"type": "string", "minLength": 200}},
              "required": ["essay"]}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "essay", "schema": schema}}
    reply = chat(client, ASK_WEATHER, response_format=fmt, max_tokens=8)
    assert reply.choices[0].finish_reason == "length"  # never presented as complete


@pytest.mark.parametrize("choice", ["required", "get_weather", "calculator"])
def test_required_and_named_tool_choices_call_a_tool_with_valid_arguments(client, choice):
    named = {"type": "function", "function": {"name": choice}}
    reply = chat(
        client,
        ASK_WEATHER,
        tools=TOOLS,
        tool_choice=choice if choice == "required" else named,
        parallel_tool_calls=False,
    )
    message, finish = reply.choices[0].message, reply.choices[0].finish_reason
    assert finish == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if choice != "required":
        assert call.function.name == choice
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_calls_stream_as_deltas_that_add_up(client):
    stream = chat(
        client, ASK_WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        stream=True,
    )  # fmt: skip
    headers, arguments, finish = [], "", None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            assert delta.index == 0
            if delta.id is not None:
                headers.append((delta.id, delta.function.name))
            arguments += delta.function.arguments or ""
    ((call_id, name),) = headers
    assert call_id.startswith("call_") and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_tools_result_goes_back_into_the_conversation(client):
    first = chat(
        client, ASK_WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
    ]
    reply = chat(client, messages, tools=TOOLS, tool_choice="none", max_tokens=30)
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    without = chat(client, ASK_WEATHER, tools=TOOLS, tool_choice="none", max_tokens=1)
    added = reply.usage.prompt_tokens - without.usage.prompt_tokens
    assert added > len(call.function.arguments) // 4  # the call and its result were rendered


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format", "Invalid type: strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "propertyNames": {"maxLength": 3}}}}},
         "response_format", "propertyNames"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "[a-"}}}},
         "response_format", "unclosed character class"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"enum": ["x" * 100_001]}}}},
         "response_format", "the limit is 100,000"),
        ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "'nope', which is not among the tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0",
         "not allowed"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "two tools are named 'get_weather'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_in_milliseconds_and_the_server_keeps_serving(
    client, kwargs, param, words
):
    start = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, ASK_WEATHER, max_tokens=4, **kwargs)
    assert time.perf_counter() - start < 2.0
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error
    assert chat(client, ASK_WEATHER, max_tokens=2).choices[0].finish_reason == "length"


# --- examples/agent.py ----------------------------------------------------------------------------


def agent_module():
    path = Path(__file__).parent.parent / "examples" / "agent.py"
    spec = importlib.util.spec_from_file_location("agent", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("expression", "value"),
    [("17 * 23", "391"), ("(1 + 2) ** 3 / 2", "13.5"), ("-4 - -4", "0"),
     ("__import__('os')", "error: not arithmetic"), ("1 / 0", "error: division by zero"),
     ("2 ** 1000", "error: exponent too large"), ("17 *", "error:")],
)  # fmt: skip
def test_the_agents_calculator_reads_arithmetic_only(expression, value):
    assert agent_module().calculate(expression).startswith(value)


def test_the_agent_runs_the_models_tool_calls_until_it_answers(client):
    agent = agent_module()
    server = str(client.base_url).removesuffix("/v1/")
    conversation = agent.run_agent(
        client, server, "What is 17 * 23?", [agent.CALCULATOR], "smollm2", first_call="required",
        max_tokens=40,
    )  # fmt: skip
    call = conversation[1]["tool_calls"][0]
    assert call["function"]["name"] == "calculator"
    expression = json.loads(call["function"]["arguments"])["expression"]
    assert conversation[2] == {
        "role": "tool", "tool_call_id": call["id"], "content": agent.calculate(expression),
    }  # fmt: skip
    answer = conversation[-1]
    assert answer["role"] == "assistant" and answer["content"] and not answer.get("tool_calls")
