"""RAG in the server (serve --rag-store): /rag/search for scripts, /lab/api/rag's two
conversations answered through /v1 by the official openai client, 4xx for bad requests while
the server keeps serving, and the lab's RAG view in Debian's chromium."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from serving import start_server, stop_server
from test_browser_lab import open_page
from test_rag import FACTS

from glassformer.data.corpus import shakespeare_works
from glassformer.rag import Encoder, Store, index_sources

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of Zorbania?"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    docs = tmp_path_factory.mktemp("docs")
    for name, text in FACTS.items():
        (docs / name).write_text(text)
    (docs / "hamlet.txt").write_text(shakespeare_works("modern")["hamlet"][20_000:30_000])
    path = tmp_path_factory.mktemp("stores") / "kb"
    index_sources([str(docs)], str(path), Encoder.load("minilm"), chunk_tokens=64, overlap=16)
    return path


@pytest.fixture(scope="module")
def server(store):
    """`glassformer serve --model smollm2 --rag-store kb`: the store's encoder is loaded."""
    process, url = start_server(["--model", "smollm2", "--rag-store", str(store)])
    yield url
    stop_server(process)


def test_search_route_ranks_as_exact_cosine_search_and_names_sources(server, store):
    encoder = Encoder.load("minilm")
    rows = Store.open(str(store)).table.to_arrow().to_pylist()
    vectors = np.array([r["vector"] for r in rows], dtype=np.float32)
    q = encoder.encode(["capital of Zorbania"])[0]
    exact = [rows[i]["id"] for i in np.argsort(-(vectors @ q))[:3]]  # numpy: the reference
    reply = httpx.post(f"{server}/rag/search", json={"query": "capital of Zorbania", "k": 3,
                                                     "method": "dense"}, timeout=60)  # fmt: skip
    assert reply.status_code == 200, reply.text
    data = reply.json()
    texts = {r["id"]: r["text"] for r in rows}
    assert [d["text"] for d in data["data"]] == [texts[i] for i in exact]
    assert data["data"][0]["source"].endswith("zorbania.txt") and data["embed_model"] == "minilm"
    fused = httpx.post(f"{server}/rag/search", json={"query": "fastest vessel Marrow"}).json()
    assert "Saltwhistle" in fused["data"][0]["text"] and len(fused["data"]) == 4


@pytest.mark.parametrize(
    "body, field",
    [({"query": "x", "k": 0}, "k"), ({"query": "x", "method": "cosine"}, "method"),
     ({"query": "   "}, "query"), ({"query": "x", "extra": 1}, "extra"), ({}, "query")],
)  # fmt: skip
def test_bad_searches_are_400s_naming_the_field_and_the_server_keeps_serving(server, body, field):
    reply = httpx.post(f"{server}/rag/search", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert field in reply.json()["error"]["message"] + str(reply.json()["error"]["param"])
    assert httpx.get(f"{server}/health").status_code == 200


def test_lab_conversations_answered_through_v1_cite_the_fact(server):
    data = httpx.post(f"{server}/lab/api/rag", json={"question": QUESTION, "k": 4}, timeout=60)
    assert data.status_code == 200, data.text
    lab = data.json()
    assert lab["sources"][0]["source"].endswith("zorbania.txt") and lab["sources"][0]["n"] == 1
    rag, stuffed = lab["conversations"]["rag"], lab["conversations"]["stuffed"]
    assert "[1] (" in rag[1]["content"] and rag[1]["content"].endswith(f"Question: {QUESTION}")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    answer = client.chat.completions.create(
        model="smollm2", messages=rag, temperature=0, max_tokens=16
    )
    assert "Quillmoor" in answer.choices[0].message.content
    other = client.chat.completions.create(
        model="smollm2", messages=stuffed, temperature=0, max_tokens=4
    )
    assert other.usage.prompt_tokens > answer.usage.prompt_tokens  # the whole budget, stuffed
    too_big = httpx.post(f"{server}/lab/api/rag", json={"question": QUESTION,
                                                         "context_tokens": 100_000})  # fmt: skip
    assert too_big.status_code == 400 and "context_tokens" in too_big.json()["error"]["message"]


def test_without_a_store_the_routes_are_404s(tmp_path):
    process, url = start_server(["--model", "smollm2"])
    try:
        reply = httpx.post(f"{url}/rag/search", json={"query": "x"}, timeout=60)
        assert reply.status_code == 404 and "--rag-store" in reply.json()["error"]["message"]
        assert httpx.get(f"{url}/lab/api/info").json()["rag"] is None
    finally:
        stop_server(process)


def test_the_rag_view_streams_both_answers_beside_the_sources(server):
    with open_page(server) as page:
        page.click("#tab-rag")
        page.wait_for_selector("#view-rag:not([hidden])")
        page.fill("#rag-question", QUESTION)
        page.fill("#rag-k", "4")
        page.click("#rag-ask")
        page.wait_for_selector("#view-rag[data-done=true]", timeout=120_000)
        assert "Quillmoor" in page.inner_text("#rag-answer")
        first = page.query_selector("#rag-sources li")
        assert first.get_attribute("data-source").endswith("zorbania.txt")
        rag_tokens = int(page.get_attribute("#rag-cost", "data-prompt-tokens"))
        stuffed_tokens = int(page.get_attribute("#stuffed-cost", "data-prompt-tokens"))
        assert 0 < rag_tokens < stuffed_tokens
        assert "time to first token" in page.inner_text("#stuffed-cost")
        folder = os.environ.get("GLASSFORMER_SCREENSHOTS")
        if folder:
            page.screenshot(path=str(Path(folder) / "rag.png"), full_page=True)
