"""Losing any node mid-generation: the request goes on and its tokens equal the reference.

Real processes: faults are injected with the nodes' own `fault.*` trigger (exact point: prefill
with mini-batches in flight, a decode layer) or by signals from the test (between requests, a
running stream). Points are drawn from a seeded RNG and named in the assertion messages.
"""

from __future__ import annotations

import json
import random
import time

import grpc
import pytest

from odmoe import LocalCluster
from tests.test_cluster_fidelity import PROMPTS, reference

pytestmark = pytest.mark.integration
RNG = random.Random(10)


def _events(stats: dict, kind: str) -> list[dict]:
    return [e for e in stats["failover"]["events"] if e["event"] == kind]


def _wait_live(cluster: LocalCluster, live: list[int], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while cluster.client.info()["live_workers"] != live:
        assert time.monotonic() < deadline, f"live workers never became {live}"
        time.sleep(0.2)


def _fired(record) -> dict:
    (line,) = record.read_text().splitlines()
    return json.loads(line)


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_worker_killed_during_prefill_with_mini_batches_in_flight_then_rejoins(
    model_dirs, reap_children, tmp_path
):
    path, record = model_dirs["mixtral"], tmp_path / "fault.jsonl"
    overrides = [
        "prefill.mini_batch=2",
        "fault.node=worker1",
        "fault.iteration=0",
        "fault.part=1",  # its first part is in, the rest are not
        f"fault.record={record}",
    ]
    want, _ = reference(path, PROMPTS[1])
    with LocalCluster(path, workers=4, group_size=2, overrides=overrides) as cluster:
        got = cluster.client.generate(PROMPTS[1], max_new_tokens=32)
        assert got.token_ids == want
        (lost,) = _events(got.stats, "lost")
        assert lost["worker"] == 1 and got.stats["failover"]["resent_calls"] > 0
        assert (lost["at_us"] - _fired(record)["at_us"]) / 1e6 < 1.0  # a kill resets the connection
        cluster.restart("worker1")  # a new port: it announces itself to main
        _wait_live(cluster, [0, 1, 2, 3])
        again = cluster.client.generate(PROMPTS[1], max_new_tokens=32)
        assert again.token_ids == want and "worker1" in again.stats["peak_rss_bytes"]


def test_worker_frozen_mid_decode_is_detected_by_heartbeat_and_comes_back(
    model_dirs, reap_children, tmp_path
):
    path, record = model_dirs["qwen2_moe"], tmp_path / "fault.jsonl"
    iteration, layer = RNG.randrange(2, 20), RNG.randrange(4)
    overrides = [
        "fault.node=worker0",
        "fault.action=stop",
        f"fault.iteration={iteration}",
        f"fault.layer={layer}",
        "fault.resume_after_s=4",
        f"fault.record={record}",
    ]
    want, _ = reference(path, PROMPTS[0])
    with LocalCluster(path, workers=2, group_size=2, overrides=overrides) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=32)
        assert got.token_ids == want, f"frozen at iteration {iteration} layer {layer}"
        (lost,) = _events(got.stats, "lost")
        detect_s = (lost["at_us"] - _fired(record)["at_us"]) / 1e6
        assert 0.5 < detect_s < 3.0, detect_s  # heartbeat 0.2 s + timeout 1 s, not the 60 s deadline
        _wait_live(cluster, [0, 1])  # resumed on the same address: the probe takes it back
        assert cluster.client.generate(PROMPTS[0], max_new_tokens=32).token_ids == want


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_shadow_killed_mid_decode_then_restarted_is_used_again(model_dirs, reap_children):
    path = model_dirs["qwen3_moe"]
    iteration = RNG.randrange(2, 20)
    # worker.cache=0: with every expert cached a request would run without the shadow, used or not
    overrides = ["fault.node=shadow", f"fault.iteration={iteration}", "worker.cache=0"]
    want, _ = reference(path, PROMPTS[2])
    with LocalCluster(path, workers=2, group_size=2, overrides=overrides) as cluster:
        got = cluster.client.generate(PROMPTS[2], max_new_tokens=32)
        assert got.token_ids == want, f"shadow killed at iteration {iteration}"
        assert cluster.client.generate(PROMPTS[2], max_new_tokens=32).stats["shadow"] is False
        cluster.restart("shadow")
        again = cluster.client.generate(PROMPTS[2], max_new_tokens=32)
        assert again.token_ids == want and again.stats["shadow"] is True
        assert again.stats["recall"]["overall"] == 1.0  # an exact (fp32) shadow, aligned again
        cluster.freeze("shadow")  # between requests, and during the next one
        assert cluster.client.generate(PROMPTS[2], max_new_tokens=32).token_ids == want
        cluster.resume("shadow")


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_a_slow_load_is_not_a_lost_worker(model_dirs, reap_children):
    """Each load takes 1.5 s, longer than the heartbeat timeout: the worker is busy, not lost."""
    path = model_dirs["mixtral"]
    want, _ = reference(path, [5], new_tokens=2)
    words = ["emulation.link.latency_ms=1500", "shadow.enabled=false"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        got = cluster.client.generate([5], max_new_tokens=2)
    assert got.token_ids == want
    assert got.stats["failover"]["events"] == [] and got.stats["worker_load_s"] > 1.5


@pytest.mark.extended  # 50 s: beyond the default run's budget, CI runs it
def test_main_killed_then_the_standby_frozen_the_client_resumes_each_time(model_dirs, reap_children):
    path = model_dirs["olmoe"]
    iteration = RNG.randrange(2, 12)
    want, _ = reference(path, PROMPTS[0], new_tokens=40)
    overrides = ["fault.node=main", f"fault.iteration={iteration}"]
    with LocalCluster(path, workers=2, group_size=2, overrides=overrides, standby_mains=1) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=40)
        assert got.token_ids == want, f"main killed at iteration {iteration}"
        # the tokens streamed before the kill (the last one may not have left main)
        assert cluster.client.failovers == 1 and 0 < got.stats["resumed_tokens"] <= iteration + 1
        cluster.restart("main")
        tokens = []
        for i, piece in enumerate(cluster.client.stream(PROMPTS[0], max_new_tokens=40)):
            tokens.append(piece.token_id)
            if i == 5:
                cluster.freeze("main1")  # the one now serving: frozen, not dead
        assert tokens == want and cluster.client.failovers == 2


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_only_own_layers_replication_decides_what_a_lost_group_costs(model_dirs, reap_children):
    path = model_dirs["mixtral"]
    want, _ = reference(path, PROMPTS[0], new_tokens=8)
    one = ["worker.only_own_layers=true", "worker.replicas=1"]
    with LocalCluster(path, workers=4, group_size=2, overrides=one) as cluster:
        cluster.kill("worker2")
        cluster.kill("worker3")  # group 1, the only holder of layers 1 and 3
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            cluster.client.generate(PROMPTS[0], max_new_tokens=8)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "layer 1" in err.value.details() and time.monotonic() - start < 10
    two = ["worker.only_own_layers=true", "worker.replicas=2"]
    with LocalCluster(path, workers=4, group_size=2, overrides=two) as cluster:
        cluster.kill("worker2")
        cluster.kill("worker3")
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=8)
        assert got.token_ids == want and got.stats["failover"]["live_workers"] == [0, 1]


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_a_cancelled_stream_frees_the_cluster_for_the_next_request(model_dirs, reap_children):
    path = model_dirs["qwen2_moe"]
    want, _ = reference(path, PROMPTS[1], new_tokens=8)
    with LocalCluster(path, workers=2, group_size=2) as cluster:
        stream = cluster.client.stream(PROMPTS[0], max_new_tokens=200)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        start = time.monotonic()
        got = cluster.client.generate(PROMPTS[1], max_new_tokens=8)
        assert got.token_ids == want
        assert time.monotonic() - start < 5  # not queued behind 196 more tokens
        assert "cancelled by its client" in cluster.node("main").log_file.read_text()


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_a_node_restarted_from_a_short_lived_thread_keeps_running(model_dirs, reap_children):
    """PR_SET_PDEATHSIG follows the forking thread: this node used to die with its thread."""
    import threading

    words = ["shadow.enabled=false"]
    with LocalCluster(model_dirs["mixtral"], workers=2, group_size=2, overrides=words) as c:
        thread = threading.Thread(target=c.restart, args=("worker1",))
        thread.start()
        thread.join()
        time.sleep(2)
        assert c.node("worker1").process.poll() is None


