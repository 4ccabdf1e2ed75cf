"""What one worker holds (odmoe.worker.share): pure, from its settings, its memory and the placement."""

from __future__ import annotations

import pytest

from odmoe.memory_plan import MARGIN_BYTES, PROCESS_BYTES, CheckpointSizes, WorkerSetup
from odmoe.placement import Topology
from odmoe.worker.share import plan_share

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

MiB, GiB = 1 << 20, 1 << 30
SIZES = CheckpointSizes(
    expert_bytes=21 * MiB, experts=8, moe_layers=(0, 1, 2, 3), non_expert_bytes=0, disk_bytes=0
)
STORED = [(layer, e) for layer in range(4) for e in range(8)]


def _share(
    index=0, memories=((8 * GiB, "x"), (8 * GiB, "x")), spec="auto", device="cpu", store="memory", room=32
):
    setup = WorkerSetup(workers=len(memories), group_size=len(memories), store=store)
    topology = Topology(len(memories), len(memories), homes=True).for_model([0, 1, 2, 3], 8)
    return plan_share(index, setup, SIZES, topology, STORED, list(memories), spec, device, False, False, room)


def test_a_cpu_worker_with_a_cache_holds_its_homes_in_the_cache_and_nothing_in_its_store():
    share = _share()
    assert share.cache_is_store and share.held == frozenset() and share.strict
    assert share.home == tuple((layer, e) for layer in range(4) for e in (0, 2, 4, 6))
    assert share.room == 32 and share.need.fits


def test_rooms_by_memory_deal_more_homes_to_the_bigger_box():
    small = PROCESS_BYTES + MARGIN_BYTES + 2 * 21 * MiB + 12 * 21 * MiB  # room for 12 experts
    big = PROCESS_BYTES + MARGIN_BYTES + 2 * 21 * MiB + 24 * 21 * MiB  # 24
    mine, theirs = _share(0, ((small, "a"), (big, "b"))), _share(1, ((small, "a"), (big, "b")))
    assert mine.room == 12 and theirs.room == 24
    assert len(mine.home) + len(theirs.home) == 32 and len(theirs.home) > len(mine.home)


def test_an_explicit_cache_size_is_every_peers_room_whatever_their_memory():
    """worker.cache=<size> is the cluster's config: peers have the same room, homes stay e mod n (a
    peer's room taken from its memory once dealt this worker only 2 homes of 16)."""
    share = _share(0, ((8 * GiB, "x"), (64 * GiB, "y")), spec=str(2 * 21 * MiB), room=2)
    assert share.room == 2 and len(share.home) == 16 and not share.strict  # the rest from disk, by choice


def test_a_cuda_worker_holds_its_homes_in_host_memory_and_a_disk_store_holds_none():
    cuda = _share(device="cuda", room=8)
    assert not cuda.cache_is_store and cuda.held == frozenset(cuda.home) and len(cuda.home) == 16
    disk = _share(store="disk")
    assert disk.held == frozenset() and not disk.strict


def test_a_share_that_cannot_fit_is_refused_with_the_line():
    tight = PROCESS_BYTES + MARGIN_BYTES + 2 * 21 * MiB + 10 * 21 * MiB
    share = _share(0, ((tight, "cgroup v1 limit"), (tight, "cgroup v1 limit")))
    assert share.strict and not share.need.fits
    assert share.need.refusal().startswith("worker0 needs") and "(cgroup v1 limit)" in share.need.refusal()
