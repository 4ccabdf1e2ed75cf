"""Each node under a real memory limit (a cgroup each, odmoe.launch.memory_cgroups): a model bigger than
any node serves exactly with the defaults, a worker lost under the limits is taken over without a node
passing its own, the disk serves past the cluster's memory, and a node that cannot fit says so at start.

The real-width tests use a Mixtral-shaped bf16 checkpoint made by `odmoe-make-model --fast-fill`'s
code (24 MoE layers x 8 experts of 21 MiB: 4.1 GiB) and take minutes each on two cores: `extended`.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from odmoe import LocalCluster
from odmoe.launch.memory_cgroups import MemoryCgroups
from odmoe.launch.spawn import ClusterStartError
from odmoe.memory_plan import MARGIN_BYTES, PROCESS_BYTES
from odmoe.tools.model_factory import ModelSpec, make_wide_model
from tests.test_cluster_fidelity import reference, sampled_reference

pytestmark = pytest.mark.integration
GiB, MiB = 1 << 30, 1 << 20
WIDE = ModelSpec(
    family="mixtral",
    layers=24,
    hidden=1024,
    intermediate=3584,
    experts=8,
    top_k=2,
    heads=16,
    kv_heads=4,
    vocab=4096,
    dtype="bfloat16",
)
PROMPT = "def fibonacci(n):"
NEW_TOKENS = 12


def _need_cgroups() -> None:
    reason = MemoryCgroups.available()
    if reason:
        pytest.skip(f"no memory cgroups here: {reason}")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> tuple[str, int]:
    """The real-width checkpoint and its bytes on disk."""
    _need_cgroups()
    path = make_wide_model(WIDE, tmp_path_factory.mktemp("wide") / "mixtral")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return str(path), size


def _no_node_passed_its_limit(cg: MemoryCgroups) -> dict:
    report = cg.report()
    for name, node in report.items():
        assert node.oom_kills == 0, f"{name} was OOM-killed: {node}"
        assert node.peak <= node.limit, f"{name} passed its limit: {node}"
    return report


def test_a_node_whose_share_cannot_fit_refuses_at_start_with_the_line(reap_children):
    """A worker under a limit below what its share needs (here: the process and its margin alone)
    exits at start with the plan's line naming it, what it needs and has, and what to change; it is
    never killed by the kernel mid-load."""
    _need_cgroups()
    limit = PROCESS_BYTES + MARGIN_BYTES - 64 * MiB  # above what the process takes, below the plan
    with MemoryCgroups({"worker": limit, "main": 2 * GiB, "shadow": 2 * GiB}) as cg:
        with pytest.raises(ClusterStartError) as info:
            LocalCluster(workers=2, place=cg.place, overrides=["shadow.enabled=false"]).start()
        assert all(node.oom_kills == 0 for node in cg.report().values())
    text = str(info.value)
    assert "needs" in text and "but has" in text and "(cgroup v1 limit)" in text, text
    assert "worker.store=disk" in text  # what to change


@pytest.mark.extended  # a 4.1 GiB model, six nodes under limits: ~10 min on two cores
def test_a_model_twice_every_nodes_limit_serves_exactly_with_the_defaults(wide_model, reap_children):
    """Every node (main, the shadow, 4 workers in 2 groups) under a limit of half the checkpoint, the
    defaults: greedy and seeded requests equal one process's; then a worker killed mid-stream, its
    experts read from disk by the survivors of its group, none passing its limit."""
    path, size = wide_model
    limit = size // 2
    want, want_logits = reference(path, PROMPT, new_tokens=NEW_TOKENS)
    sampled = sampled_reference(path, PROMPT, 7, NEW_TOKENS, temperature=0.8, top_p=0.9)
    with MemoryCgroups({"main": limit, "shadow": limit, "worker": limit}) as cg:
        with LocalCluster(path, workers=4, group_size=2, place=cg.place, ready_timeout_s=1200) as c:
            got = c.client.generate(PROMPT, max_new_tokens=NEW_TOKENS, return_logits=True)
            assert got.token_ids == want and torch.equal(got.final_logits, want_logits)
            seeded = c.client.generate(
                PROMPT, max_new_tokens=NEW_TOKENS, do_sample=True, seed=7, temperature=0.8, top_p=0.9
            )
            assert seeded.token_ids == sampled
            pieces: list[int] = []
            stream = threading.Thread(
                target=lambda: pieces.extend(
                    p.token_id for p in c.client.stream(PROMPT, max_new_tokens=NEW_TOKENS)
                )
            )
            stream.start()
            while len(pieces) < 3 and stream.is_alive():
                time.sleep(0.01)
            c.kill("worker1")
            stream.join(timeout=600)
            assert pieces == want
            after = c.client.generate(PROMPT, max_new_tokens=NEW_TOKENS)
            assert after.token_ids == want
            assert after.stats["failover"]["live_workers"] == [0, 2, 3]
        report = _no_node_passed_its_limit(cg)
    assert set(report) >= {"main", "shadow", "worker0", "worker2", "worker3"}


@pytest.mark.extended  # a 4.1 GiB model read from disk on every load: ~5 min on two cores
def test_the_disk_serves_past_the_clusters_memory(wide_model, reap_children):
    """worker.store=disk with every node's limit together below the checkpoint (main and two workers,
    each worker's limit a quarter of its share above its fixed cost): tokens identical."""
    path, size = wide_model
    expert_bytes = 21 * MiB
    worker_limit = PROCESS_BYTES + MARGIN_BYTES + 2 * expert_bytes + size // 8
    main_limit = PROCESS_BYTES + MARGIN_BYTES + 256 * MiB
    assert main_limit + 2 * worker_limit < size
    want, _ = reference(path, PROMPT, new_tokens=NEW_TOKENS)
    words = ["worker.store=disk", "shadow.enabled=false"]
    with MemoryCgroups({"main": main_limit, "worker": worker_limit}) as cg:
        with LocalCluster(
            path, workers=2, group_size=2, place=cg.place, overrides=words, ready_timeout_s=900
        ) as c:
            got = c.client.generate(PROMPT, max_new_tokens=NEW_TOKENS)
        assert got.token_ids == want
        assert got.stats["bytes_loaded"] > 0  # read from disk as it went
        _no_node_passed_its_limit(cg)