def test_main_stopped_with_requests_waiting_exits_and_they_get_unavailable(model_dirs, reap_children):
    """A handler waiting for a stopped engine used to keep main alive forever after SIGTERM."""
    import signal
    import threading

    import odmoe

    codes, words = [], ["shadow.enabled=false"]
    first_token = threading.Event()
    with LocalCluster(model_dirs["mixtral"], workers=2, group_size=2, overrides=words) as c:

        def ask() -> None:
            try:
                with odmoe.Client(c.address, credentials=c.credentials) as client:
                    for _ in client.stream(PROMPTS[0], max_new_tokens=200):
                        first_token.set()
            except grpc.RpcError as exc:
                codes.append(exc.code())

        # one runs, two wait in the queue; SIGTERM once the first is streaming, not after a fixed
        # sleep: 200 tokens of this model now take ~1.4 s, and a fixed 1.5 s let them all finish
        threads = [threading.Thread(target=ask) for _ in range(3)]
        for t in threads:
            t.start()
        assert first_token.wait(timeout=60)
        time.sleep(0.2)
        main = c.node("main").process
        main.send_signal(signal.SIGTERM)
        main.wait(timeout=20)
        for t in threads:
            t.join(timeout=30)
    assert grpc.StatusCode.UNAVAILABLE in codes
