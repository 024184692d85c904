"""What a monitoring system sees of `glassformer serve`: /metrics read by prometheus_client's own
parsers (Prometheus' text format and OpenMetrics, chosen by the Accept header) after real
requests through the official openai client, every count held against what the client was
sent; and /health, which must stop saying "ok" once the engine thread is gone.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from processes import DEADLINE_S
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from serving import start_server, stop_server
from test_server import tiny_chat_model

import glassformer as gf
from glassformer.server.app import Served, create_app
from glassformer.server.metrics import Metrics
from glassformer.tokenizers import CharTokenizer

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tiny_chat_model(tmp_path_factory.mktemp("tiny") / "tinychat")
    process, url = start_server(["--model", str(model_dir), "--max-batch", "4"])
    yield url
    stop_server(process)


def samples(families) -> dict[tuple[str, frozenset], float]:
    """Every sample of the parsed families: (name, labels) -> value."""
    every = [sample for family in families for sample in family.samples]
    return {(s.name, frozenset(s.labels.items())): s.value for s in every}


def value(table: dict, name: str, **labels: str) -> float:
    return table[(name, frozenset(labels.items()))]


def scrape(url: str, accept: str | None = None) -> httpx.Response:
    return httpx.get(f"{url}/metrics", headers={"Accept": accept} if accept else {})


def histogram_buckets(table: dict, name: str) -> list[tuple[float, float]]:
    buckets = [
        (float(dict(labels)["le"]), v) for (n, labels), v in table.items() if n == f"{name}_bucket"
    ]
    return sorted(buckets)


def test_metrics_count_what_the_official_client_sent(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    usages = []
    for i, max_tokens in enumerate((1, 5, 9)):  # non-streamed chat
        reply = client.chat.completions.create(
            model="tinychat", messages=[{"role": "user", "content": f"Say {i}"}],
            max_tokens=max_tokens, temperature=0,
        )  # fmt: skip
        usages.append(reply.usage)
    for i in range(2):  # streamed chat, usage in the last chunk
        chunks = list(
            client.chat.completions.create(
                model="tinychat", messages=[{"role": "user", "content": f"Count to {i}"}],
                max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True},
            )
        )  # fmt: skip
        usages.append(chunks[-1].usage)
    for prompt in ("Once upon", "The end of"):
        usages.append(
            client.completions.create(
                model="tinychat", prompt=prompt, max_tokens=4, temperature=0
            ).usage
        )
    n_requests = len(usages)
    generated = sum(u.completion_tokens for u in usages)
    prompted = sum(u.prompt_tokens for u in usages)

    # The HTTP counter is written once the response has gone out: wait for the last one.
    deadline = time.monotonic() + DEADLINE_S
    while True:
        response = scrape(server)
        table = samples(text_string_to_metric_families(response.text))
        counted = value(
            table, "glassformer_requests_total", endpoint="/v1/completions", code="200"
        ) + value(table, "glassformer_requests_total", endpoint="/v1/chat/completions", code="200")
        if counted >= n_requests or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert value(table, "glassformer_requests_total", endpoint="/v1/chat/completions", code="200")
    assert counted == n_requests
    assert value(table, "glassformer_generation_tokens_total") == generated
    assert value(table, "glassformer_prompt_tokens_total") == prompted
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]  # the prefix cache's share
    assert sum(cached) > 0  # the chats share their template's head
    assert value(table, "glassformer_cached_prompt_tokens_total") == sum(cached)
    assert value(table, "glassformer_prefix_cache_hits_total") == sum(n > 0 for n in cached)
    assert value(table, "glassformer_prefix_cache_hit_rate") == pytest.approx(
        sum(cached) / prompted
    )
    assert value(table, "glassformer_time_to_first_token_seconds_count") == n_requests
    # every token after a row's first one is timed
    assert value(table, "glassformer_time_per_output_token_seconds_count") == generated - n_requests
    assert value(table, "glassformer_e2e_request_latency_seconds_count") == n_requests
    assert value(table, "glassformer_request_generation_tokens_sum") == generated
    assert value(table, "glassformer_request_prompt_tokens_sum") == prompted
    assert value(table, "glassformer_running_rows") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        buckets = histogram_buckets(table, f"glassformer_{name}")
        counts = [count for _, count in buckets]
        assert counts == sorted(counts) and len(buckets) > 5  # cumulative
        assert buckets[-1] == (float("inf"), n_requests)
        assert 0 < value(table, f"glassformer_{name}_sum") < 60
        assert value(table, f"glassformer_{name}_created") > 1.7e9  # a Unix time
    assert value(table, "glassformer_requests_created", endpoint="/v1/completions", code="200")

    # The same numbers as OpenMetrics, for a scraper that asks for it.
    response = scrape(server, OPENMETRICS)
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    families = {family.name: family for family in openmetrics_families(response.text)}
    assert families["glassformer_time_to_first_token_seconds"].type == "histogram"
    assert families["glassformer_generation_tokens"].type == "counter"
    table = samples(families.values())
    assert value(table, "glassformer_generation_tokens_total") == generated
    assert value(table, "glassformer_time_to_first_token_seconds_count") == n_requests
    assert value(table, "glassformer_e2e_request_latency_seconds_created") > 1.7e9


def test_two_apps_in_one_process_keep_their_own_series():
    first, second = Metrics(), Metrics()  # one shared registry would refuse the second
    first.count_request("/v1/completions", 200)
    first.tokens(3, None)
    table = samples(text_string_to_metric_families(second.exposition(None)[0].decode()))
    assert value(table, "glassformer_generation_tokens_total") == 0
    assert ("glassformer_requests_total", frozenset({("endpoint", "/v1/completions"),
                                                     ("code", "200")})) not in table  # fmt: skip
    table = samples(text_string_to_metric_families(first.exposition(None)[0].decode()))
    assert value(table, "glassformer_generation_tokens_total") == 3


class EngineDied(BaseException):
    """What the scheduler's `except Exception` does not catch (a KeyboardInterrupt, a
    SystemExit raised in the engine thread): the thread ends."""


def tiny_served() -> Served:
    tokenizer = CharTokenizer.from_text("abcdefgh ")
    cfg = gf.ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_layers=1, n_heads=2,
                         max_seq_len=32)  # fmt: skip
    torch.manual_seed(0)
    return Served(gf.build_model(cfg), tokenizer, "tiny")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_is_503_once_the_engine_thread_has_died():
    app = create_app(tiny_served())
    with TestClient(app) as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"

        def die() -> None:
            raise EngineDied

        scheduler = app.state.scheduler
        scheduler.engine.step = die
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 4}
        assert http.post("/v1/completions", json=body).status_code == 503
        scheduler.thread.join(timeout=10)
        assert not scheduler.thread.is_alive()
        health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "engine stopped"
        assert health.json()["model"] == "tiny"


def test_health_is_503_once_the_engine_has_stopped():
    app = create_app(tiny_served())
    with TestClient(app) as http:
        app.state.scheduler.stop()
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "engine stopped"


def test_the_fingerprint_names_the_precision_the_model_decodes_in():
    """A Q4_1 file served on its own blocks said float32 (its embeddings' dtype): the fingerprint
    names the weights' precision, so replies from an int4 and an fp32 server differ."""
    from glassformer.nn.quant import quantize_int4, round_inputs

    tokenizer = CharTokenizer.from_text("abcdefgh ")
    cfg = gf.ModelConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=2,
                         max_seq_len=32)  # fmt: skip
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 2}
    for convert, want in [(None, "fp32"), (quantize_int4, "int4"), (round_inputs, "w4a8")]:
        torch.manual_seed(0)
        model = gf.build_model(cfg)
        if convert is round_inputs:
            model = round_inputs(quantize_int4(model))
        elif convert is not None:
            model = convert(model)
        with TestClient(create_app(Served(model, tokenizer, "tiny"))) as http:
            fingerprint = http.post("/v1/completions", json=body).json()["system_fingerprint"]
        assert fingerprint.endswith(f"-tiny-{want}"), fingerprint
