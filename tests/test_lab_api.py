"""The browser lab's JSON endpoints (server/lab.py) as the page sees them, on a real `glassformer
serve` process: a capture of the served model taken while eight chat streams decode is the
capture of the idle server, and leaves the streams' texts alone; every lab endpoint has /v1's
limits and error object; no NaN or inf reaches the page; attention says which tokens are [UNK]
or byte pieces; a draw reports its probability. References: the eager forward in this process
(inspect.attention_view, the model's logits), numpy_ref, the tokenizers themselves, the
official openai client run one request at a time.

The generation model is test_server's tiny random Llama with SmolLM2's tokenizer (byte-level
BPE: Chinese comes in byte pieces); the embedding model is the real all-MiniLM-L6-v2 (WordPiece,
with [UNK]).
"""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
import torch
from serving import start_server, stop_server
from test_server import tiny_chat_model
from test_server_scheduler import make_scheduler, tiny_model

from glassformer import numpy_ref
from glassformer.infer.sampling import SamplingParams, make_generator, sample, sampling_distribution
from glassformer.inspect import attention_view
from glassformer.interop.pretrained import from_pretrained
from glassformer.server.lab_edge import finite, first_non_finite, on_engine_thread
from glassformer.server.protocol import APIError
from glassformer.tokenize import load_tokenizer

N_STREAMS = 8
STREAM_TOKENS = 160  # long enough that many captures overlap the decode steps
CONTEXT = 200  # --max-seq-len: the served context, shorter than the model's own 256 (as
# SmolLM2 is served with 2,048 of its 8,192)
CAPTURE_TEXT = "The animal didn't cross the street because it was too tired, so it slept."
CHINESE = "猫累了，所以它在窗边睡着了。The cat was tired."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("tiny") / "tinychat")


@pytest.fixture(scope="module")
def server(model_dir):
    args = ["--model", str(model_dir), "--embed-model", "minilm", "--max-batch", str(N_STREAMS),
            "--max-seq-len", str(CONTEXT)]  # fmt: skip
    process, url = start_server(args)
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The served model and tokenizer, loaded in this process."""
    return from_pretrained(model_dir)


def lab(url: str, endpoint: str, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/lab/api/{endpoint}", json=body, timeout=60, **kwargs)


def capture(url: str) -> dict:
    response = lab(url, "attention", {"text": CAPTURE_TEXT, "which": "model"})
    assert response.status_code == 200, response.text
    return response.json()


def assert_openai_error(response: httpx.Response, param: str, code: str | None = None) -> dict:
    """A 400 with /v1's error object (not FastAPI's 422 {"detail"}) naming `param`."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# --- isolation: a capture of the served model sees only its own text ------------------------


def test_capture_during_eight_streams_equals_the_idle_capture_and_leaves_them_alone(
    server, reference
):
    model, tokenizer = reference
    idle = capture(server)
    # The idle capture is the eager forward's (inspect.attention_view here, in this process).
    view = attention_view(model, tokenizer, CAPTURE_TEXT, max_tokens=64)
    assert idle["tokens"] == view.query_tokens
    expected = torch.stack(view.weights).numpy().astype(np.float64)
    np.testing.assert_allclose(np.array(idle["weights"]), expected, atol=2e-5)

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)

    def chat(i: int, stream: bool):
        return client.chat.completions.create(
            model="tinychat", messages=[{"role": "user", "content": f"Story number {i}:"}],
            temperature=0, max_tokens=STREAM_TOKENS, stream=stream,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    alone = [chat(i, stream=False).choices[0].message.content for i in range(N_STREAMS)]

    texts: list[list[str]] = [[] for _ in range(N_STREAMS)]
    started = threading.Barrier(N_STREAMS + 1)
    finished = [threading.Event() for _ in range(N_STREAMS)]

    def run(i: int) -> None:
        try:
            first = True
            for chunk in chat(i, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    texts[i].append(chunk.choices[0].delta.content)
                    if first:
                        first = False
                        started.wait(timeout=60)
        finally:
            finished[i].set()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(N_STREAMS)]
    for thread in threads:
        thread.start()
    started.wait(timeout=60)  # every stream is decoding
    during = []

    def take() -> None:  # three at once: more captures land between the streams' steps
        while not any(event.is_set() for event in finished):
            taken = capture(server)
            if not any(event.is_set() for event in finished):  # all eight decoding throughout
                during.append(taken)

    takers = [threading.Thread(target=take) for _ in range(3)]
    for thread in takers:
        thread.start()
    for thread in [*takers, *threads]:
        thread.join(timeout=120)
    assert len(during) >= 5, f"only {len(during)} captures overlapped the streams"
    for taken in during:
        assert taken["tokens"] == idle["tokens"]
        assert taken["weights"] == idle["weights"]  # exactly: no other row's step landed in it
    assert ["".join(t) for t in texts] == alone


def test_lab_work_runs_on_the_engine_thread_and_a_stopped_engine_is_a_503():
    scheduler = make_scheduler(tiny_model())
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(scheduler=scheduler)))
    scheduler.start()
    where = asyncio.run(on_engine_thread(request, lambda: threading.current_thread().name))
    assert where == scheduler.thread.name
    scheduler.stop()
    with pytest.raises(APIError) as caught:
        asyncio.run(on_engine_thread(request, lambda: None))
    error = caught.value
    assert (error.status, error.kind, error.code) == (503, "server_error", "engine_stopped")


