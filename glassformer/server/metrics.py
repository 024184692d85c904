"""GET /metrics: the server's numbers through prometheus_client, in the format the scraper asks
for (OpenMetrics when its Accept header names application/openmetrics-text, else Prometheus'
text format 0.0.4), with the `_created` samples and histogram buckets a Prometheus user expects.

Requests by endpoint and status; time to first token, time per output token, each request's
latency and its prompt and generated tokens as histograms (seed 002 exercise 2: TTFT vs
tokens/s); token counters; and gauges for running and queued rows, parked conversations, the
KV-cache bytes in use, the prompt store's entries and bytes and the prefix cache's hit rate.
Each app has its own registry, so two servers in one process (the tests) never share or clash
over a series. Every method is safe to call from any thread.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import choose_encoder

# Upper bounds of the histogram buckets; +Inf is implied.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # seconds
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)  # seconds
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 50000)  # tokens

COUNTERS = {
    "prompt_tokens": "Prompt tokens received.",
    "cached_prompt_tokens": (
        "Prompt tokens whose keys/values came from the prefix cache (a parked conversation or "
        "another row with the same prefix), not prefilled again."
    ),
    "prefix_cache_hits": "Rows whose prompt took at least one token from the prefix cache.",
    "generation_tokens": "Tokens generated.",
}

HISTOGRAMS = {  # name: (about, bucket upper bounds)
    "time_to_first_token_seconds": ("Seconds from arrival to a row's first token.", TTFT_BUCKETS),
    "time_per_output_token_seconds": (
        "Seconds between a row's tokens (inter-token).",
        TOKEN_BUCKETS,
    ),
    "e2e_request_latency_seconds": (
        "Seconds from arrival to the last token, per request.",
        LATENCY_BUCKETS,
    ),
    "request_prompt_tokens": ("Prompt tokens of each finished request.", COUNT_BUCKETS),
    "request_generation_tokens": ("Tokens generated for each finished request.", COUNT_BUCKETS),
}

GAUGES = {
    "running_rows": "Rows decoding in the engine.",
    "queued_rows": "Rows waiting for a slot.",
    "parked_rows": "Finished conversations whose KV cache is kept for a next turn.",
    "kv_cache_bytes": "Bytes of keys/values held by running and parked rows.",
    "prompt_store_bytes": "Bytes of keys/values evicted rows left in the prompt store.",
    "prompt_store_entries": "Evicted rows whose keys/values the prompt store keeps.",
    "prefix_cache_hit_rate": (
        "Share of all prompt tokens so far taken from the prefix cache: cached_prompt_tokens "
        "over prompt_tokens (vLLM's prefix cache hit rate)."
    ),
}


class Metrics:
    """What /metrics reports; the scheduler, the responses and the HTTP layer write, /metrics
    reads."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=registry)  # process_*, python_*: what any Python exporter has
        self.requests = Counter(
            "glassformer_requests",
            "HTTP requests by endpoint and status code.",
            ("endpoint", "code"),
            registry=registry,
        )
        self.counters = {
            name: Counter(f"glassformer_{name}", about, registry=registry)
            for name, about in COUNTERS.items()
        }
        self.histograms = {
            name: Histogram(f"glassformer_{name}", about, buckets=buckets, registry=registry)
            for name, (about, buckets) in HISTOGRAMS.items()
        }
        self.gauges = {
            name: Gauge(f"glassformer_{name}", about, registry=registry)
            for name, about in GAUGES.items()
        }
        self.lock = threading.Lock()
        self.prompt_tokens = self.cached_tokens = 0  # the hit rate's totals

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, code=str(status)).inc()

    def first_token(self, seconds: float, prompt_tokens: int, cached: int) -> None:
        self.histograms["time_to_first_token_seconds"].observe(seconds)
        self.counters["prompt_tokens"].inc(prompt_tokens)
        self.counters["cached_prompt_tokens"].inc(cached)
        self.counters["prefix_cache_hits"].inc(cached > 0)
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached
            rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        self.gauges["prefix_cache_hit_rate"].set(rate)

    def tokens(self, n: int, seconds_each: float | None) -> None:
        """n new tokens of one row; seconds_each: the time per token since its previous ones
        (None for the first token, whose time is the TTFT)."""
        self.counters["generation_tokens"].inc(n)
        if seconds_each is not None:
            for _ in range(n):
                self.histograms["time_per_output_token_seconds"].observe(seconds_each)

    def request_finished(self, seconds: float, prompt_tokens: int, generated_tokens: int) -> None:
        """A request whose every choice finished: its latency and its sizes."""
        self.histograms["e2e_request_latency_seconds"].observe(seconds)
        self.histograms["request_prompt_tokens"].observe(prompt_tokens)
        self.histograms["request_generation_tokens"].observe(generated_tokens)

    def set_gauges(self, **values: int) -> None:
        for name, value in values.items():
            self.gauges[name].set(value)

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The body and content type of a scrape whose Accept header is `accept`."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type
