"""Structured output at speed (glassformer/infer/constrain.py, docs/structured.md).

1. The grammar engines, on SmolLM2's vocabulary (49,152 byte-level BPE tokens) and the
   34 JSON Schemas of tests/data/json_schemas.json: llguidance (glassformer's choice),
   xgrammar and outlines-core, each driven from glassformer's own token bytes. Per engine: the
   vocabulary's setup time, how many schemas compile, the compile time per schema, and the
   time of one step's token mask, replayed over real outputs (SmolLM2's greedy answers to the
   suite, valid under jsonschema), with how many of those outputs the engine accepts token
   by token. Every engine is given glassformer's whitespace rule (at most 24 characters of
   JSON whitespace between two tokens).
2. Decoding SmolLM2-135M-Instruct with a JSON Schema against decoding without one, at batch 1
   and batch 8: the same prompt, the constrained rows' token count forced on the free rows
   (end of sequence ignored), alternating timed runs, median of --runs. Target: >= 0.9x.
3. Through the servers, side by side: `glassformer serve --quantize int4` and llama.cpp's own
   `llama-server` (benchmarks/build_llama_cpp.sh), both on the shipped SmolLM2 Q4_1 GGUF file
   with --threads threads and 8 slots, driven by the official `openai` client with
   `response_format: {"type": "json_schema", ...}` at temperature 0: for each of the 34 schemas
   (8 requests at a time) whether the reply is valid JSON that validates, invalid, cut at
   max_tokens, or refused with an error; then the decode schema streamed by 1 and by 8
   concurrent clients (prompt reuse off on both), aggregate tokens/s and the median time to
   first token, the servers alternating, median of --runs. Skipped without llama-server.

    pip install -e '.[bench]'                 # xgrammar and outlines-core, the other engines
    bash benchmarks/build_llama_cpp.sh        # llama-server, the peer of part 3
    python benchmarks/structured.py --threads 2
    python benchmarks/structured.py --runs 3 --json benchmarks/results/structured.json  # docs'
    python benchmarks/structured.py --servers-only --runs 3 --json \
        benchmarks/results/structured_servers.json                                       # docs'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import numpy as np
import record  # benchmarks/record.py
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SUITE = json.loads((Path(__file__).parent.parent / "tests/data/json_schemas.json").read_text())
# JSON whitespace as glassformer allows it (constrain.JSON_OPTIONS), for outlines-core's regexes.
WHITESPACE = r"[\n\r\t ]{0,24}"
# The decode benchmark's schema: ten records, about 200 tokens of JSON.
RECORDS = {
    "type": "array",
    "minItems": 10,
    "maxItems": 10,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 20},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
}


RECORDS_PROMPT = "List ten people with their age and city."


def chat_prompt(tokenizer, text: str, schema: dict) -> list[int]:
    return tokenizer.encode_chat(messages(text, schema), add_generation_prompt=True)


def reference_outputs(engine, tokenizer) -> list[list[int]]:
    """SmolLM2's greedy answer to each schema of the suite (constrained by llguidance), as
    token ids; each is checked with jsonschema."""
    import glassformer as gf

    outputs = []
    for start in range(0, len(SUITE), 8):
        group = SUITE[start : start + 8]
        params = [
            gf.SamplingParams(temperature=0.0, max_new_tokens=200, json_schema=c["schema"])
            for c in group
        ]
        rows = engine.add_many(
            [chat_prompt(tokenizer, c["prompt"], c["schema"]) for c in group], params
        )
        while not all(row.finished for row in rows):
            engine.step()
        for case, row in zip(group, rows, strict=True):
            ids = [t for t in row.tokens if t != tokenizer.eos_token_id]
            jsonschema.validate(json.loads(tokenizer.decode(ids)), case["schema"])
            outputs.append(ids)
    return outputs


# --- the engines, each behind the same three calls: setup, compile, replay ---------------------


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        from glassformer.infer.constrain import grammar_vocabulary

        self.vocab = grammar_vocabulary(tokenizer, vocab_size, tokenizer.eos_token_id)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        import llguidance as llg

        from glassformer.infer.constrain import JSON_OPTIONS

        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        matcher = llg.LLMatcher(self.vocab, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def replay(self, matcher, ids: list[int]) -> tuple[list[float], bool]:
        times = []
        for token in ids:
            start = time.perf_counter()
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size]
            times.append(time.perf_counter() - start)
            if not allowed[token] or not matcher.consume_token(token):
                return times, False
        return times, True


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        from glassformer.detokenize import TokenBytes

        spell = TokenBytes(tokenizer)
        vocab = [spell(i) for i in range(vocab_size)]
        info = xgr.TokenizerInfo(
            vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id]
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def replay(self, matcher, ids: list[int]) -> tuple[list[float], bool]:
        times = []
        for token in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(self.bitmask)
            allowed = (self.bitmask[0, token // 32] >> (token % 32)) & 1
            times.append(time.perf_counter() - start)
            if not allowed or not matcher.accept_token(token):
                return times, False
        return times, True


class OutlinesCore:
    """outlines-core compiles a schema to a regex, then the regex over the whole vocabulary into
    a token automaton (its index); tokens that are not UTF-8 by themselves (part of a character)
    have no text for its vocabulary and are never allowed."""

    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import outlines_core as oc

        from glassformer.detokenize import TokenBytes

        spell, eos = TokenBytes(tokenizer), tokenizer.eos_token_id
        mapping: dict[str, list[int]] = {}
        for i in range(vocab_size):
            try:
                text = spell(i).decode("utf-8")
            except UnicodeDecodeError:
                continue
            if i != eos:
                mapping.setdefault(text, []).append(i)
        self.vocab = oc.Vocabulary(eos, mapping)
        self.vocab_size = vocab_size

    def compile(self, schema: dict):
        import outlines_core as oc

        # Its default whitespace is "[ ]?" (one optional space), which refuses the newlines
        # and indentation models write; given llguidance's policy, the comparison is fair.
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), WHITESPACE)
        return oc.Guide(oc.Index(regex, self.vocab))

    def replay(self, guide, ids: list[int]) -> tuple[list[float], bool]:
        times = []
        mask = torch.zeros((self.vocab_size + 31) // 32, dtype=torch.int32)
        for token in ids:
            start = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
            allowed = (int(mask[token // 32]) >> (token % 32)) & 1
            times.append(time.perf_counter() - start)
            if not allowed:
                return times, False
            guide.advance(token, return_tokens=False)
        return times, True


def compare_engines(tokenizer, vocab_size: int, outputs: list[list[int]]) -> list[dict]:
    rows = []
    for kind in (Llguidance, Xgrammar, OutlinesCore):
        try:
            start = time.perf_counter()
            engine = kind(tokenizer, vocab_size)
            setup = time.perf_counter() - start
        except ImportError as err:
            print(f"{kind.name}: not installed ({err}); pip install -e '.[bench]'")
            continue
        compile_ms, mask_us, compiled, accepted, failures = [], [], 0, 0, []
        for case, ids in zip(SUITE, outputs, strict=True):
            try:
                start = time.perf_counter()
                matcher = engine.compile(case["schema"])
                compile_ms.append(1000 * (time.perf_counter() - start))
            except Exception as err:  # each engine's own error types
                failures.append(f"{case['name']}: {str(err).splitlines()[0][:80]}")
                continue
            compiled += 1
            times, ok = engine.replay(matcher, ids)
            mask_us += [1e6 * t for t in times]
            accepted += ok
            if not ok:
                failures.append(f"{case['name']}: rejects a valid output")
        row = {
            "engine": kind.name,
            "setup_s": setup,
            "schemas": len(SUITE),
            "compiled": compiled,
            "accepted": accepted,
            "compile_ms_median": statistics.median(compile_ms),
            "compile_ms_max": max(compile_ms),
            "mask_us_median": statistics.median(mask_us),
            "mask_us_p99": float(np.percentile(mask_us, 99)),
            "failures": failures,
        }
        rows.append(row)
        print(
            f"{kind.name:>14}: setup {setup:.2f} s, compiled {compiled}/{len(SUITE)}, accepted "
            f"{accepted}, compile median {row['compile_ms_median']:.1f} ms (max "
            f"{row['compile_ms_max']:.0f}), mask median {row['mask_us_median']:.0f} us (p99 "
            f"{row['mask_us_p99']:.0f})"
        )
        for failure in failures:
            print(f"{'':>16}{failure}")
    return rows


# --- decoding with and without a schema ---------------------------------------------------------


def decode_speed(engine, tokenizer, batch: int, runs: int) -> dict:
    import glassformer as gf
    from glassformer.infer.sampling import NO_EOS

    prompt = chat_prompt(tokenizer, RECORDS_PROMPT, RECORDS)

    def run(constrained: bool, n_tokens: int | None) -> tuple[float, list[int]]:
        if constrained:
            params = gf.SamplingParams(temperature=0.0, max_new_tokens=400, json_schema=RECORDS)
        else:
            params = gf.SamplingParams(
                temperature=0.0, max_new_tokens=n_tokens, eos_token_id=NO_EOS
            )
        start = time.perf_counter()
        rows = engine.add_many([prompt] * batch, [params] * batch)
        while not all(row.finished for row in rows):
            engine.step()
        return time.perf_counter() - start, [len(row.tokens) for row in rows]

    _, counts = run(True, None)  # warm-up; the free rows then generate as many tokens
    n_tokens = max(counts)
    times = {"json_schema": [], "free": []}
    for _ in range(runs):
        seconds, counts = run(True, None)
        assert min(counts) == n_tokens, counts  # greedy: every run the same answer
        times["json_schema"].append(batch * n_tokens / seconds)
        seconds, _ = run(False, n_tokens)
        times["free"].append(batch * n_tokens / seconds)
    constrained, free = (statistics.median(times[k]) for k in ("json_schema", "free"))
    print(
        f"batch {batch}: {n_tokens} tokens per row; free {free:.1f} tok/s, json schema "
        f"{constrained:.1f} tok/s, ratio {constrained / free:.2f}x"
    )
    return {
        "batch": batch,
        "tokens_per_row": n_tokens,
        "free_tokens_per_s": free,
        "schema_tokens_per_s": constrained,
        "ratio": constrained / free,
    }


# --- through the servers: glassformer serve and llama-server -----------------------------------


def classify(reply: str | None, finish: str | None, schema: dict) -> str:
    """valid (complete and it validates), invalid (complete, but not JSON or not valid under the
    schema), or length (cut at max_tokens)."""
    if finish == "length":
        return "length"
    try:
        jsonschema.validate(json.loads(reply or ""), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def messages(text: str, schema: dict) -> list[dict]:
    """The conversation every run sends: the schema in the system turn, then the request."""
    system = "Answer with JSON only, matching this schema: " + json.dumps(schema)
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


@dataclass
class Served:
    """A server under test: its url, the model name it serves, and fields only it takes."""

    url: str
    extra: dict
    model: str = ""

    def __post_init__(self) -> None:
        import openai

        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none")
        self.model = client.models.list().data[0].id


async def suite_through(server: Served) -> dict:
    """Each schema of the suite through one server, 8 requests at a time: counts of valid,
    invalid, length and refused (an error status, with the first message kept)."""
    import openai

    limit = asyncio.Semaphore(8)

    async def one(client, case) -> tuple[str, str]:
        async with limit:
            try:
                reply = await client.chat.completions.create(
                    model=server.model, messages=messages(case["prompt"], case["schema"]),
                    response_format=response_format(case["name"], case["schema"]),
                    temperature=0, max_tokens=200, extra_body=server.extra,
                )  # fmt: skip
            except openai.APIStatusError as err:
                return "refused", f"{case['name']}: {err.status_code} {str(err.message)[:90]}"
            choice = reply.choices[0]
            verdict = classify(choice.message.content, choice.finish_reason, case["schema"])
            if verdict == "valid":
                return verdict, ""
            return verdict, f"{case['name']}: {verdict}: {str(choice.message.content)[:80]!r}"

    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="none", timeout=600
    ) as client:
        results = await asyncio.gather(*(one(client, case) for case in SUITE))
    counts = {k: sum(r == k for r, _ in results) for k in ("valid", "invalid", "length", "refused")}
    return counts | {"errors": [message for _, message in results if message]}


async def schema_stream(server: Served, batch: int) -> dict:
    """`batch` concurrent streams of the decode schema: aggregate tokens/s (completion tokens
    from each stream's usage over the wall time), median time to first token, valid replies."""
    import openai

    async def one(client) -> tuple[float, int, str]:
        start, first, text, tokens = time.perf_counter(), None, [], 0
        stream = await client.chat.completions.create(
            model=server.model, messages=messages(RECORDS_PROMPT, RECORDS),
            response_format=response_format("records", RECORDS), temperature=0, max_tokens=400,
            stream=True, stream_options={"include_usage": True}, extra_body=server.extra,
        )  # fmt: skip
        finish = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return (
            (first or time.perf_counter()) - start,
            tokens,
            classify("".join(text), finish, RECORDS),
        )

    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="none", timeout=600
    ) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client) for _ in range(batch)))
        wall = time.perf_counter() - start
    return {
        "tok_s": sum(n for _, n, _ in results) / wall,
        "ttft_s": statistics.median(t for t, _, _ in results),
        "tokens": sum(n for _, n, _ in results),
        "valid": sum(v == "valid" for _, _, v in results),
    }