# --- limits and dialect: /v1's context and error object --------------------------------------


def test_lab_limits_and_errors_are_v1s(server, reference):
    _, tokenizer = reference
    prompt = "word " * 200
    n_tokens = len(tokenizer.encode_chat([{"role": "user", "content": prompt}]))
    assert CONTEXT < n_tokens < 256  # past the served context, within the model's own
    for endpoint in ("next_tokens", "sample"):
        error = assert_openai_error(
            lab(server, endpoint, {"prompt": prompt}), "prompt", "context_length_exceeded"
        )
        assert f"{n_tokens} tokens" in error["message"], error
        assert f"the context is {CONTEXT}" in error["message"], error
    # A 512-token MiniLM reads no more; its own tokenizer counts the text.
    long_text = "a." * 600  # 1,200 characters, a token each
    n_minilm = len(load_tokenizer("minilm").encode(long_text))
    error = assert_openai_error(
        lab(server, "attention", {"text": long_text, "which": "embed_model"}),
        "text",
        "context_length_exceeded",
    )
    assert f"{n_minilm} tokens" in error["message"] and "512" in error["message"]
    turn = {"messages": [{"role": "user", "content": "hi"}], "completion_tokens": 1000}
    assert_openai_error(lab(server, "turn_cost", turn), "completion_tokens")
    # Request validation: a 400 naming the field, as /v1's, never FastAPI's 422 {"detail"}.
    assert_openai_error(lab(server, "next_tokens", {"prompt": "hi", "temperature": "hot"}),
                        "temperature", "invalid_value")  # fmt: skip
    assert_openai_error(lab(server, "next_tokens", {"prompt": "hi", "bogus": 1}), "bogus",
                        "unsupported_field")  # fmt: skip
    assert_openai_error(lab(server, "tokenize", {}), "text", "missing_field")
    assert_openai_error(lab(server, "attention", {"text": "hi", "which": "nope"}), "which")
    assert_openai_error(lab(server, "next_tokens", {"prompt": "hi", "top_p": 0}), "top_p")
    broken = httpx.post(f"{server}/lab/api/tokenize", content=b"{not json", timeout=10)
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"
    # A route that does not exist, or the wrong method, speaks the same dialect.
    for response in (httpx.post(f"{server}/lab/api/nope", json={}, timeout=10),
                     httpx.get(f"{server}/lab/api/tokenize", timeout=10)):  # fmt: skip
        assert response.status_code in (404, 405) and set(response.json()) == {"error"}


# --- no NaN or inf reaches the page ---------------------------------------------------------


