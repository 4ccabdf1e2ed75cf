"""Batched prefill over all workers: identical tokens for any prompt length and mini-batch size."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe import LocalCluster
from odmoe.models.checkpoint import Checkpoint
from tests.conftest import FAMILY_NAMES, cluster_families

pytestmark = pytest.mark.integration
LENGTHS = [1, 2, 16, 128, 250]  # 250 + 6 new tokens = the test models' 256-position context
NEW = 6


def prompt(n: int) -> list[int]:
    return [(7 * i + 11) % 1000 + 4 for i in range(n)]


def reference_tokens(path: str, ids: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW)
    return out[0, len(ids) :].tolist()


def check_lengths(cluster: LocalCluster, path: str) -> list[dict]:
    stats = []
    for n in LENGTHS:
        got = cluster.client.generate(prompt(n), max_new_tokens=NEW)
        assert got.token_ids == reference_tokens(path, prompt(n)), f"prompt of {n} tokens diverged"
        stats.append(got.stats)
    return stats


SETTINGS = {
    "mixtral": ["prefill.mini_batch=0"],
    "qwen2_moe": ["prefill.mini_batch=8", "prefill.placement=balanced"],
    "qwen3_moe": ["prefill.mini_batch=3"],
    "olmoe": ["prefill.mini_batch=32", "prefill.placement=balanced"],
    "deepseek_v2": ["prefill.mini_batch=5"],
    "deepseek_v3": ["prefill.mini_batch=16", "prefill.placement=balanced"],
}


@pytest.mark.parametrize(
    "family",
    # Mixtral in the default run (time budget), the other families in the extended run, DeepSeek's slow
    [f if f == "mixtral" or not isinstance(f, str) else pytest.param(f, marks=pytest.mark.extended)
     for f in cluster_families()],
)  # fmt: skip
def test_prefill_tokens_equal_reference_for_every_prompt_length(family, model_dirs, reap_children):
    path = model_dirs[family]
    words = [*SETTINGS[family], "worker.cache=0"]  # every expert loaded: the stats' load split is checked
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        stats = check_lengths(cluster, path)
    check_prefill_stats(stats, Checkpoint(path))


def check_prefill_stats(stats: list[dict], ckpt: Checkpoint) -> None:
    top_k, experts = ckpt.top_k, ckpt.num_experts
    one_token = stats[0]["prefill"]["experts_per_layer"]
    assert set(one_token.values()) == {top_k}  # a 1-token prompt activates exactly top-k experts per layer
    for s in stats:
        p = s["prefill"]
        assert p["main_s"] + p["wait_on_workers_s"] == pytest.approx(s["ttft_s"], rel=1e-6)
        assert 0 <= p["transfer_s"] <= p["wait_on_workers_s"] and p["load_s"] > 0 and p["compute_s"] > 0
        assert all(top_k <= n <= experts for n in p["experts_per_layer"].values())


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("mini_batch", [1, 4, 16, 64])
def test_prefill_matrix(family, mini_batch, model_dirs, reap_children):
    path = model_dirs[family]
    with LocalCluster(
        path, workers=4, group_size=2, overrides=[f"prefill.mini_batch={mini_batch}"]
    ) as cluster:
        check_lengths(cluster, path)
