"""Hostile inputs that used to end in a traceback, a wrong exit code or gigabytes of memory: bad
serve flags and addresses, chat templates that fail, nest 5,000 deep or double a string sixty
times, and a tokenizer.json whose regex gives up on a text (a Rust panic).

References: the exit code and stderr of a real `glassformer serve` process, jinja2's own
sandbox for what benign templates render, tracemalloc's peak for the memory a template takes,
and a socket bound right after serve's address check."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from test_server import tiny_chat_model
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

import glassformer as gf
from glassformer import templates
from glassformer.chat import ChatSession, run_chat
from glassformer.cli import main
from glassformer.cli.serve import check_address, check_cache_fits
from glassformer.interop.gguf import read_gguf, tokenizer_from_gguf
from glassformer.interop.pretrained import resolve
from glassformer.server.gate import resolve_api_key
from glassformer.tokenizers import PretrainedTokenizer, load_tokenizer
from glassformer.tokenizers.guards import TokenizerRegexError, panic_reports_hidden

MESSAGES = [{"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def smol() -> PretrainedTokenizer:
    return tokenizer_from_gguf(read_gguf(resolve("smollm2")))


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "glassformer", *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def assert_one_error_line(result: subprocess.CompletedProcess, *parts: str) -> str:
    assert "Traceback" not in result.stderr
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for part in parts:
        assert part in lines[0]
    return lines[0]


# --- serve: flags and addresses -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "-1"], "argument --port: -1 is not a port: give one in 1..65535"),
        (["--port", "70000"], "argument --port: 70000 is not a port"),
        (["--port", "0"], "argument --port: 0 is not a port"),
        (["--prefix-cache-mb", "-1"], "argument --prefix-cache-mb: -1 must be >= 0"),
        (["--prompt-store-mb", "-1"], "argument --prompt-store-mb: -1 must be >= 0"),
        (["--max-batch", "0"], "argument --max-batch: 0 must be >= 1"),
        (["--request-timeout", "-1"], "argument --request-timeout: -1 must be a finite number"),
        (["--request-timeout", "nan"], "argument --request-timeout: nan must be a finite number"),
        (["--request-timeout", "10m"], "argument --request-timeout: '10m' is not a number of"),
        (["--threads", "100000"], "argument --threads: 100000 threads is more than 1024"),
    ],
)
def test_bad_serve_flags_exit_2_naming_the_value(capsys, flags, message):
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--model", "nowhere", *flags])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_serve_api_key_errors_are_one_line_naming_the_source(capsys, tmp_path, monkeypatch):
    empty, blank = tmp_path / "empty", tmp_path / "blank"
    empty.write_text("")
    blank.write_text("  \n\n")
    cases = [
        (["--api-key", " "], {}, "--api-key is empty"),
        (["--api-key-file", str(tmp_path / "absent")], {}, "cannot be read (No such file"),
        (["--api-key-file", str(tmp_path)], {}, "cannot be read (Is a directory)"),
        (["--api-key-file", str(empty)], {}, "is empty: write the key on its first line"),
        (["--api-key-file", str(blank)], {}, "is empty"),
        (["--api-key", "k", "--api-key-file", str(empty)], {}, "both set: give one of them"),
        ([], {"GLASSFORMER_API_KEY": ""}, "GLASSFORMER_API_KEY is set but empty"),
    ]
    for flags, environ, message in cases:
        monkeypatch.delenv("GLASSFORMER_API_KEY", raising=False)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        assert main(["serve", "--model", "nowhere", *flags]) == 2, flags
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_the_api_key_comes_from_the_flag_the_file_or_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    environ = {"GLASSFORMER_API_KEY": " from-env\n"}
    assert resolve_api_key("from-flag", None, environ) == "from-flag"
    assert resolve_api_key(None, str(key_file), environ) == "from-file"
    assert resolve_api_key(None, None, environ) == "from-env"
    assert resolve_api_key(None, None, {}) is None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("\udcff\udcfe", "--host '\\udcff\\udcfe' is not an address this machine can bind"),
        ("999.1.1.1", "--host '999.1.1.1' is not an address this machine can bind"),
    ],
)
def test_serve_on_a_host_it_cannot_bind_is_one_line(host, message):
    # The check runs before the model loads: the model need not exist.
    result = run_cli("serve", "--model", "nowhere", "--host", host, "--port", "8123")
    assert_one_error_line(result, message, "e.g. 127.0.0.1")


@pytest.mark.slow
def test_serve_on_a_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("serve", "--model", "nowhere", "--port", str(port))
    assert_one_error_line(result, f"port {port} on 127.0.0.1 is in use", "pick another --port")


def test_the_address_check_leaves_the_port_free():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_address("127.0.0.1", port)
    with socket.socket() as server:  # no SO_REUSEADDR: fails if the check left the port held
        server.bind(("127.0.0.1", port))
        server.listen()


def test_a_max_batch_whose_cache_cannot_fit_is_refused_before_allocating():
    cfg = gf.ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=256)
    model = gf.build_model(cfg)
    check_cache_fits(model, max_rows=16, slot_len=256, max_batch=8)  # 256 KiB: fits
    with pytest.raises(ValueError, match="--max-batch 100000000 reserves a cache of 200,000,000"):
        check_cache_fits(model, max_rows=2 * 10**8, slot_len=256, max_batch=10**8)


# --- chat: a template that fails ends the chat with exit 2 --------------------------------------

FAILING_TEMPLATES = {
    "type error": "{% for m in messages %}{{ m.content + 1 }}{% endfor %}",
    "raise_exception": "{{ raise_exception('roles must alternate') }}",
    "syntax": "{% for %}",
    "undefined call": "{{ nothing() }}",
    "too big": "{{ 'x' * 10**10 }}",
    "too deep": "{% if 1 %}" * 5000 + "x" + "{% endif %}" * 5000,
}


@pytest.fixture(scope="module")
def failing_models(tmp_path_factory, smol) -> dict[str, Path]:
    folders = {}
    for name, source in FAILING_TEMPLATES.items():
        tokenizer = PretrainedTokenizer(smol.hf, eos_token=smol.eos_token, chat_template=source)
        folders[name] = tiny_chat_model(tmp_path_factory.mktemp("chat") / "m", tokenizer)
    return folders


@pytest.mark.parametrize("name", FAILING_TEMPLATES)
def test_chat_with_a_failing_template_exits_2_with_one_line(
    capsys, monkeypatch, failing_models, name
):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nhello again\n"))
    code = main(["chat", "--model", str(failing_models[name]), "--threads", "1",
                 "--max-new-tokens", "1"])  # fmt: skip
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert code == 2
    assert len(errors) == 1 and "chat template" in errors[0]  # the second line is never read
    assert "Traceback" not in err


class _Engine:
    max_seq_len = 2048
    max_rows = 1


def test_a_refused_message_keeps_the_chat_going(capsys, smol):
    session = ChatSession(_Engine(), smol)
    lines = iter(["a\udc80b", "/exit"])  # a lone surrogate: this message's fault, not the model's
    run_chat(session, read=lambda _: next(lines))
    assert "error: text has a lone surrogate" in capsys.readouterr().err


# --- templates that nest too deeply -------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("{% if 1 %}" * 5000 + "x" + "{% endif %}" * 5000, "deeper than Python's recursion limit"),
        ("{% if 1 %}" * 150 + "x" + "{% endif %}" * 150, "too many levels of indentation"),
        ("{% for i in [1] %}" * 25 + "x" + "{% endfor %}" * 25, "too many statically nested"),
        ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "deeper than Python's recursion limit"),
    ],
)
def test_a_template_nested_too_deeply_is_one_error(source, reason):
    with pytest.raises(templates.ChatTemplateError, match="nests its blocks too deeply") as caught:
        templates.render(source, messages=MESSAGES)
    assert reason in str(caught.value) and "\n" not in str(caught.value)


def test_a_template_nested_90_deep_still_renders():
    assert templates.render("{% if 1 %}" * 90 + "x" + "{% endif %}" * 90) == "x"


# --- templates that grow a value past any prompt ------------------------------------------------


def _doubling(step: str, start: str = "'ab'") -> str:
    return (
        f"{{% set ns = namespace(s={start}) %}}{{% for i in range(60) %}}"
        f"{{% set ns.s = {step} %}}{{% endfor %}}{{{{ ns.s|length }}}}"
    )


MEMORY_BOMBS = {
    "~ doubling": _doubling("ns.s ~ ns.s"),
    "+ doubling": _doubling("ns.s + ns.s"),
    "list + doubling": _doubling("ns.s + ns.s", start="[1]"),
    "list * doubling": _doubling("ns.s * 2", start="[1]"),
    "|replace": "{{ ('a' * 100000)|replace('a', 'b' * 100000) }}",
    "|replace doubling": _doubling("ns.s|replace('a', ns.s)"),
    "|join": "{{ range(1000)|map('center', 100000)|join }}",
    "|join separator": "{% set s = 'x' * 100000 %}{{ (range(100000)|list)|join(s) }}",
    ".replace()": _doubling("ns.s.replace('a', ns.s)"),
    ".join()": _doubling("ns.s.join([ns.s, ns.s])"),
    ".center()": _doubling("ns.s.center(ns.s|length * 2)"),
    ".translate()": "{{ ('a' * 100000).translate({97: 'b' * 100000}) }}",
    ".expandtabs()": "{{ ('\t' * 100000).expandtabs(1000000) }}",
    "|format width": "{{ '%999999999s'|format('x') }}",
    "% width": "{{ '%999999999s' % 'x' }}",
    "% star width": "{{ '%*s' % (999999999, 'x') }}",
    "% precision": "{{ '%.999999999f' % 1.5 }}",
    "str.format width": '{{ "{:>999999999}".format("x") }}',
    "format_map width": '{{ "{x:>999999999}".format_map({"x": 1}) }}',
    "|indent": "{{ ('a\n' * 100000)|indent(1000000) }}",
    "|wordwrap": "{{ ('a ' * 100000)|wordwrap(1, wrapstring='x' * 100000) }}",
    "|tojson indent": "{{ ([[[[[1]]]]] * 1000)|tojson(indent=1000000) }}",
    "|map then |list": "{{ (range(100000)|map('center', 500000)|list)|length }}",
    "set block": _doubling("ns.s").replace(
        "{% set ns.s = ns.s %}", "{% set x %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = x %}"
    ),
    "macro": "{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}" + _doubling("d(ns.s)"),
    "filter block": "{% filter lower %}{% for i in range(1000) %}{{ 'X' * 100000 }}{% endfor %}"
    "{% endfilter %}",
    "self.block()": "{% if false %}{% block b %}{% for i in range(1000) %}{{ 'x' * 100000 }}"
    "{% endfor %}{% endblock %}{% endif %}{{ self.b()|length }}",
    "int squaring": _doubling("ns.s * ns.s", start="3"),
    "power of a power": _doubling("ns.s ** 999", start="10"),
    "dict.fromkeys": "{{ {}.fromkeys(range(100000), 'x' * 1000000)|length }}",
}


@pytest.mark.parametrize("name", MEMORY_BOMBS)
def test_a_growing_template_is_refused_within_bounded_memory(name):
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(templates.ChatTemplateError) as caught:
            templates.render(MEMORY_BOMBS[name], seconds=1.0, messages=MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20  # doubling unchecked reaches 3.5 GB before any time limit
    assert time.monotonic() - started < 1.5
    message = str(caught.value)
    assert "ran for more than" not in message  # sized, not stopped by the clock
    assert "1,000,000 characters" in message or "14,300 bits" in message or "power" in message


def test_lipsum_is_not_offered():
    with pytest.raises(templates.ChatTemplateError, match="'lipsum' is undefined"):
        templates.render("{{ lipsum(10**8) }}")


# Every operation the sizing wraps, at benign sizes, inside a loop (where jinja passes extra
# keywords to calls) and outside it.
BENIGN = """{%- macro turn(role, text) -%}<|{{ role }}|>{{ text|trim }}<|end|>{%- endmacro -%}
{%- set ns = namespace(n=0, names=[], seen='') -%}
{%- for m in messages -%}
  {%- set ns.n = ns.n + 1 -%}
  {%- set ns.names = ns.names + [m.role] -%}
  {%- set ns.seen = ns.seen ~ m.role[0] -%}
  {{ turn(m.role, m.content) }}
  {{- '%s:%-6s|%3d' % (loop.index, m.role, m.content|length) }}
  {{- '{}-{:>8}'.format(loop.index0, m.role) }}{{ '{r}'.format_map({'r': m.role}) }}
  {{- m.content.replace('o', '0').center(30, '.').split('.')|join('_') }}
  {{- m.content|replace('e', 'E')|indent(2, first=True)|wordwrap(8) }}
  {{- '|'.join(m.content.split()) }}{{ m.content.zfill(3)|upper }}{{ '\tx'.expandtabs(4) }}
  {{- '%5.2f'|format(loop.index / 3) }}{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ m.content|tojson }}
  {{- m.content.translate({101: 'EE'}) }}{{ m.content.ljust(20, '-') }}{{ m.content.rjust(4) }}
  {%- set block %}[{{ m.role|title }}]{% endset %}{{ block }}
  {%- filter upper %}{{ m.content }}{% endfilter %}
{%- endfor -%}
{{ ns.n }} {{ ns.names|join(',') }} {{ ns.seen }} {{ messages|map(attribute='role')|list }}
{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join('; ') }}
{{ tools|tojson(indent=2) }}{{ (messages * 2)|length }}{{ (messages + messages)|length }}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there!  How are you?\n"},
    {"role": "assistant", "content": " Fine, 谢谢 🙂"},
    {"role": "user", "content": "What's 2+2?"},
]
TOOLS = [{"name": "add", "parameters": {"a": {"type": "int"}, "b": {"type": ["int", None]}}}]


