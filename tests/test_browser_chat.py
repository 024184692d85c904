"""The lab's chat view in a browser (issue 15): streaming, Stop, Enter to send, New conversation,
the cut-at-max-tokens mark and the prompt tokens the server reused, against a real
`glassformer serve --model smollm2` (the page opened by test_browser_lab.open_page). A reply
that ran on is seen from outside the page: /health's running_rows.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from processes import DEADLINE_S
from serving import start_server, stop_server
from test_browser_lab import open_page, screenshot_folder

LONG = "Count from 1 to 1000, separated by commas."  # at temperature 0 it runs to max tokens
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    process, url = start_server(["--model", "smollm2"])
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def smollm2_config():
    """The served model's config from its GGUF file's metadata, without loading the weights."""
    from glassformer.interop.gguf import config_from_gguf, read_gguf
    from glassformer.interop.pretrained import resolve

    return config_from_gguf(read_gguf(resolve("smollm2")))


@pytest.fixture(scope="module")
def page(server):
    with open_page(server) as page:
        page.fill("#chat-temperature", "0")
        yield page


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    return screenshot_folder(tmp_path_factory)


def _new_conversation(page) -> None:
    page.click("#chat-reset")
    assert page.query_selector_all("#chat-log .message") == []


def _send(page, text: str, max_tokens: int) -> None:
    page.fill("#chat-max-tokens", str(max_tokens))
    page.fill("#chat-input", text)
    page.click("#chat-send")


# How long a reply may take before the test calls it hung: the suite's deadline for a healthy
# process on a loaded machine (a 100-token JSON reply took over 30 s in CI's kernels-off run
# beside other work), not a speed target.
WAIT_MS = DEADLINE_S * 1000


def _wait_done(page, turn: int = 1) -> None:
    page.wait_for_selector(f".message.assistant:nth-of-type({2 * turn})[data-done=true]",
                           timeout=WAIT_MS)  # fmt: skip
    page.wait_for_selector(f"#chat-stats tbody tr:nth-child({turn})", timeout=WAIT_MS)


def _wait_streaming(page) -> None:
    page.wait_for_function(
        "() => { const text = document.querySelector('.message.assistant:last-child .text');"
        " return text && text.textContent.length > 0; }",
        timeout=WAIT_MS,
    )


def _running_rows(server: str) -> int:
    return httpx.get(f"{server}/health", timeout=5).json()["running_rows"]


def _seconds_until_idle(server: str, limit: float = 2.0) -> float:
    """Seconds until the server runs no row; fails past `limit`."""
    started = time.monotonic()
    while _running_rows(server):
        assert time.monotonic() - started < limit, f"a row still runs {limit} s later"
        time.sleep(0.05)
    return time.monotonic() - started


def _api_reply(server: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": "smollm2", "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    return httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()


def test_chat_streams_a_reply_and_reports_its_cost(page, server, smollm2_config, screenshots):
    _new_conversation(page)
    # Count the updates of the reply while it streams: one per SSE chunk, more than one.
    page.evaluate(
        """() => { window.replyUpdates = 0;
        new MutationObserver(() => { window.replyUpdates += 1; })
          .observe(document.querySelector('#chat-log'),
                   {subtree: true, childList: true, characterData: true}); }"""
    )
    _send(page, "Name a colour. One word.", 12)
    _wait_done(page)
    reply = page.inner_text(".message.assistant .text")
    assert reply.strip(), "the streamed reply is empty"
    assert page.evaluate("window.replyUpdates") > 3, "the reply arrived in one piece, not streamed"
    # The streamed text is the same as the non-streamed answer to the same request.
    answer = _api_reply(server, [{"role": "user", "content": "Name a colour. One word."}], 12)
    assert reply == answer["choices"][0]["message"]["content"]
    cut = answer["choices"][0]["finish_reason"] == "length"
    assert (page.query_selector(".message.assistant .mark.length") is not None) == cut
    # KV bytes of the turn: (prompt + completion) tokens x the model's bytes per token (calc).
    from glassformer.calc import kv_cache_bytes

    row = page.query_selector("#chat-stats tbody tr")
    assert float(row.get_attribute("data-ttft")) > 0
    usage = answer["usage"]
    tokens = usage["prompt_tokens"] + usage["completion_tokens"]
    expected = kv_cache_bytes(smollm2_config, tokens, "fp32")
    assert int(row.get_attribute("data-kv-bytes")) == expected
    page.screenshot(path=str(screenshots / "chat.png"))


def test_enter_sends_and_shift_enter_breaks_the_line(page):
    _new_conversation(page)
    page.fill("#chat-max-tokens", "2")
    page.fill("#chat-input", "")
    page.click("#chat-input")
    page.keyboard.type("Say hi")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("in French")
    assert page.input_value("#chat-input") == "Say hi\nin French"
    assert page.query_selector_all("#chat-log .message") == []
    page.keyboard.press("Enter")
    page.wait_for_selector(".message.user")
    assert page.inner_text(".message.user") == "Say hi\nin French"
    assert page.input_value("#chat-input") == ""
    _wait_done(page)


def test_stop_ends_the_reply_on_the_server(page, server):
    """Stop aborts the stream; the server drops the row at once, not after max_tokens."""
    _new_conversation(page)
    _send(page, LONG, 1024)
    _wait_streaming(page)
    assert _running_rows(server) == 1
    assert page.is_enabled("#chat-stop") and not page.is_enabled("#chat-send")
    page.click("#chat-stop")
    _seconds_until_idle(server)
    page.wait_for_selector(".message.assistant .mark.stopped")
    assert page.inner_text(".message.assistant .text")  # what came before Stop stays
    assert page.is_enabled("#chat-send") and not page.is_enabled("#chat-stop")


def test_new_conversation_drops_the_running_reply(page, server):
    """New conversation mid-reply: the server stops that row, and the next request sends the
    new message alone, without the old turn's user or assistant message."""
    _new_conversation(page)
    _send(page, LONG, 1024)
    _wait_streaming(page)
    _new_conversation(page)
    _seconds_until_idle(server)
    page.wait_for_function("() => !document.querySelector('#chat-send').disabled")
    with page.expect_request("**/v1/chat/completions") as request:
        _send(page, "Say hi.", 2)
    assert request.value.post_data_json["messages"] == [{"role": "user", "content": "Say hi."}]
    _wait_done(page)
    assert len(page.query_selector_all("#chat-log .message")) == 2


