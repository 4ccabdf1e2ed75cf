"""Real local clusters with the workers' expert cache (worker.cache): tokens and final logits equal
transformers' to the bit whatever the budget, the policy, the batch or a lost worker; the cache
actually serves (hits, bytes saved)."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from odmoe import LocalCluster
from tests.conftest import FAMILY_NAMES, generate_together
from tests.test_cluster_fidelity import PROMPTS, reference

pytestmark = pytest.mark.integration
NEW_TOKENS = 24


def _expert_bytes(path: str) -> int:
    """Bytes of one expert of the model (float32 on disk and on the workers)."""
    from odmoe.models.checkpoint import Checkpoint

    config = Checkpoint(path).config
    size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return 3 * config.hidden_size * size * 4


def _check(cluster, path: str, new_tokens: int = NEW_TOKENS) -> list[dict]:
    stats = []
    for prompt in PROMPTS:
        want_ids, want_logits = reference(path, prompt, new_tokens=new_tokens)
        got = cluster.client.generate(prompt, max_new_tokens=new_tokens, return_logits=True)
        assert got.token_ids == want_ids, f"diverged on {prompt!r}"
        assert torch.equal(got.final_logits, want_logits)
        stats.append(got.stats)
    return stats


@pytest.mark.parametrize(
    "policy", [pytest.param(p, marks=pytest.mark.extended) for p in ("prediction", "lru")]
)  # beyond the default run's ~15 min
def test_a_small_cache_keeps_tokens_and_serves_hits(policy, model_dirs, reap_children):
    """Two experts per worker (of 16 each is home for): evictions all the time, tokens unchanged;
    then requests together (one batch) with the same cache."""
    path = model_dirs["mixtral"]
    words = [f"worker.cache={2 * _expert_bytes(path)}", f"worker.cache_policy={policy}"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        stats = _check(cluster, path)
        workers = stats[-1]["cache"]["workers"]
        assert {w["capacity"] for w in workers.values()} == {2}
        assert sum(s["cache"]["hits"] for s in stats) > 0
        assert sum(w["evictions"] for w in workers.values()) > 0
        assert all(sum(w["evictions_per_layer"].values()) == w["evictions"] for w in workers.values())
        assert all(sum(s["cache"]["hits_per_layer"].values()) == s["cache"]["hits"] for s in stats)
        wanted = {p: reference(path, p, new_tokens=12)[0] for p in PROMPTS}
        assert generate_together(cluster, PROMPTS, 12) == wanted
        # the cache's figures reach Prometheus, per worker
        page = httpx.get(cluster.http_url + "/metrics", **cluster.http_auth).text
        hits = re.findall(r'^odmoe:expert_cache_hits_total\{worker="worker\d"\} (\S+)$', page, re.M)
        assert len(hits) == 2 and sum(map(float, hits)) > 0, page[-2000:]
        assert 'odmoe:expert_cache_capacity{worker="worker0"} 2.0' in page


@pytest.mark.parametrize("homes", ["room", pytest.param("even", marks=pytest.mark.extended)])
def test_homes_follow_the_workers_cache_rooms(homes, model_dirs, reap_children):
    """Two workers of one group, one with room for every expert, one with room for a single one: the
    roomy worker becomes home for all but one (homes by room, odmoe.placement), so the group caches
    nearly the whole model; dealt evenly (`cluster.homes=even`, the ablation) it keeps at most half of
    it plus one."""
    from odmoe.launch.local_cluster import NodePlacement
    from odmoe.models.checkpoint import Checkpoint

    path = model_dirs["mixtral"]
    ckpt = Checkpoint(path)
    total = len(ckpt.moe_layers) * ckpt.num_experts
    rooms = {"worker0": "all", "worker1": str(_expert_bytes(path))}

    def place(name: str) -> NodePlacement:
        return NodePlacement(words=[f"worker.cache={rooms[name]}"] if name in rooms else [])

    with LocalCluster(path, workers=2, group_size=2, overrides=[f"cluster.homes={homes}"], place=place) as c:
        stats = _check(c, path)
        workers = stats[-1]["cache"]["workers"]
        home = [workers[w]["home"] for w in sorted(workers)]
        cached = sum(w["home_cached"] for w in workers.values())
        if homes == "room":
            assert home == [total - 1, 1]
            assert [workers[w]["capacity"] for w in sorted(workers)] == [total - 1, 1]
            assert cached > total // 2 + 1, workers
        else:
            assert home == [total // 2, total // 2] and cached <= total // 2 + 1


@pytest.mark.parametrize("placement", ["auto", pytest.param("modulo", marks=pytest.mark.extended)])
def test_a_prompt_s_experts_are_computed_where_they_are_kept(placement, model_dirs, reap_children):
    """Four workers in two groups, each caching all it is home for (read at start: a CPU worker's
    cache is where its share rests). With prefill by homes (`auto`, the default with caches) a
    prompt's experts go to the workers that keep them, so no prompt loads anything; spread `e mod N`
    over all four workers storing the layer (`modulo`), about half of them land in the other group,
    which keeps none of them, and load again every time."""
    path = model_dirs["mixtral"]
    words = ["worker.cache=all", f"prefill.placement={placement}"]
    with LocalCluster(path, workers=4, group_size=2, overrides=words) as cluster:
        first, again = (
            _check(cluster, path)[0],
            cluster.client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS),
        )
    assert again.token_ids == reference(path, PROMPTS[0], new_tokens=NEW_TOKENS)[0]
    if placement == "auto":
        assert first["bytes_loaded"] == again.stats["bytes_loaded"] == 0, again.stats["cache"]
    else:
        assert first["bytes_loaded"] > 0 and again.stats["bytes_loaded"] > 0


@pytest.mark.extended  # a cluster per family: CI runs it
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_with_room_for_every_expert(family, model_dirs, reap_children):
    path = model_dirs[family]
    with LocalCluster(path, workers=2, group_size=2, overrides=["worker.cache=all"]) as cluster:
        stats = _check(cluster, path, new_tokens=12)
    # every worker read all it is home for at start (a CPU worker's cache is where its share rests):
    # every expert comes from a cache and nothing is loaded, from the first request on
    assert all(s["cache"]["hits"] > 0 and s["bytes_loaded"] == 0 for s in stats), stats[0]["cache"]


@pytest.mark.extended
def test_a_lost_worker_s_experts_become_misses_elsewhere(model_dirs, reap_children):
    path = model_dirs["olmoe"]
    want, _ = reference(path, PROMPTS[0], new_tokens=NEW_TOKENS)
    words = ["lab=on", "worker.cache=all", "fault.node=worker1", "fault.iteration=6"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        assert got.token_ids == want
        assert got.stats["failover"]["live_workers"] == [0]
        again = cluster.client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        assert again.token_ids == want


@pytest.mark.extended
def test_a_compressed_store_caches_ready_to_compute_experts(model_dirs, reap_children):
    """worker.store=compressed: a hit computes the cached (decompressed) expert, tokens unchanged."""
    path = model_dirs["qwen2_moe"]
    words = [f"worker.cache={3 * _expert_bytes(path)}", "worker.store=compressed"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        stats = _check(cluster, path, new_tokens=12)
    assert sum(s["cache"]["hits"] for s in stats) > 0
