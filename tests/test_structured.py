"""Constrained decoding (infer/constrain.py): every output of a 34-schema suite parses and
validates with the `jsonschema` package, greedy and sampled, at batch 1 and batch 8; the mask
equals the `regex` package's partial matches on a char vocabulary; a mask that allows
everything changes nothing; bad constraints are one-line errors."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

import jsonschema
import pytest
import regex
import torch

import glassformer as gf
from glassformer.infer.constrain import ConstraintError, constraint_from
from glassformer.infer.sampling import NO_EOS
from tests.conftest import tiny_model

SUITE = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from glassformer.interop.gguf import tokenizer_from_gguf
    from glassformer.interop.gguf_file import read_gguf
    from glassformer.interop.pretrained import resolve

    return tokenizer_from_gguf(read_gguf(resolve("smollm2")))


@pytest.fixture(scope="module")
def random_engine(smollm2_tokenizer):
    """A random tiny GPT on SmolLM2's real vocabulary (49,152 byte-level BPE tokens): it wants
    nothing in particular, so every bracket, quote and digit it writes is the mask's doing."""
    model = tiny_model(vocab_size=smollm2_tokenizer.vocab_size, max_seq_len=512, scale=2.0)
    return gf.Engine(model, tokenizer=smollm2_tokenizer, max_rows=8)


def answer(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode([t for t in token_ids if t != tokenizer.eos_token_id])


def run_suite(engine, tokenizer, batch: int, temperature: float) -> list[str]:
    """Generate every schema of the suite; returns the failures (name, reason)."""
    failures = []
    for start in range(0, len(SUITE), batch):
        group = SUITE[start : start + batch]
        params = [
            gf.SamplingParams(
                temperature=temperature,
                seed=start + i,
                max_new_tokens=400,
                json_schema=case["schema"],
            )
            for i, case in enumerate(group)
        ]
        prompts = [tokenizer.encode(case["prompt"]) for case in group]
        rows = engine.add_many(prompts, params)
        while not all(row.finished for row in rows):
            engine.step()
        for case, row in zip(group, rows, strict=True):
            text = answer(tokenizer, row.tokens)
            try:
                jsonschema.validate(json.loads(text), case["schema"])
            except (ValueError, jsonschema.ValidationError) as err:
                failures.append(f"{case['name']} ({row.stop_reason}): {text[:80]!r}: {err}")
            if row.stop_reason not in ("stop", "eos"):
                failures.append(f"{case['name']} ended by {row.stop_reason}")
    return failures


def test_the_suite_has_at_least_30_valid_schemas():
    assert len(SUITE) >= 30
    for case in SUITE:
        jsonschema.Draft202012Validator.check_schema(case["schema"])


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_of_the_schema_suite_validates(
    random_engine, smollm2_tokenizer, batch, temperature
):
    assert run_suite(random_engine, smollm2_tokenizer, batch, temperature) == []


def test_a_real_model_fills_a_schema_with_sense(smollm2_tokenizer):
    """SmolLM2-135M-Instruct, greedy: the schema's fields with values a person would write."""
    model, tokenizer = gf.from_pretrained("smollm2")
    engine = gf.Engine(model, tokenizer=tokenizer)
    schema = SUITE[0]["schema"]  # person: name and age
    prompt = tokenizer.encode_chat(
        [{"role": "user", "content": "Give me a person as JSON."}], add_generation_prompt=True
    )
    result = engine.generate(prompt, max_new_tokens=40, temperature=0.0, json_schema=schema)
    reply = json.loads(answer(tokenizer, result.token_ids))
    jsonschema.validate(reply, schema)
    assert reply["name"].strip() and 0 < reply["age"] < 120
    assert result.stats.stop_reason == "stop"


# --- the mask against independent references ---------------------------------------------------

CHARS = list("0123456789abcdef-. ")


@pytest.fixture
def char_engine():
    tokenizer = gf.CharTokenizer(CHARS)
    model = tiny_model(vocab_size=len(CHARS), max_seq_len=64)
    return gf.Engine(model, tokenizer=tokenizer), tokenizer


def can_continue(pattern: str, text: str) -> bool:
    """The `regex` package's partial matching: some completion of `text` fully matches."""
    return regex.fullmatch(pattern, text, partial=True) is not None


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-f]{2}", r"(ab|ba)+c?", r"-?[1-9][0-9]{0,2}"])
def test_the_mask_allows_exactly_what_a_regex_engine_can_complete(char_engine, pattern):
    engine, tokenizer = char_engine
    params = gf.SamplingParams(temperature=1.0, seed=3, max_new_tokens=8, regex=pattern)
    row = engine.add(tokenizer.encode("12"), params)
    while not row.finished:
        text = tokenizer.decode(row.tokens)
        allowed = row.grammar.allowed()[: len(CHARS)]
        expected = [can_continue(pattern, text + c) for c in CHARS]
        assert allowed.tolist() == expected, text
        engine.step()
    assert re.fullmatch(pattern, tokenizer.decode(row.tokens))


def test_a_mask_that_allows_everything_changes_nothing(char_engine):
    """The masked step equals the unmasked one where the grammar allows every token: the same
    logits after the processors, so the same sampled tokens from the same seed."""
    engine, tokenizer = char_engine
    prompt = tokenizer.encode("3")
    kw = dict(max_new_tokens=20, temperature=1.0, top_k=8, seed=11, eos_token_id=NO_EOS)
    free = engine.generate(prompt, **kw)
    masked = engine.generate(prompt, regex=r"(?s:.*)", **kw)
    assert masked.token_ids == free.token_ids
    row = engine.add(prompt, gf.SamplingParams(regex=r"(?s:.*)", max_new_tokens=2))
    logits = torch.randn(1, len(CHARS))
    assert torch.equal(row.process(logits), logits)