def test_worked_example_refuses_overflowing_numbers_and_names_them(server):
    q, K, V = (a.tolist() for a in numpy_ref.worked_example_vectors())
    huge = {"q": [1e308, q[1], q[2], 1e308], "K": K, "V": V}  # 1.1e308 + 0.9e308 = inf
    with np.errstate(over="ignore", invalid="ignore"):  # numpy_ref itself: no finite answer
        reference = numpy_ref.attention(np.array(huge["q"])[None], np.array(K), np.array(V))
    assert not np.isfinite(reference.weights).all()
    error = assert_openai_error(lab(server, "worked_example", huge), "q.0", "non_finite_result")
    assert error["message"].startswith("q[0]=1e+308 makes the scores overflow")
    # The Key can be the culprit, and key_scale too.
    big_key = {"q": q, "K": [[1e308, K[0][1], K[0][2], 1e308], *K[1:]], "V": V}
    assert_openai_error(lab(server, "worked_example", big_key), "K.0.0", "non_finite_result")
    scaled = {"q": q, "K": K, "V": V, "key_scale": 1e308}
    assert_openai_error(lab(server, "worked_example", scaled), "key_scale")
    # Non-finite inputs (JSON's NaN, 1e999 read as inf) are refused by name before computing.
    for raw in ("NaN", "1e999"):
        body = json.dumps({"q": [0.0, *q[1:]], "K": K, "V": V}).replace("0.0", raw, 1)
        response = httpx.post(f"{server}/lab/api/worked_example", content=body, timeout=10)
        assert_openai_error(response, "q.0", "invalid_value")
    # Large but finite: the page gets numpy_ref's own numbers.
    edge = {"q": [1e150, *q[1:]], "K": K, "V": V}
    answer = lab(server, "worked_example", edge)
    assert answer.status_code == 200, answer.text
    expected = numpy_ref.attention(np.array(edge["q"])[None], np.array(K), np.array(V))
    np.testing.assert_allclose(answer.json()["weights"], expected.weights[0])
    np.testing.assert_allclose(answer.json()["output"], expected.output[0])


def test_a_non_finite_answer_is_never_sent():
    payload = {"weights": [[0.5, 0.5], [1.0, float("nan")]], "scale": 1.0}
    assert first_non_finite(payload) == ("weights[1][1]", payload["weights"][1][1])
    with pytest.raises(APIError, match=r"weights\[1\]\[1\] came out nan") as caught:
        finite(payload)
    assert caught.value.status == 500
    assert finite({"x": [1.0, 2]}) == {"x": [1.0, 2]}


# --- what the attention explorer's tokens are ----------------------------------------------


def test_attention_marks_unknown_and_byte_pieces_as_the_tokenizers_cut_them(server, reference):
    minilm = load_tokenizer("minilm")
    data = lab(server, "attention", {"text": CHINESE, "which": "embed_model"}).json()
    unk = minilm.token_to_id("[UNK]")
    ids = minilm.encode(CHINESE)
    assert data["token_kinds"] == ["unk" if i == unk else "token" for i in ids]
    unknown = [c for c in CHINESE if minilm.encode(c, add_special_tokens=False) == [unk]]
    assert unknown, "the test text should have characters MiniLM lacks"
    chars = sum(not c.isspace() for c in CHINESE)
    assert data["note"].startswith(f"{len(unknown)} of {chars} characters are [UNK] in minilm")

    _, smollm2 = reference  # SmolLM2's byte-level BPE
    data = lab(server, "attention", {"text": CHINESE, "which": "model"}).json()
    ids = smollm2.encode(CHINESE)
    kinds = ["byte" if "\ufffd" in smollm2.decode([i]) else "token" for i in ids]
    assert "byte" in kinds and data["token_kinds"] == kinds
    assert len(data["token_kinds"]) == len(data["tokens"])
    assert "splits these characters into byte pieces" in data["note"]
    english = lab(server, "attention", {"text": CAPTURE_TEXT, "which": "embed_model"}).json()
    assert set(english["token_kinds"]) == {"token"} and english["note"] is None


# --- the sampling view's draw ------------------------------------------------------------------


def test_sample_returns_the_drawn_token_and_its_probability(server, reference):
    model, tokenizer = reference
    body = {"prompt": "Once upon a time", "temperature": 1.3, "top_k": 40, "seed": 7}
    drawn = lab(server, "sample", body).json()
    ids = tokenizer.encode_chat([{"role": "user", "content": body["prompt"]}])
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, -1].float()  # the eager forward, here
    params = SamplingParams(temperature=1.3, top_k=40, seed=7)
    probs = sampling_distribution(logits[None], params)[0]
    assert drawn["id"] == int(sample(logits[None], params, make_generator(7))[0])
    assert drawn["prob"] == pytest.approx(float(probs[drawn["id"]]), rel=1e-5)
    assert drawn["model_prob"] == pytest.approx(
        float(torch.softmax(logits, -1)[drawn["id"]]), rel=1e-5
    )
    text = tokenizer.decode([drawn["id"]])  # a piece of a character is shown as hex bytes
    assert drawn["piece"] == text if "\ufffd" not in text else drawn["piece"].startswith("<")
    # The candidate list (the 50 likeliest, so every one of top_k=40) shows the same number.
    shown = lab(server, "next_tokens", {**body, "k": 50}).json()["candidates"]
    assert {c["id"]: c["prob"] for c in shown}[drawn["id"]] == drawn["prob"]
