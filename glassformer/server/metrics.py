"""GET /metrics: the server's numbers in Prometheus' text format, written by hand (the format is
a few lines per metric: `# HELP`, `# TYPE`, then `name{label="value"} number`).

Requests by endpoint and status, time to first token and time per output token as histograms
(seed 002 exercise 2: TTFT vs tokens/s), and gauges for running and queued rows, parked
conversations and the KV-cache bytes in use. Every method is safe to call from any thread.
"""

from __future__ import annotations

import threading
from collections import Counter

# Upper bounds (seconds) of the histogram buckets; +Inf is implied.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus histograms are."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), -1)
        self.counts[index] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip((*self.bounds, "+Inf"), self.counts, strict=True):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        return [*lines, f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]


class Metrics:
    """What /metrics reports; the scheduler and the HTTP layer write, /metrics reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.ttft = Histogram(TTFT_BUCKETS)
        self.per_token = Histogram(TOKEN_BUCKETS)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generated_tokens = 0
        self.gauges = {"running_rows": 0, "queued_rows": 0, "parked_rows": 0, "kv_cache_bytes": 0}

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def first_token(self, seconds: float, prompt_tokens: int, cached: int) -> None:
        with self._lock:
            self.ttft.observe(seconds)
            self.prompt_tokens += prompt_tokens
            self.cached_prompt_tokens += cached

    def tokens(self, n: int, seconds_each: float | None) -> None:
        """n new tokens of one row; seconds_each: the time per token since its previous ones
        (None for the first token, whose time is the TTFT)."""
        with self._lock:
            self.generated_tokens += n
            if seconds_each is not None:
                for _ in range(n):
                    self.per_token.observe(seconds_each)

    def set_gauges(self, **values: int) -> None:
        with self._lock:
            self.gauges.update(values)

    def render(self) -> str:
        with self._lock:
            out = [
                "# HELP glassformer_requests_total HTTP requests by endpoint and status code.",
                "# TYPE glassformer_requests_total counter",
            ]
            for (endpoint, status), n in sorted(self.requests.items()):
                out.append(
                    f'glassformer_requests_total{{endpoint="{endpoint}",code="{status}"}} {n}'
                )
            for name, kind, about, value in (
                ("prompt_tokens_total", "counter", "prompt tokens received", self.prompt_tokens),
                (
                    "cached_prompt_tokens_total",
                    "counter",
                    "prompt tokens reused from a parked conversation (not prefilled again)",
                    self.cached_prompt_tokens,
                ),
                ("generation_tokens_total", "counter", "tokens generated", self.generated_tokens),
                (
                    "running_rows",
                    "gauge",
                    "rows decoding in the engine",
                    self.gauges["running_rows"],
                ),
                ("queued_rows", "gauge", "rows waiting for a slot", self.gauges["queued_rows"]),
                (
                    "parked_rows",
                    "gauge",
                    "finished conversations whose KV cache is kept for a next turn",
                    self.gauges["parked_rows"],
                ),
                (
                    "kv_cache_bytes",
                    "gauge",
                    "bytes of keys/values held by running and parked rows",
                    self.gauges["kv_cache_bytes"],
                ),
            ):
                out += [
                    f"# HELP glassformer_{name} {about}.",
                    f"# TYPE glassformer_{name} {kind}",
                    f"glassformer_{name} {value}",
                ]
            for name, about, histogram in (
                ("time_to_first_token_seconds", "from arrival to the first token", self.ttft),
                ("time_per_output_token_seconds", "between a row's tokens", self.per_token),
            ):
                out += [
                    f"# HELP glassformer_{name} Seconds {about}.",
                    f"# TYPE glassformer_{name} histogram",
                    *histogram.lines(f"glassformer_{name}"),
                ]
        return "\n".join(out) + "\n"