def test_benign_templates_render_as_jinjas_own_sandbox():
    reference = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    variables = {"messages": CONVERSATION, "tools": TOOLS, "add_generation_prompt": True}
    expected = reference.from_string(BENIGN).render(**variables)
    assert templates.render(BENIGN, **variables) == expected
    assert "<|user|>Hello there!  How are you?<|end|>" in expected  # it rendered something real


def test_a_prompt_just_under_the_limit_still_renders():
    source = "{{ ('x' * 499999) ~ ('y' * 499999) }}{{ 'z' * 2 }}"
    assert len(templates.render(source)) == templates.MAX_OUTPUT_CHARS


# --- a tokenizer.json whose regex gives up: a Rust panic -------------------------------------


@pytest.fixture(scope="module")
def backtracking_tokenizer(tmp_path_factory) -> Path:
    """A tokenizer.json whose Split pre-tokenizer is (a+)+$, which backtracks without end on
    "aaa...ab": the Rust side's regex engine gives up and panics (pyo3's PanicException, a
    BaseException)."""
    hf = HFTokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("(a+)+$"), behavior="isolated")
    folder = tmp_path_factory.mktemp("backtracking")
    hf.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text('{"model_type": "llama"}')  # a Hugging Face folder
    return folder


HOSTILE_TEXT = "a" * 64 + "b"