def test_a_reply_cut_at_max_tokens_is_marked(page, server):
    _new_conversation(page)
    _send(page, LONG, 3)
    _wait_done(page)
    answer = _api_reply(server, [{"role": "user", "content": LONG}], 3)
    assert answer["choices"][0]["finish_reason"] == "length"
    mark = page.query_selector(".message.assistant .mark.length")
    assert mark is not None and mark.is_visible()
    assert "max tokens (3)" in mark.inner_text()


def _stream_usage(response) -> dict:
    """The usage chunk of a finished server-sent-event response."""
    events = [line[5:].strip() for line in response.text().splitlines() if line.startswith("data:")]
    return [json.loads(e) for e in events if e != "[DONE]" and '"usage": {' in e][-1]["usage"]


def test_second_turn_shows_the_prompt_tokens_the_server_reused(page):
    """Turn 2 re-sends turn 1: the server continues turn 1's parked row, so its usage says
    cached_tokens > 0 (at least turn 1's prompt), and the table shows that number."""
    _new_conversation(page)
    usages = []
    for turn, text in enumerate(("Name a fruit. One word.", "And a vegetable?"), start=1):
        with page.expect_response("**/v1/chat/completions") as response:
            _send(page, text, 6)
        _wait_done(page, turn)
        usages.append(_stream_usage(response.value))
    rows = page.query_selector_all("#chat-stats tbody tr")
    shown = [int(row.get_attribute("data-cached-prompt-tokens")) for row in rows]
    cached = [usage["prompt_tokens_details"]["cached_tokens"] for usage in usages]
    assert shown == cached
    assert usages[0]["prompt_tokens"] <= cached[1] < usages[1]["prompt_tokens"]
    assert f"{cached[1]} of {usages[1]['prompt_tokens']}" in rows[1].inner_text()


def test_a_json_mode_reply_is_json(page, server):
    """The reply format under the message: JSON object, then a schema typed in; each reply
    parses, and the schema's is valid under it (jsonschema)."""
    import jsonschema

    _new_conversation(page)
    page.select_option("#chat-format", "json_object")
    assert page.is_hidden("#chat-schema")
    _send(page, "Give the name and age of a cat.", 100)
    _wait_done(page)
    assert isinstance(json.loads(page.inner_text(".message.assistant .text")), dict)
    assert page.query_selector(".message.assistant .mark.json") is not None
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}  # fmt: skip
    page.select_option("#chat-format", "json_schema")
    page.fill("#chat-schema", json.dumps(schema))
    _send(page, "Pick a colour.", 40)
    _wait_done(page, turn=2)
    jsonschema.validate(
        json.loads(page.inner_text(".message.assistant:nth-of-type(4) .text")), schema
    )
    page.select_option("#chat-format", "text")
