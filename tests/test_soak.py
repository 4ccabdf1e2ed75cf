"""Soak: 1,000 requests from 4 concurrent clients while workers and the shadow are killed, frozen and
brought back at random every few seconds. Nothing is lost, no token differs, no node grows."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from odmoe.benchmarks.config import SoakSuite
from odmoe.benchmarks.suites.soak import soak
from odmoe.benchmarks.workload import prompt_ids, reference_tokens

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_a_thousand_requests_through_random_failures(model_dirs, reap_children):
    path = model_dirs["qwen2_moe"]
    suite = SoakSuite(requests=1000, clients=4, new_tokens=8, prompts=6, workers=4, warmup_requests=100)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [prompt_ids(tokenizer, i, 16) for i in range(suite.prompts)]
    wanted = [reference_tokens(path, p, suite.new_tokens) for p in prompts]
    report = soak(path, [f"cluster.workers={suite.workers}", "cluster.group_size=2"], prompts, wanted, suite)
    assert report["completed"] == 1000, report["errors"][:5]
    assert report["lost"] == 0 and report["differ"] == 0
    assert report["kills"] >= 5 and report["freezes"] >= 5, report["events"]
    assert "main" in report["rss_growth"]
    for name, growth in report["rss_growth"].items():
        assert growth["pct"] <= 5.0, (name, growth)
