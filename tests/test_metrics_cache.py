"""Main's Prometheus counters for the workers' caches (odmoe/serving/metrics.py): workers report cumulative
figures with each answer; the counters grow by what changed, and a restarted worker's figures
(starting again from 0) are counted whole rather than lowering a counter."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from odmoe.serving.metrics import ServerMetrics

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def _stats(hits: int, evictions: int) -> dict:
    row = {"capacity": 4, "cached": 3, "hits": hits, "misses": 1, "bytes_saved": 10 * hits}
    row |= {"evictions": evictions, "evictions_per_layer": {2: evictions}}
    return {"new_tokens": 1, "cache": {"hits_per_layer": {1: 1.0}, "workers": {"worker0": row}}}


def _value(page: str, name: str) -> float:
    return float(re.search(rf'^{re.escape(name)}{{worker="worker0"}} (\S+)$', page, re.M).group(1))


def test_cache_counters_follow_cumulative_reports_across_a_restart():
    metrics = ServerMetrics()
    ticket = SimpleNamespace(arrived=time.monotonic())
    for hits, evictions in ((5, 1), (9, 1), (2, 0)):  # the third report comes from a restarted worker
        metrics.finished(ticket, _stats(hits, evictions))
    page = metrics.page().decode()
    assert _value(page, "odmoe:expert_cache_hits_total") == 9 + 2
    assert _value(page, "odmoe:expert_cache_bytes_saved_total") == 90 + 20
    assert _value(page, "odmoe:expert_cache_evictions_total") == 1
    assert _value(page, "odmoe:expert_cache_capacity") == 4
    assert _value(page, "odmoe:expert_cache_cached") == 3
    assert 'odmoe:expert_cache_layer_evictions_total{layer="2",worker="worker0"} 1.0' in page
    assert 'odmoe:expert_cache_layer_hits_total{layer="1"} 3.0' in page
