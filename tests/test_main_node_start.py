"""Main's node builds in its constructor and connects in `start()` (nodes/main.py): built, it holds no
socket to a worker or to the shadow and no UDP beats; the workers' connections come with
`Membership.connect`."""

from __future__ import annotations

import pytest

from odmoe.launch.settings import compose
from odmoe.nodes.main import MainNode

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_the_constructor_connects_to_nobody(model_dirs):
    workers = "[tcp://127.0.0.1:9,tcp://127.0.0.1:10]"  # nobody listens there: nothing may wait on them
    cfg = compose(
        [
            "role=main",
            "security.enabled=false",
            "cluster.workers=2",
            "cluster.group_size=2",
            f"cluster.worker_addresses={workers}",
            "cluster.shadow_address=tcp://127.0.0.1:11",
            "cluster.shadow_pub_address=tcp://127.0.0.1:12",
            "failover.beat_interval_s=0.1",
        ]
    )
    node = MainNode(cfg, model_dirs["mixtral"])
    members = node.experts.members
    try:
        assert members.links == {} and members.beats is None and node.experts.shadow is None
        assert members.live == frozenset()
        members.connect()  # what start() does first, before it waits for anyone
        assert members.live == {0, 1}
    finally:
        members.close()
