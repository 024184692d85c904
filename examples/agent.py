"""An agent in 100 lines: the official openai client against `glassformer serve`, offering two
tools (a calculator, and retrieval from a RAG store when the server has one) and running the
model's tool calls until it answers.

    glassformer serve --model smollm2 --embed-model minilm --rag-store kb &
    python examples/agent.py "What is 17 * 23?" --first-call required

--first-call required makes the first reply a tool call (SmolLM2-135M does not call tools on
its own: it is only held to the call's form; see docs/structured.md). The calculator reads
arithmetic with Python's ast module (numbers, + - * / ** and parentheses), never eval.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator

import httpx
import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as (17 + 3) * 23",
        "parameters": {
            "type": "object",
            # The pattern holds even a small model to arithmetic (the schema is a constraint).
            "properties": {"expression": {"type": "string", "pattern": r"^[0-9+*/(). -]{1,60}$"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_documents",
        "description": "Find passages of the indexed documents about a question",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 120}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg,
}  # fmt: skip


def calculate(expression: str) -> str:
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            if isinstance(node.op, ast.Pow) and abs(value(node.right)) > 100:
                raise ValueError("exponent too large")
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
        return f"error: {err}"


def search_documents(server: str, query: str, k: int = 3) -> str:
    reply = httpx.post(f"{server}/rag/search", json={"query": query, "k": k}, timeout=60)
    if reply.status_code != 200:
        return f"error: {reply.json()['error']['message']}"
    return "\n\n".join(f"[{h['source']}] {h['text']}" for h in reply.json()["data"])


def run_agent(
    client: openai.OpenAI, server: str, question: str, tools: list[dict], model: str,
    first_call: str = "auto", max_turns: int = 4, max_tokens: int = 128,
) -> list[dict]:  # fmt: skip
    """Ask, run every tool call the model makes, give it the results, until it answers; returns
    the conversation (the last message is the answer)."""
    messages: list[dict] = [{"role": "user", "content": question}]
    for turn in range(max_turns):
        last = turn == max_turns - 1
        choice = "none" if last else (first_call if turn == 0 else "auto")
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=tools, tool_choice=choice,
            parallel_tool_calls=False, temperature=0, max_tokens=max_tokens,
        )  # fmt: skip
        message = reply.choices[0].message
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            return messages
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            if call.function.name == "calculator":
                result = calculate(arguments["expression"])
            else:
                result = search_documents(server, arguments["query"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("question")
    parser.add_argument("--server", default="http://127.0.0.1:8000")
    parser.add_argument("--first-call", choices=("auto", "required"), default="auto")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=f"{args.server}/v1", api_key="unused")
    model = client.models.list().data[0].id
    probe = httpx.post(f"{args.server}/rag/search", json={"query": "x", "k": 1}, timeout=60)
    has_store = probe.status_code == 200  # 404 without serve --rag-store
    tools = [CALCULATOR, SEARCH] if has_store else [CALCULATOR]
    for message in run_agent(client, args.server, args.question, tools, model, args.first_call):
        for call in message.get("tool_calls") or []:
            print(f"[call] {call['function']['name']}({call['function']['arguments']})")
        if message.get("content"):
            print(f"[{message['role']}] {message['content']}")


if __name__ == "__main__":
    main()