def servers_side_by_side(threads: int, runs: int) -> dict | None:
    from contextlib import ExitStack

    from llama_cpp_peer import llama_cpp_binary, llama_cpp_version
    from servers import glassformer_server, llama_server

    from glassformer.interop.pretrained import resolve

    if llama_cpp_binary("llama-server") is None:
        print("llama-server: not built (bash benchmarks/build_llama_cpp.sh); servers skipped")
        return None
    gguf = resolve("smollm2")
    with ExitStack() as stack:
        ours = [
            "--model",
            str(gguf),
            "--quantize",
            "int4",
            "--max-batch",
            "8",
            "--prefix-cache-mb",
            "0",
        ]
        url = stack.enter_context(glassformer_server(ours, threads))
        peer = stack.enter_context(llama_server(gguf, threads, parallel=8))
        # cache_prompt: llama-server's prompt reuse across requests, off (as glassformer's is)
        servers = {
            "glassformer serve int4": Served(url, {}),
            "llama-server Q4_1": Served(peer, {"cache_prompt": False}),
        }
        suites = {}
        for name, server in servers.items():
            suites[name] = asyncio.run(suite_through(server))
            counts = suites[name]
            print(
                f"{name:>22}: {counts['valid']} valid, {counts['invalid']} invalid, "
                f"{counts['length']} cut at max_tokens, {counts['refused']} refused of {len(SUITE)}"
            )
            for message in counts["errors"]:
                print(f"{'':>24}{message}")
        speed = []
        for batch in (1, 8):
            for server in servers.values():
                asyncio.run(schema_stream(server, batch))  # warm-up
            samples = {name: [] for name in servers}
            for _ in range(runs):
                for name, server in servers.items():
                    samples[name].append(asyncio.run(schema_stream(server, batch)))
            for name, results in samples.items():
                row = {
                    "server": name,
                    "clients": batch,
                    "tok_s": statistics.median(r["tok_s"] for r in results),
                    "ttft_s": statistics.median(r["ttft_s"] for r in results),
                    "tokens_per_run": results[0]["tokens"],
                    "valid": min(r["valid"] for r in results),
                }
                speed.append(row)
                print(
                    f"{name:>22}, {batch} client(s): {row['tok_s']:.1f} tok/s, TTFT "
                    f"{row['ttft_s']:.2f} s, {row['valid']}/{batch} valid"
                )
    return {"llama_cpp": llama_cpp_version(), "suite": suites, "speed": speed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--servers-only", action="store_true", help="only part 3: the servers side by side"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.servers_only:
        servers = servers_side_by_side(args.threads, args.runs)
        if args.json and servers:
            record.write(args.json, args.threads, {"runs": args.runs, "servers": servers})
        return
    import glassformer as gf
    from glassformer.infer.constrain import Grammars, constraint_from

    model, tokenizer = gf.from_pretrained("smollm2")
    vocab_size = model.cfg.vocab_size
    engine = gf.Engine(model, tokenizer=tokenizer, max_rows=8)
    start = time.perf_counter()
    Grammars(tokenizer, vocab_size, tokenizer.eos_token_id).matcher(constraint_from(RECORDS))
    first_compile = time.perf_counter() - start
    print(f"glassformer: the vocabulary and the decode schema compiled in {first_compile:.2f} s")
    outputs = reference_outputs(engine, tokenizer)
    engines = compare_engines(tokenizer, vocab_size, outputs)
    speed = [decode_speed(engine, tokenizer, batch, args.runs) for batch in (1, 8)]
    del engine, model  # the servers load their own
    servers = servers_side_by_side(args.threads, args.runs)
    if args.json:
        fields = {"runs": args.runs, "first_compile_s": first_compile, "engines": engines}
        record.write(args.json, args.threads, fields | {"decode": speed, "servers": servers})


if __name__ == "__main__":
    main()
