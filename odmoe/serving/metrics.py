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


def _each(kind, registry: CollectorRegistry, table, labels: tuple[str, ...] = (), **options) -> dict:
    """One `kind` metric (Counter, Gauge, Histogram with its `options`) per (key, name, help) row of
    `table`, by key, each named odmoe:<name> on `registry` (in the table's order: the scrape's)."""
    return {
        key: kind(f"odmoe:{name}", text, labels, registry=registry, **options) for key, name, text in table
    }


class CacheMetrics:
    """The workers' expert caches (worker.cache). Workers report cumulative figures; counters grow by
    what changed since the last report (a restarted worker starts again from 0: its whole figure is
    new)."""

    def __init__(self, r: CollectorRegistry):
        self.events = _each(Counter, r, [
            ("hits", "expert_cache_hits", "Experts computed from a worker's cache (no load)"),
            ("misses", "expert_cache_misses", "Experts a caching worker had to load"),
            ("bytes_saved", "expert_cache_bytes_saved", "Expert bytes not loaded thanks to a cache hit"),
            ("evictions", "expert_cache_evictions", "Experts dropped from a full cache"),
        ], ("worker",))  # fmt: skip
        self.gauges = _each(Gauge, r, [
            ("capacity", "expert_cache_capacity", "Experts a worker's cache can hold"),
            ("cached", "expert_cache_cached", "Experts in a worker's cache now"),
        ], ("worker",))  # fmt: skip
        self.layer_hits = Counter(
            "odmoe:expert_cache_layer_hits", "Cache hits by MoE layer", ["layer"], registry=r
        )
        self.layer_evictions = Counter(
            "odmoe:expert_cache_layer_evictions", "Cache evictions by worker and MoE layer",
            ["worker", "layer"], registry=r,
        )  # fmt: skip
        self._seen: dict[tuple[str, str], int] = {}

    def report(self, stats: dict) -> None:
        """A finished request's `cache` stats: hits by layer, and each worker's cumulative row."""
        for layer, hits in (stats.get("hits_per_layer") or {}).items():
            self.layer_hits.labels(str(layer)).inc(hits)
        for worker, row in (stats.get("workers") or {}).items():
            for layer, now in (row.get("evictions_per_layer") or {}).items():
                self._grow(self.layer_evictions.labels(worker, str(layer)), (worker, f"L{layer}"), now)
            for field, gauge in self.gauges.items():
                gauge.labels(worker).set(row.get(field, 0))
            for field, counter in self.events.items():
                self._grow(counter.labels(worker), (worker, field), int(row.get(field, 0)))

    def _grow(self, child, key: tuple[str, str], now: int) -> None:
        """A counter following a worker's cumulative figure (from 0 again after a restart)."""
        before = self._seen.get(key, 0)
        child.inc(now - before if now >= before else now)
        self._seen[key] = now


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue=None):
        r = self.registry = CollectorRegistry()
        self.ttft, self.inter_token, self.e2e = _each(Histogram, r, [
            ("ttft", "time_to_first_token_seconds", "Arrival to first token"),
            ("inter_token", "inter_token_latency_seconds", "Between streamed tokens"),
            ("e2e", "e2e_request_latency_seconds", "Arrival to last token"),
        ], buckets=LATENCY_BUCKETS).values()  # fmt: skip
        self.tokens = _each(Counter, r, [  # summed over finished requests, by the key in their stats
            ("prompt_tokens", "prompt_tokens", "Prompt tokens prefilled"),
            ("new_tokens", "generation_tokens", "Tokens generated"),
        ])  # fmt: skip
        # finish_reason: stop | length | cancelled | error | deadline | rejected
        self.requests = Counter("odmoe:requests", "Requests ended, by how", ["finish_reason"], registry=r)
        running, waiting = _each(Gauge, r, [
            ("running", "num_requests_running", "Requests being decoded"),
            ("waiting", "num_requests_waiting", "Requests queued"),
        ]).values()  # fmt: skip
        if queue is not None:  # read from the queue when scraped
            running.set_function(lambda: len(queue.running))
            waiting.set_function(lambda: queue.waiting)
        self.batch_size = Histogram(
            "odmoe:batch_size", "Requests running together, per decode iteration (continuous batching)",
            registry=r, buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
        )  # fmt: skip
        self.bytes_per_token = Gauge(
            "odmoe:expert_bytes_per_token",
            "Expert bytes loaded per generated token, over the requests finished so far", registry=r,
        )  # fmt: skip
        self._bytes, self._generated = 0.0, 0
        self.per_worker = _each(Counter, r, [  # by the field of a per_worker row in the stats
            ("experts", "experts_loaded", "Experts loaded into a worker's device slot"),
            ("bytes_loaded", "expert_bytes_loaded", "Expert bytes loaded"),
            ("load_s", "expert_load_seconds", "Worker time loading"),
            ("compute_s", "expert_compute_seconds", "Worker time computing experts"),
        ], ("worker",))  # fmt: skip
        self.misses = _each(Counter, r, [  # summed as self.tokens
            ("reloads", "reloads", "Decode experts loaded only after main asked (misses)"),
            ("stall_s", "stall_seconds", "Main waiting on expert loads in decode"),
        ])  # fmt: skip
        self.recalls = _each(Gauge, r, [  # by the key in the stats, whose "overall" each is
            ("recall", "recall", "The shadow's prediction recall, last request"),
            ("timely_recall", "timely_recall", "Predictions that arrived in time, last request"),
        ])  # fmt: skip
        self.resent_calls = Counter(
            "odmoe:resent_calls", "Expert calls re-sent after a worker was lost", registry=r
        )
        self.cache = CacheMetrics(r)
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
        for key, counter in (self.tokens | self.misses).items():
            counter.inc(stats.get(key, 0))
        self._bytes += stats.get("bytes_loaded", 0)
        self._generated += stats.get("new_tokens", 0)
        if self._generated:
            self.bytes_per_token.set(self._bytes / self._generated)
        for worker, row in (stats.get("per_worker") or {}).items():
            for field, counter in self.per_worker.items():
                counter.labels(worker).inc(row[field])
        self.resent_calls.inc((stats.get("failover") or {}).get("resent_calls", 0))
        for key, gauge in self.recalls.items():
            value = (stats.get(key) or {}).get("overall")
            if value is not None:
                gauge.set(value)
        self.cache.report(stats.get("cache") or {})

    def tick(self, running: int, decoding: int) -> None:
        """One engine iteration with `running` requests of which `decoding` decode a token."""
        if decoding:
            self.batch_size.observe(decoding)

    def ended(self, ticket, how: str) -> None:
        """A request that ended without stats: cancelled, error, deadline, rejected."""
        self._last_token.pop(id(ticket), None)
        self.tokens["new_tokens"].inc(self._tokens.pop(id(ticket), 0))  # generated, if never delivered whole
        self.requests.labels(how).inc()

    def page(self) -> bytes:
        return generate_latest(self.registry)