def test_the_backtracking_regex_panics_in_the_rust_tokenizer(backtracking_tokenizer):
    # The reference: the tokenizers package itself, raising what `except Exception` misses.
    hf = HFTokenizer.from_file(str(backtracking_tokenizer / "tokenizer.json"))
    with pytest.raises(BaseException) as caught:
        hf.encode(HOSTILE_TEXT)
    assert type(caught.value).__name__ == "PanicException"
    assert not isinstance(caught.value, Exception)


@pytest.mark.parametrize("loader", ["from_folder", "load_tokenizer"])
def test_a_panicking_tokenizer_is_one_error_naming_the_file(backtracking_tokenizer, loader):
    folder = backtracking_tokenizer
    tokenizer = (
        PretrainedTokenizer.from_folder(folder)
        if loader == "from_folder"
        else load_tokenizer(folder)
    )
    with pytest.raises(TokenizerRegexError) as caught:
        tokenizer.encode(HOSTILE_TEXT)
    message = str(caught.value)
    assert message.startswith(f"{folder / 'tokenizer.json'}: the tokenizer's pre-tokenizer")
    assert "broken or hostile; use another model file" in message and "\n" not in message
    assert tokenizer.encode("ab") == [2]  # the file still encodes text its regex can handle


def test_a_panicking_tokenizer_as_plain_text_is_the_same_error(backtracking_tokenizer):
    tokenizer = PretrainedTokenizer.from_folder(backtracking_tokenizer)
    with pytest.raises(TokenizerRegexError):
        tokenizer.encode(HOSTILE_TEXT, parse_special=False)


