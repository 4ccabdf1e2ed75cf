"""Soak: requests from 4 concurrent clients while workers and the shadow are killed, frozen and
brought back at random every few seconds, and (issue 47) their links made stragglers, black-holed
or lossy. Nothing is lost, no token differs, no node grows.

The long soaks (1,000 requests each) are marked slow (`make soak`); a short one with every kind
of fault, a few minutes here, is marked extended."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from odmoe_bench.config import SoakSuite
from odmoe_bench.suites.soak import soak, summary
from odmoe_bench.workload import prompt_ids, reference_tokens

pytestmark = [pytest.mark.integration]


def _soak(path: str, suite: SoakSuite) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [prompt_ids(tokenizer, i, 16) for i in range(suite.prompts)]
    wanted = [reference_tokens(path, p, suite.new_tokens) for p in prompts]
    report = soak(path, [f"cluster.workers={suite.workers}", "cluster.group_size=2"], prompts, wanted, suite)
    print(f"\n{summary(report, suite.requests)}")
    assert report["completed"] == suite.requests, report["errors"][:5]
    assert report["lost"] == 0 and report["differ"] == 0
    assert not report["never_back"], report["never_back"]  # every worker served again after its fault
    return report


@pytest.mark.slow
def test_a_thousand_requests_through_random_failures(model_dirs, reap_children):
    suite = SoakSuite(requests=1000, clients=4, new_tokens=8, prompts=6, workers=4, warmup_requests=100)
    report = _soak(model_dirs["qwen2_moe"], suite)
    assert report["kills"] >= 5 and report["freezes"] >= 5, report["events"]
    assert "main" in report["rss_growth"]
    for name, growth in report["rss_growth"].items():
        assert growth["pct"] <= 5.0, (name, growth)


def _network_suite(requests: int) -> SoakSuite:
    # black holes of 0.5-10 s, stragglers 20-200 ms (+ as much jitter) and loss bursts of 5-50 %
    # for 2-10 s, beside kills and freezes: a new fault every 0.5-2 s, several nodes at once, two
    # workers always left alone (with one, 2 of 1,000 requests failed: "no live worker holds layer
    # 0", main's last worker lost too while the chaos had the other three)
    return SoakSuite(
        requests=requests, clients=4, new_tokens=8, prompts=6, workers=4, network=True,
        chaos_every_s=[0.5, 2.0], warmup_requests=min(100, requests // 4), keep_serving=2,
    )  # fmt: skip


@pytest.mark.slow
def test_a_thousand_requests_through_random_failures_and_network_faults(model_dirs, reap_children):
    report = _soak(model_dirs["qwen2_moe"], _network_suite(1000))
    for key in ("kills", "freezes", "stragglers", "black_holes", "loss_bursts"):
        assert report[key] >= 5, (key, report["events"])
    for name, growth in report["rss_growth"].items():
        assert growth["pct"] <= 5.0, (name, growth)


@pytest.mark.extended
def test_requests_through_random_failures_and_network_faults_short(model_dirs, reap_children):
    report = _soak(model_dirs["qwen2_moe"], _network_suite(400))
    for key in ("kills", "freezes", "stragglers", "black_holes", "loss_bursts"):
        assert report[key] >= 1, (key, report["events"])
