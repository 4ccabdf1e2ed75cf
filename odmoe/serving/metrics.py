"""Main's Prometheus metrics (`GET /metrics` on the HTTP front door), with prometheus-client.

Contract: one `ServerMetrics` per main, on its own registry (several mains in one test process never
collide). The engine thread reports what happens to each request — `token(ticket)` per streamed
token, `finished(stats)` once per served request, `failed(kind)` — and the gauges read the request
queue when scraped. Names follow vLLM's where a meaning is shared (`odmoe:time_to_first_token_seconds`
≈ `vllm:time_to_first_token_seconds`), so existing dashboards need only the prefix changed.
TTFT is counted from the request's arrival (queueing included), as a client sees it.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # the *_created series only add noise to every scrape
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue=None):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "odmoe:time_to_first_token_seconds", "Arrival to first token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.inter_token = Histogram(
            "odmoe:inter_token_latency_seconds",
            "Between streamed tokens",
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "odmoe:e2e_request_latency_seconds", "Arrival to last token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.prompt_tokens = Counter("odmoe:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("odmoe:generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            "odmoe:requests", "Requests ended, by how", ["finish_reason"], registry=r
        )  # stop | length | cancelled | error | deadline | rejected
        self.running = Gauge("odmoe:num_requests_running", "Requests being decoded", registry=r)
        self.waiting = Gauge("odmoe:num_requests_waiting", "Requests queued", registry=r)
        if queue is not None:
            self.running.set_function(lambda: len(queue.running))
            self.waiting.set_function(lambda: queue.waiting)
        self.batch_size = Histogram(
            "odmoe:batch_size",
            "Requests running together, per decode iteration (continuous batching)",
            registry=r,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
        )
        self.bytes_per_token = Gauge(
            "odmoe:expert_bytes_per_token",
            "Expert bytes loaded per generated token, over the requests finished so far",
            registry=r,
        )
        self._bytes, self._generated = 0.0, 0
        self.experts_loaded = Counter(
            "odmoe:experts_loaded", "Experts loaded into a worker's device slot", ["worker"], registry=r
        )
        self.bytes_loaded = Counter(
            "odmoe:expert_bytes_loaded", "Expert bytes loaded", ["worker"], registry=r
        )
        self.load_seconds = Counter(
            "odmoe:expert_load_seconds", "Worker time loading", ["worker"], registry=r
        )
        self.compute_seconds = Counter(
            "odmoe:expert_compute_seconds", "Worker time computing experts", ["worker"], registry=r
        )
        self.reloads = Counter(
            "odmoe:reloads", "Decode experts loaded only after main asked (misses)", registry=r
        )
        self.stall_seconds = Counter(
            "odmoe:stall_seconds", "Main waiting on expert loads in decode", registry=r
        )
        self.recall = Gauge("odmoe:recall", "The shadow's prediction recall, last request", registry=r)
        self.timely_recall = Gauge(
            "odmoe:timely_recall", "Predictions that arrived in time, last request", registry=r
        )
        self.resent_calls = Counter(
            "odmoe:resent_calls", "Expert calls re-sent after a worker was lost", registry=r
        )
        # worker.cache: workers report cumulative figures; counters grow by what changed since the
        # last report (a restarted worker starts again from 0: its whole figure is new)
        self.cache_events = {
            field: Counter(f"odmoe:expert_cache_{field}", text, ["worker"], registry=r)
            for field, text in (
                ("hits", "Experts computed from a worker's cache (no load)"),
                ("misses", "Experts a caching worker had to load"),
                ("bytes_saved", "Expert bytes not loaded thanks to a cache hit"),
                ("evictions", "Experts dropped from a full cache"),
            )
        }
        self.cache_capacity = Gauge(
            "odmoe:expert_cache_capacity", "Experts a worker's cache can hold", ["worker"], registry=r
        )
        self.cache_cached = Gauge(
            "odmoe:expert_cache_cached", "Experts in a worker's cache now", ["worker"], registry=r
        )
        self.cache_layer_hits = Counter(
            "odmoe:expert_cache_layer_hits", "Cache hits by MoE layer", ["layer"], registry=r
        )
        self.cache_layer_evictions = Counter(
            "odmoe:expert_cache_layer_evictions", "Cache evictions by worker and MoE layer",
            ["worker", "layer"], registry=r,
        )  # fmt: skip
        self._cache_seen: dict[tuple[str, str], int] = {}
        self._last_token: dict[int, float] = {}
        self._tokens: dict[int, int] = {}  # tokens streamed so far, per running request

    def token(self, ticket) -> None:
        now, key = time.monotonic(), id(ticket)
        self._tokens[key] = self._tokens.get(key, 0) + 1
        last = self._last_token.get(key)
        if last is None:
            self.ttft.observe(now - ticket.arrived)
        else:
            self.inter_token.observe(now - last)
        self._last_token[key] = now

    def finished(self, ticket, stats: dict) -> None:
        self._last_token.pop(id(ticket), None)
        self._tokens.pop(id(ticket), None)
        self.e2e.observe(time.monotonic() - ticket.arrived)
        self.requests.labels(stats.get("finish_reason", "stop")).inc()
        self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
        self.generation_tokens.inc(stats.get("new_tokens", 0))
        self._bytes += stats.get("bytes_loaded", 0)
        self._generated += stats.get("new_tokens", 0)
        if self._generated:
            self.bytes_per_token.set(self._bytes / self._generated)
        for worker, row in (stats.get("per_worker") or {}).items():
            self.experts_loaded.labels(worker).inc(row["experts"])
            self.bytes_loaded.labels(worker).inc(row["bytes_loaded"])
            self.load_seconds.labels(worker).inc(row["load_s"])
            self.compute_seconds.labels(worker).inc(row["compute_s"])
        self.reloads.inc(stats.get("reloads", 0))
        self.stall_seconds.inc(stats.get("stall_s", 0.0))
        self.resent_calls.inc((stats.get("failover") or {}).get("resent_calls", 0))
        for gauge, key in ((self.recall, "recall"), (self.timely_recall, "timely_recall")):
            value = (stats.get(key) or {}).get("overall")
            if value is not None:
                gauge.set(value)
        self._cache(stats.get("cache") or {})

    def _cache(self, stats: dict) -> None:
        for layer, hits in (stats.get("hits_per_layer") or {}).items():
            self.cache_layer_hits.labels(str(layer)).inc(hits)
        for worker, row in (stats.get("workers") or {}).items():
            for layer, now in (row.get("evictions_per_layer") or {}).items():
                self._grow(self.cache_layer_evictions.labels(worker, str(layer)), (worker, f"L{layer}"), now)
            self.cache_capacity.labels(worker).set(row.get("capacity", 0))
            self.cache_cached.labels(worker).set(row.get("cached", 0))
            for field, counter in self.cache_events.items():
                self._grow(counter.labels(worker), (worker, field), int(row.get(field, 0)))

    def _grow(self, child, key: tuple[str, str], now: int) -> None:
        """A counter following a worker's cumulative figure (from 0 again after a restart)."""
        before = self._cache_seen.get(key, 0)
        child.inc(now - before if now >= before else now)
        self._cache_seen[key] = now

    def tick(self, running: int, decoding: int) -> None:
        """One engine iteration with `running` requests of which `decoding` decode a token."""
        if decoding:
            self.batch_size.observe(decoding)

    def ended(self, ticket, how: str) -> None:
        """A request that ended without stats: cancelled, error, deadline, rejected."""
        self._last_token.pop(id(ticket), None)
        self.generation_tokens.inc(self._tokens.pop(id(ticket), 0))  # generated, if never delivered whole
        self.requests.labels(how).inc()

    def page(self) -> bytes:
        return generate_latest(self.registry)