def test_only_the_rust_panic_report_is_kept_off_stderr(backtracking_tokenizer, capfd):
    tokenizer = PretrainedTokenizer.from_folder(backtracking_tokenizer)
    with pytest.raises(TokenizerRegexError):
        tokenizer.encode(HOSTILE_TEXT)
    # The reference: Rust's panic hook writes its report to file descriptor 2 itself.
    assert " panicked at " in capfd.readouterr().err
    with pytest.raises(TokenizerRegexError), panic_reports_hidden():
        os.write(2, b"written before\n")
        tokenizer.encode(HOSTILE_TEXT)
    with panic_reports_hidden():
        print("written after", file=sys.stderr)
    assert capfd.readouterr().err == "written before\nwritten after\n"


@pytest.mark.slow
@pytest.mark.parametrize("backtrace", ["0", "full"])
def test_tokenize_with_a_panicking_tokenizer_is_one_error_line(
    backtracking_tokenizer, monkeypatch, backtrace
):
    # Rust's report: a blank line, where it panicked, the message and a note (RUST_BACKTRACE
    # unset or 0), or those and a backtrace of 50 frames (full); none of it reaches the terminal.
    monkeypatch.setenv("RUST_BACKTRACE", backtrace)
    result = run_cli("tokenize", "--model", str(backtracking_tokenizer), HOSTILE_TEXT)
    line = assert_one_error_line(result, "use another model file")
    assert line.startswith(f"error: {backtracking_tokenizer / 'tokenizer.json'}: the tokenizer's")
    assert "(Onig: Regex search error: retry-limit-in-match over)" in line
