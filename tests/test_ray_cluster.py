"""odmoe placed on a real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`): each
role lands on the Ray node it was constrained to, tokens equal the single-process reference, a
worker's Ray node removed mid-generation does not change them, Ray's restart of that worker's
actor on a spare node rejoins it, and Ctrl-C on `odmoe-launch role=ray` stops every actor."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from odmoe.launch.ray_cluster import RayCluster  # noqa: E402
from odmoe.launch.settings import compose  # noqa: E402
from tests.test_cluster_fidelity import PROMPTS, reference  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.extended]
NEW = 48


@pytest.fixture(scope="module")
def ray_nodes():
    """A head (no odmoe role) and seven nodes: two for mains (a custom resource), the shadow's (a node
    label), and three worker nodes (a custom resource each): two in use, one spare for Ray's restart."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = {
        "main": cluster.add_node(num_cpus=1, resources={"role_main": 1}),
        "main2": cluster.add_node(num_cpus=1, resources={"role_main": 1}),
        "shadow": cluster.add_node(num_cpus=1, labels={"odmoe-role": "shadow"}),
        **{f"w{i}": cluster.add_node(num_cpus=1, resources={"role_worker": 1}) for i in range(3)},
    }
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


def _odmoe_nodes() -> list[psutil.Process]:
    """odmoe node programs below this test process (Ray's workers start them, as grandchildren)."""
    nodes = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "odmoe.launch.cli" in " ".join(p.cmdline()):
                nodes.append(p)
        except psutil.Error:
            pass
    return nodes


@pytest.fixture
def no_node_left():
    """After the test no odmoe node it started may be running (reap_children would also count the
    Ray cluster's own processes, which outlive each test)."""
    before = {p.pid for p in _odmoe_nodes()}
    yield
    _, alive = psutil.wait_procs([p for p in _odmoe_nodes() if p.pid not in before], timeout=5)
    for p in alive:
        p.kill()
    assert not alive, f"odmoe nodes left running: {[p.pid for p in alive]}"


def _words(cluster, path: str) -> list[str]:
    return [
        f"ray.address={cluster.address}",
        "+ray.main.resources={role_main:1}",
        "+ray.shadow.labels={odmoe-role:shadow}",
        "+ray.worker.resources={role_worker:1}",
        "ray.ready_timeout_s=240",
        "cluster.workers=2",
        "cluster.group_size=2",
        f"model.path={path}",
        "server.http_port=0",
        "cluster.torch_threads=1",
    ]


def _node_of(nodes: dict, node_id: str) -> str:
    (name,) = [name for name, node in nodes.items() if node.node_id == node_id]
    return name


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s:.0f}s"
        time.sleep(0.5)
    return result


def test_roles_land_where_constrained_tokens_match_and_a_lost_worker_node_changes_nothing(
    ray_nodes, model_dirs, no_node_left
):
    cluster, nodes = ray_nodes
    path = model_dirs["mixtral"]
    want, _ = reference(path, PROMPTS[0], new_tokens=NEW)
    words = _words(cluster, path)
    with RayCluster(compose(["role=ray", *words]), words) as odmoe:
        where = {name: _node_of(nodes, info["node_id"]) for name, info in odmoe.placement.items()}
        assert where["main"] in ("main", "main2") and where["shadow"] == "shadow", where
        assert {where["worker0"], where["worker1"]} <= {"w0", "w1", "w2"}
        assert where["worker0"] != where["worker1"], where
        info = odmoe.client.info()
        assert info["placement"] == {name: placed["where"] for name, placed in odmoe.placement.items()}

        assert odmoe.client.generate(PROMPTS[0], max_new_tokens=NEW).token_ids == want

        # worker0's Ray node goes away a few tokens into the next stream
        doomed = nodes[where["worker0"]]
        got, stats = [], {}
        for reply in odmoe.client._replies(PROMPTS[0], NEW):
            if reply.WhichOneof("kind") == "token":
                got.append(reply.token.token_id)
                if len(got) == 4:
                    cluster.remove_node(doomed)
            else:
                stats = json.loads(reply.done.stats_json)
        assert got == want, "the stream after losing worker0's Ray node"
        lost = [e for e in stats["failover"]["events"] if e["event"] == "lost"]
        assert [e["worker"] for e in lost] == [0], stats["failover"]  # mid-stream, not before or after

        # Ray restarts worker0's actor on the spare worker node; it announces itself to main
        spare = ({"w0", "w1", "w2"} - {where["worker0"], where["worker1"]}).pop()

        def rejoined():
            now = odmoe.client.info()
            return (
                now
                if 0 in now["live_workers"] and nodes[spare].node_id[:8] in now["placement"]["worker0"]
                else None
            )

        info = _wait(rejoined, 120, "worker0 rejoining from the spare Ray node")
        assert info["live_workers"] == [0, 1]
        assert odmoe.watch()["worker0"]["restarted"] is True
        again = odmoe.client.generate(PROMPTS[0], max_new_tokens=NEW)
        assert again.token_ids == want and again.stats["failover"]["events"] == []


def test_launch_role_ray_prints_placement_streams_logs_and_ctrl_c_stops_every_actor(
    ray_nodes, model_dirs, no_node_left, tmp_path
):
    cluster, _ = ray_nodes
    words = [*_words(cluster, model_dirs["mixtral"]), "security.enabled=true"]
    output = tmp_path / "launcher.txt"
    with open(output, "w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "odmoe.launch.cli", "role=ray", *words],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def up() -> bool:  # the placement printed, and a worker's own log line relayed by Ray
            text = output.read_text()
            assert launcher.poll() is None, text
            return "Ctrl-C stops every node" in text and "worker 0 serving on" in text

        _wait(up, 240, "the launcher's placement and a worker's relayed log line")
        lines = output.read_text().splitlines()
        assert any("placed on Ray" in line for line in lines) and any("main at " in line for line in lines)
        for name in ("main", "shadow", "worker0", "worker1"):
            assert any(line.strip().startswith(name) and "ray node" in line for line in lines), name
        relayed = [line for line in lines if "worker 0 serving on" in line]
        assert all("worker0" in line for line in relayed), relayed  # Ray's prefix names the node
        assert ray.get_actor("odmoe-worker0", namespace="odmoe")
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 130
    finally:
        if launcher.poll() is None:
            launcher.kill()
    with pytest.raises(ValueError):
        ray.get_actor("odmoe-worker0", namespace="odmoe")


def test_a_standby_main_on_another_ray_node_takes_over_when_mains_node_goes(
    ray_nodes, model_dirs, no_node_left
):
    """Mains are spread over Ray nodes; the client fails over without Ray when main's node goes."""
    cluster, nodes = ray_nodes
    path = model_dirs["mixtral"]
    want, _ = reference(path, PROMPTS[1], new_tokens=NEW)
    words = [*_words(cluster, path), "ray.standby_mains=1"]
    with RayCluster(compose(["role=ray", *words]), words) as odmoe:
        where = {name: _node_of(nodes, info["node_id"]) for name, info in odmoe.placement.items()}
        assert {where["main"], where["main1"]} == {"main", "main2"}, where
        got = []
        for piece in odmoe.client.stream(PROMPTS[1], max_new_tokens=NEW):
            got.append(piece.token_id)
            if len(got) == 4:
                cluster.remove_node(nodes[where["main"]])
        assert got == want, "the stream after main's Ray node went"
        assert odmoe.watch()["main"] == "dead"
