"""Losing any node mid-generation: the request goes on and its tokens equal the reference.

Real processes: faults are injected with the nodes' own `fault.*` trigger (exact point: prefill
with mini-batches in flight, a decode layer) or by signals from the test (between requests, a
running stream). Points are drawn from a seeded RNG and named in the assertion messages.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
import traceback

import grpc
import pytest

from odmoe import LocalCluster
from odmoe.serving.client import MainsLost
from tests.test_batching import PARAMS, alone
from tests.test_batching import PROMPTS as STREAM_PROMPTS
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
        "lab=on",
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


def test_worker_frozen_mid_decode_is_detected_by_its_beats_and_comes_back(
    model_dirs, reap_children, tmp_path
):
    path, record = model_dirs["qwen2_moe"], tmp_path / "fault.jsonl"
    iteration, layer = RNG.randrange(2, 20), RNG.randrange(4)
    overrides = [
        "lab=on",
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
        # its beats go unanswered (~0.9 s), not the heartbeat's 4 s backstop nor the 60 s deadline
        assert 0.5 < detect_s < 3.0 and "beat" in lost["reason"], (detect_s, lost)
        _wait_live(cluster, [0, 1])  # resumed on the same address: the probe takes it back
        assert cluster.client.generate(PROMPTS[0], max_new_tokens=32).token_ids == want


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_shadow_killed_mid_decode_then_restarted_is_used_again(model_dirs, reap_children):
    path = model_dirs["qwen3_moe"]
    iteration = RNG.randrange(2, 20)
    # worker.cache=0: with every expert cached a request would run without the shadow, used or not
    overrides = [
        "lab=on",
        "fault.node=shadow",
        f"fault.iteration={iteration}",
        "worker.cache=0",
        "shadow.precision=fp32",
    ]
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
    """Each load takes 1.5 s, longer than the silence the beats allow (~0.9 s): the worker is busy,
    its beats are answered by a thread of their own, it is not lost."""
    path = model_dirs["mixtral"]
    want, _ = reference(path, [5], new_tokens=2)
    # worker.cache=0: the default cache keeps every expert of this tiny model, so nothing would load
    words = ["lab=on", "emulation.link.latency_ms=1500", "shadow.enabled=false", "worker.cache=0"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        got = cluster.client.generate([5], max_new_tokens=2)
    assert got.token_ids == want
    assert got.stats["failover"]["events"] == [] and got.stats["worker_load_s"] > 1.5


@pytest.mark.extended  # 50 s: beyond the default run's budget, CI runs it
def test_main_killed_then_the_standby_frozen_the_client_resumes_each_time(model_dirs, reap_children):
    path = model_dirs["olmoe"]
    iteration = RNG.randrange(2, 12)
    want, _ = reference(path, PROMPTS[0], new_tokens=40)
    overrides = ["lab=on", "fault.node=main", f"fault.iteration={iteration}"]
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


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
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


class SharedStreams:
    """Streams started at once from threads of their own through one client (as an application
    serving several users holds one SDK client): each one's token ids, the time of each token, and
    the error it ended with."""

    def __init__(self, client, prompts: list[str], new_tokens: int, params: list[int]):
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.times: list[list[float]] = [[] for _ in prompts]
        self.errors: list[BaseException | None] = [None] * len(prompts)
        self.ended = [False] * len(prompts)
        self.progress = threading.Condition()
        self.threads = [
            threading.Thread(target=self._run, args=(client, i, p, new_tokens, params[i]), daemon=True)
            for i, p in enumerate(prompts)
        ]
        for t in self.threads:
            t.start()

    def _run(self, client, i: int, prompt: str, new_tokens: int, params: int) -> None:
        seed, kwargs = PARAMS[params]
        sampling = {"do_sample": True, "seed": seed, **kwargs} if seed is not None else {}
        try:
            for piece in client.stream(prompt, max_new_tokens=new_tokens, **sampling):
                with self.progress:
                    self.tokens[i].append(piece.token_id)
                    self.times[i].append(time.monotonic())
                    self.progress.notify_all()
        except BaseException as exc:
            self.errors[i] = exc
        finally:
            with self.progress:
                self.ended[i] = True
                self.progress.notify_all()

    def wait_past(self, n: int, timeout_s: float = 120.0) -> None:
        """Until every stream has passed its n-th token (fails if one ended before)."""
        with self.progress:
            assert self.progress.wait_for(
                lambda: all(len(t) > n for t in self.tokens) or any(self.ended), timeout_s
            ), f"not every stream passed token {n}: {[len(t) for t in self.tokens]}"
            assert not any(self.ended), f"a stream ended first: {self.tokens}, {self.errors}"

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in self.threads), "a stream never ended"

    def longest_gap_s(self, after: float) -> float:
        """The longest wait between two tokens of a stream that spans `after` (the kill)."""
        return max(b - a for times in self.times for a, b in itertools.pairwise(times) if b > after)


def _tracebacks(errors: list, expected: type | None = None) -> str:
    """What a failed assertion shows: where each unexpected error was raised."""
    unexpected = [e for e in errors if e is not None and not (expected and isinstance(e, expected))]
    return "\n".join("".join(traceback.format_exception(e)) for e in unexpected) or str(errors)


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_one_client_shared_by_threads_fails_over_once_when_main_is_lost(model_dirs, reap_children):
    """Issue 50: four streams from four threads on the cluster's one client, greedy and seeded,
    main SIGKILLed once each has passed its 8th token: the client fails over once and each resumes
    on the standby with its reference tokens. Then the standby is lost too, under four new
    streams: each ends with the same MainsLost (UNAVAILABLE, naming both mains), none KeyError."""
    path, new_tokens = model_dirs["mixtral"], 48
    prompts = [STREAM_PROMPTS[i] for i in (0, 1, 3, 4)]  # none reaches its end within 48 tokens
    params = [0, 1, 2, 3]  # greedy and three seeded samplings
    words = ["server.max_running=4", "shadow.enabled=false"]  # the shadow plays no part here
    started = time.monotonic()
    with LocalCluster(path, workers=2, group_size=2, standby_mains=1, overrides=words) as cluster:
        print(f"cluster up in {time.monotonic() - started:.1f} s")
        client = cluster.client
        streams = SharedStreams(client, prompts, new_tokens, params)
        streams.wait_past(8)
        killed_at = time.monotonic()
        cluster.kill("main")
        streams.join()
        assert streams.errors == [None] * 4, _tracebacks(streams.errors)
        for i, prompt in enumerate(prompts):
            assert tuple(streams.tokens[i]) == alone(path, prompt, new_tokens, params[i]), f"stream {i}"
        assert all(times[-1] > killed_at for times in streams.times), "a stream ended before the kill"
        assert client.failovers == 1, client.failover_log
        assert client.failover_log[0]["lost"] == cluster.main_addresses[0]
        print(f"longest gap a stream saw through main's loss: {streams.longest_gap_s(killed_at):.3f} s")

        again = SharedStreams(client, prompts, new_tokens, params)
        again.wait_past(8)
        killed_at = time.monotonic()
        cluster.kill("main1")
        again.join()
        print(f"every stream gave up {time.monotonic() - killed_at:.2f} s after the standby's loss")
        mains = ", ".join(cluster.main_addresses)
    assert all(isinstance(e, MainsLost) for e in again.errors), _tracebacks(again.errors, MainsLost)
    assert {e.code() for e in again.errors} == {grpc.StatusCode.UNAVAILABLE}  # type: ignore[union-attr]
    assert all(mains in str(e) for e in again.errors)


@pytest.mark.integration
@pytest.mark.extended  # a cluster whose every worker freezes at once: ~1 min here
def test_a_request_waits_out_a_moment_without_any_worker(model_dirs, reap_children):
    """failover.no_worker_grace_s: every worker lost at once (frozen: a home router's hiccup looks the
    same to main) and back within the grace: a request sent meanwhile waits and gets the reference's
    tokens, instead of UNAVAILABLE."""
    path = model_dirs["mixtral"]
    want, _ = reference(path, PROMPTS[0], new_tokens=8)
    words = ["failover.no_worker_grace_s=20"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        assert cluster.client.generate(PROMPTS[0], max_new_tokens=8).token_ids == want
        for name in ("worker0", "worker1"):
            cluster.freeze(name)
        deadline = time.monotonic() + 30
        while cluster.client.info()["live_workers"]:
            assert time.monotonic() < deadline, "main never noticed its workers were gone"
            time.sleep(0.1)
        got: list = []
        asking = threading.Thread(
            target=lambda: got.append(cluster.client.generate(PROMPTS[0], max_new_tokens=8))
        )
        asking.start()
        time.sleep(1.0)  # the request is waiting for a worker
        for name in ("worker0", "worker1"):
            cluster.resume(name)
        asking.join(timeout=60)
        assert got and got[0].token_ids == want