def test_constrained_and_free_rows_decode_together(char_engine):
    """A batch of a constrained row and a free one: the free row's tokens are those it gets
    alone, and the constrained row matches its regex."""
    engine, tokenizer = char_engine
    prompt = tokenizer.encode("7")
    free = dict(max_new_tokens=12, temperature=1.0, seed=5, eos_token_id=NO_EOS)
    alone = engine.generate(prompt, **free).token_ids
    both = engine.add_many(
        [prompt, prompt],
        [gf.SamplingParams(**free), gf.SamplingParams(max_new_tokens=12, regex=r"[a-f]{4}")],
    )
    while not all(row.finished for row in both):
        engine.step()
    assert both[0].tokens == alone
    assert re.fullmatch(r"[a-f]{4}", tokenizer.decode(both[1].tokens))
    assert both[1].stop_reason == "stop"


def test_output_cut_by_the_token_budget_says_length(char_engine):
    engine, tokenizer = char_engine
    row = engine.generate(tokenizer.encode("1"), max_new_tokens=3, regex=r"[0-9]{10}")
    assert row.stats.stop_reason == "max_new_tokens"  # incomplete: never reported as "stop"


# --- bad constraints -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(json_schema={"type": "strin"}), "Invalid type: strin"),
        (dict(json_schema="{not json"), "not valid JSON"),
        (dict(json_schema=[1, 2]), "must be a JSON object"),
        (dict(json_schema={"type": "string", "format": "weird"}), "Unknown format: weird"),
        (dict(regex="[a-z"), "unclosed character class"),
        (dict(grammar="start: foo"), "does not compile"),
        (dict(regex="a", grammar='start: "a"'), "regex and grammar are both set"),
        (dict(regex=""), "non-empty string"),
        (dict(json_schema={"enum": ["x" * 100_001]}), "the limit is 100,000"),
    ],
)
def test_bad_constraints_are_one_line_errors_in_milliseconds(kwargs, message):
    start = time.perf_counter()
    with pytest.raises(ConstraintError, match=re.escape(message)) as caught:
        gf.SamplingParams(**kwargs)
    assert time.perf_counter() - start < 1.0
    assert "\n" not in str(caught.value)


def test_a_constraint_needs_the_engines_tokenizer():
    engine = gf.Engine(tiny_model())
    with pytest.raises(ValueError, match="tokenizer="):
        engine.add([1, 2], gf.SamplingParams(regex="[0-9]+"))


def test_params_with_a_schema_stay_hashable_and_equal():
    a = gf.SamplingParams(json_schema={"type": "object", "properties": {"b": {"type": "string"}}})
    b = gf.SamplingParams(json_schema='{"type": "object", "properties": {"b": {"type": "string"}}}')
    assert a == b and hash(a) == hash(b)
    assert a.constraint == constraint_from(a.json_schema)


# --- the CLI ------------------------------------------------------------------------------------

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_generate_json_schema_from_a_file_and_inline(tmp_path, capsys):
    from glassformer.cli import main

    schema_file = tmp_path / "city.json"
    schema_file.write_text(json.dumps(CITY))
    prompt = "The capital of France, as JSON: "
    common = ["generate", "--model", "smollm2", "--temperature", "0", "--max-new-tokens", "30"]
    for schema in (str(schema_file), json.dumps(CITY)):
        main([*common, "--json-schema", schema, prompt])
        reply = json.loads(capsys.readouterr().out.removeprefix(prompt))
        jsonschema.validate(reply, CITY)
    main([*common, "--regex", "(yes|no)", "Is Paris in France? Answer yes or no: "])
    assert capsys.readouterr().out.split(": ")[-1].strip() in ("yes", "no")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--regex", "[0-9"], "the regex does not compile"),
        (["--json-schema", "missing.json"], "neither a JSON object nor a file"),
        (["--grammar", "missing.lark"], "no grammar file 'missing.lark'"),
        (["--json-schema", '{"type": "strin"}'], "Invalid type: strin"),
        (["--regex", "a", "--json-schema", "{}"], "not allowed with argument"),
    ],
)
def test_generate_refuses_bad_constraints_in_one_line(flags, message, capsys):
    from glassformer.cli import main

    argparse_error = "compile" not in message and "strin" not in message  # refused by argparse
    with pytest.raises(SystemExit) if argparse_error else contextlib.nullcontext():
        assert main(["generate", "--model", "smollm2", *flags, "hi"]) == 2
    assert message in capsys.readouterr().err


def test_chat_replies_in_json_under_a_schema():
    import subprocess
    import sys

    command = [sys.executable, "-m", "glassformer", "chat", "--model", "smollm2", "--threads",
               "1", "--temperature", "0", "--max-new-tokens", "30", "--json-schema",
               json.dumps(CITY)]  # fmt: skip
    done = subprocess.run(
        command, input="Which city is the capital of France?\n/exit\n", capture_output=True,
        text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = re.search(r"\{.*\}", done.stdout, re.DOTALL)
    assert found, done.stdout
    jsonschema.validate(json.loads(found.group(0)), CITY)
