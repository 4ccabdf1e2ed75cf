"""The memory plan: each node's need before anything loads, the refusal lines, role=plan."""

from __future__ import annotations

import subprocess
import sys

import pytest

from odmoe.memory_plan import (
    MARGIN_BYTES,
    PROCESS_BYTES,
    CheckpointSizes,
    WorkerSetup,
    expert_room,
    plan_main,
    plan_shadow,
    plan_workers,
    unfit_homes,
    worker_memories,
    worker_shares,
)
from odmoe.placement import Topology
from odmoe.tools.memory import parse_bytes

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

MiB, GiB = 1 << 20, 1 << 30
# a real-width Mixtral-shaped checkpoint: 16 MoE layers x 8 experts of 21 MiB (bf16), 84 MiB the rest
SIZES = CheckpointSizes(
    expert_bytes=21 * MiB,
    experts=8,
    moe_layers=tuple(range(16)),
    non_expert_bytes=84 * MiB,
    disk_bytes=2772 * MiB,
    shadow_bytes={"int8_dynamic": 1394 * MiB, "int4": 784 * MiB},
)


def test_each_worker_is_home_for_its_share_of_every_expert():
    setup = WorkerSetup(workers=4, group_size=2)
    assert worker_shares(SIZES, setup) == [32, 32, 32, 32]
    cacheless = WorkerSetup(workers=4, group_size=2, cache=False)  # the paper's: every layer stored
    assert worker_shares(SIZES, cacheless) == [128] * 4
    own_layers = WorkerSetup(workers=4, group_size=2, cache=False, only_own_layers=True)
    assert worker_shares(SIZES, own_layers) == [64] * 4
    # a lost worker's homes go to the rest of its group
    assert worker_shares(SIZES, setup, live=[0, 2, 3]) == [64, 0, 32, 32]


def test_homes_follow_memory_a_bigger_box_takes_more():
    setup = WorkerSetup(workers=2, group_size=2)
    rooms = [expert_room(m, SIZES.expert_bytes, 2, 128) for m in (4 * GiB, 2 * GiB)]
    shares = worker_shares(SIZES, setup, rooms)
    assert sum(shares) == 128 and shares[0] > shares[1] and shares[0] <= rooms[0]


def test_a_worker_that_fits_and_one_that_does_not():
    setup = WorkerSetup(workers=2, group_size=2)
    share = 64 * SIZES.expert_bytes + 2 * SIZES.expert_bytes + PROCESS_BYTES + MARGIN_BYTES
    fits = plan_workers(SIZES, setup, [(share, "node.memory")] * 2)
    assert all(n.fits and n.need == share for n in fits) and fits[0].refusal() == ""
    short = plan_workers(SIZES, setup, [(share - 1, "cgroup v1 limit")] * 2)
    line = short[1].refusal()
    assert not short[1].fits and line.startswith("worker1 needs ")
    assert "cgroup v1 limit" in line and "home for 64 experts" in line
    assert "cluster.workers=4" in line and "worker.store=disk" in line  # what to change
    # what each would then hold, not only its room (the line said "home for at most 63" for 32)
    assert "each then home for about 32 experts, room for 63" in line, line
    disk = plan_workers(SIZES, WorkerSetup(workers=2, group_size=2, store="disk"), [(1 * GiB, "x")] * 2)
    assert all(n.fits for n in disk)  # the disk serves: only the slots are held


def test_main_and_shadow_lines():
    main = plan_main(SIZES, 512 * MiB, "cgroup v1 limit")
    assert not main.fits and "non-expert tensors 84 MiB" in main.refusal()
    shadow = plan_shadow(SIZES, "int8_dynamic", 2 * GiB, "node.memory", layer_bytes=173 * MiB)
    assert not shadow.fits and "int4" in shadow.advice  # a lower precision is named
    assert plan_shadow(SIZES, "int4", 2 * GiB, "node.memory", 173 * MiB).fits


def test_main_refuses_when_the_rooms_together_cannot_hold_the_model():
    topology = Topology(2, 2, homes=True).for_model(list(range(16)), 8)
    assert unfit_homes(topology, [64, 64], [True, True]) == ""
    line = unfit_homes(topology, [64, 40], [True, True])
    assert "holds 104 of the model's 128 experts" in line and "worker1" in line
    assert "worker.store=disk" in line
    assert unfit_homes(topology, [64, 40], [False, False]) == ""  # store=disk: the rest from disk


def test_peers_memory_is_its_own_unless_named():
    got = worker_memories(3, (8 * GiB, "MemAvailable"), {"worker2": "16GiB"}, parse_bytes)
    assert got == [(8 * GiB, "MemAvailable"), (8 * GiB, "MemAvailable"), (16 * GiB, "cluster.node_memory")]


def test_the_plan_of_a_checkpoint_lists_every_node(model_dirs):
    from odmoe.launch.plan import cluster_plan
    from odmoe.launch.settings import compose

    path = model_dirs["mixtral"]
    cfg = compose(["role=plan", f"model.path={path}", "cluster.workers=4", "node.memory=8GiB"])
    header, needs = cluster_plan(cfg, path)
    assert [n.node for n in needs] == ["main", "shadow", "worker0", "worker1", "worker2", "worker3"]
    assert all(n.fits and n.have == 8 * GiB and n.source == "node.memory" for n in needs)
    assert "32 experts" in header and "home for 8 experts" in needs[2].holds


@pytest.mark.integration
def test_role_plan_exits_1_with_the_line_of_a_node_that_does_not_fit(model_dirs):
    path = model_dirs["mixtral"]
    short = subprocess.run(
        [sys.executable, "-m", "odmoe.launch.cli", "role=plan", f"model.path={path}", "node.memory=300MiB"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert short.returncode == 1, short.stdout + short.stderr
    assert all(f"worker{i}" in short.stdout for i in range(2)) and "shadow" in short.stdout
    assert "main needs" in short.stdout and "but has 0.29 GiB (node.memory)" in short.stdout
