"""Continuous batching through real clusters: every request's tokens equal the same request alone.

Main runs up to `server.max_running` requests together (odmoe/main/engine.py); a request's tokens must
not depend on what else runs, when it arrives or when the others leave. References are
transformers' own `generate()` in this process (greedy, or seeded sampling with
`torch.manual_seed`), which a request alone through odmoe equals (tests/test_cluster_fidelity.py).
Schedules are drawn by hypothesis: arrival offsets, prompt, length and sampling parameters.
"""

from __future__ import annotations

import functools
import re
import threading
import time

import grpc
import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from odmoe import Client, LocalCluster
from tests.conftest import FAMILY_NAMES, run_together

pytestmark = pytest.mark.integration

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\nclass Config:\n    ",
    "    return sorted(items, key=",
    "x = [",
    "for i in range(10):\n    print(",
    "class Tree(Node):\n    def __init__(self, children",
]
PARAMS = [  # (seed, sampling parameters); None: greedy
    (None, {}),
    (1, {"temperature": 0.7}),
    (2, {"top_p": 0.85, "top_k": 12}),
    (3, {"temperature": 1.4, "min_p": 0.08}),
]


@functools.cache
def _model(path: str):
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@functools.cache
def alone(path: str, prompt: str, new_tokens: int, params: int) -> tuple[int, ...]:
    """transformers' tokens for this request in one process (what odmoe gives it alone)."""
    model, tokenizer = _model(path)
    seed, kwargs = PARAMS[params]
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=seed is not None,
        max_new_tokens=new_tokens,
        **kwargs,
    )
    return tuple(out[0, ids.shape[1] :].tolist())


def _ask(cluster: LocalCluster, prompt: str, new_tokens: int, params: int):
    seed, kwargs = PARAMS[params]
    sampling = {"do_sample": True, "seed": seed, **kwargs} if seed is not None else {}
    with Client(cluster.address, credentials=cluster.credentials) as client:
        return client.generate(prompt, max_new_tokens=new_tokens, **sampling)


def run_schedule(cluster: LocalCluster, schedule) -> dict[int, object]:
    """Each (delay s, prompt index, new tokens, params index) on its own client thread, at once."""

    def one(delay: float, prompt: int, new_tokens: int, params: int):
        time.sleep(delay)
        return _ask(cluster, PROMPTS[prompt], new_tokens, params)

    return dict(enumerate(run_together([lambda item=item: one(*item) for item in schedule])))


def check(cluster: LocalCluster, path: str, schedule) -> list[dict]:
    results = run_schedule(cluster, schedule)
    for i, (_, prompt, new_tokens, params) in enumerate(schedule):
        want = alone(path, PROMPTS[prompt], new_tokens, params)
        got = tuple(results[i].token_ids)
        assert got == want, f"request {i} of {schedule}: {PROMPTS[prompt]!r}, params {PARAMS[params]}"
    return [r.stats for r in results.values()]


@pytest.fixture(scope="module")
def batching(model_dirs):
    """One speculative cluster of up to 4 running requests, shared by the schedules below."""
    path = model_dirs["mixtral"]
    words = ["server.max_running=4", "alignment.mode=speculative", "prefill.chunk_tokens=4"]
    words.append("worker.cache=0")  # experts loaded for every use: what a batch shares is counted (below)
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        yield cluster, path


def test_simultaneous_requests_decode_together_and_each_equals_alone(batching):
    cluster, path = batching
    schedule = [(0.0, p, 24, p % len(PARAMS)) for p in range(4)]
    stats = check(cluster, path, schedule)
    assert max(s["batch_size_max"] for s in stats) >= 3, "the requests never decoded together"
    # an expert two requests shared was loaded once: each request paid a share
    assert all(s["bytes_loaded"] > 0 and s["exact"] for s in stats)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    schedule=st.lists(
        st.tuples(
            st.floats(0.0, 0.4),  # arrival offset (s): joins mid-stream
            st.integers(0, len(PROMPTS) - 1),
            st.integers(1, 28),  # lengths differ: requests leave mid-stream
            st.integers(0, len(PARAMS) - 1),
        ),
        min_size=2,
        max_size=7,  # beyond max_running: some wait, then join as others leave
    )
)
def test_any_arrival_pattern_gives_every_request_its_alone_tokens(batching, schedule):
    cluster, path = batching
    check(cluster, path, schedule)


def test_a_cancelled_stream_leaves_and_frees_its_place(batching):
    """A client that goes away: its request leaves at the next iteration; the others go on exact."""
    cluster, path = batching
    others: dict[int, object] = {}
    runner = threading.Thread(
        target=lambda: others.update(run_schedule(cluster, [(0.05, 1, 20, 0), (0.1, 2, 20, 1)]))
    )
    with Client(cluster.address, credentials=cluster.credentials) as client:
        stream = client.stream(PROMPTS[0], max_new_tokens=200)
        runner.start()
        got = [next(stream).token_id for _ in range(5)]
        stream.close()  # the client goes away
    runner.join(timeout=120)
    assert got == list(alone(path, PROMPTS[0], 5, 0))
    assert tuple(others[0].token_ids) == alone(path, PROMPTS[1], 20, 0)
    assert tuple(others[1].token_ids) == alone(path, PROMPTS[2], 20, 1)
    deadline = time.monotonic() + 10
    while _metric(cluster, "odmoe:num_requests_running") != 0:  # the cancelled one left too
        assert time.monotonic() < deadline, "the cancelled request kept its place"
        time.sleep(0.1)
    assert _metric(cluster, 'odmoe:requests_total{finish_reason="cancelled"}') >= 1


def _metric(cluster: LocalCluster, name: str) -> float:
    page = httpx.get(f"{cluster.http_url}/metrics", **cluster.http_auth).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", page, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_beyond_the_running_batch_and_the_queue_a_request_is_refused(model_dirs, reap_children):
    """max_running=2 run, max_waiting=1 waits, the fourth gets RESOURCE_EXHAUSTED; all others exact."""
    path = model_dirs["qwen2_moe"]
    words = ["server.max_running=2", "server.max_waiting=1", "shadow.enabled=false"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        cluster.client.generate(PROMPTS[0], max_new_tokens=2)  # warm, and the engine has set its room
        runner = threading.Thread(
            target=lambda: results.update(run_schedule(cluster, [(0, p, 60, 0) for p in range(3)]))
        )
        results: dict[int, object] = {}
        runner.start()
        deadline = time.monotonic() + 30
        while _metric(cluster, "odmoe:num_requests_waiting") < 1:  # two run, the third waits
            assert time.monotonic() < deadline and runner.is_alive(), "the third request never waited"
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as refused:
            cluster.client.generate(PROMPTS[3], max_new_tokens=4)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        runner.join(timeout=120)
    for p in range(3):
        assert tuple(results[p].token_ids) == alone(path, PROMPTS[p], 60, 0)


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_a_worker_killed_while_several_streams_run(model_dirs, reap_children):
    """Every stream ends with its alone tokens: the lost worker's calls (every request's rows) are
    re-sent to the other group member."""
    path = model_dirs["olmoe"]
    words = ["server.max_running=4", "alignment.mode=speculative"]
    schedule = [(0.0, p, 40, p % len(PARAMS)) for p in range(4)]
    with LocalCluster(path, workers=4, group_size=2, overrides=words) as cluster:
        killer = threading.Timer(0.6, cluster.kill, args=("worker1",))
        killer.start()
        stats = check(cluster, path, schedule)
        killer.join()
    lost = [e for s in stats for e in s["failover"]["events"] if e["event"] == "lost"]
    assert lost, "the worker was killed after every stream had ended: nothing was tested"


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_the_shadow_killed_while_several_streams_run(model_dirs, reap_children):
    path = model_dirs["qwen3_moe"]
    schedule = [(0.0, p, 40, p % len(PARAMS)) for p in range(4)]
    with LocalCluster(path, workers=2, group_size=2, overrides=["server.max_running=4"]) as cluster:
        killer = threading.Timer(0.5, cluster.kill, args=("shadow",))
        killer.start()
        check(cluster, path, schedule)
        killer.join()
        check(cluster, path, schedule[:2])  # and on without it


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_the_active_main_killed_while_several_streams_run_each_resumes_on_the_standby(
    model_dirs, reap_children
):
    """Each client resumes on the standby with the tokens it had; greedy and seeded alike."""
    path = model_dirs["mixtral"]
    schedule = [(0.0, p, 40, p % len(PARAMS)) for p in range(3)]
    with LocalCluster(path, workers=2, group_size=2, standby_mains=1) as cluster:
        results: dict[int, list[int]] = {}

        def one(i: int, prompt: int, params: int) -> None:
            seed, kwargs = PARAMS[params]
            sampling = {"do_sample": True, "seed": seed, **kwargs} if seed is not None else {}
            with Client(cluster.main_addresses, credentials=cluster.credentials) as client:
                results[i] = [
                    p.token_id for p in client.stream(PROMPTS[prompt], max_new_tokens=40, **sampling)
                ]

        threads = [threading.Thread(target=one, args=(i, p, q)) for i, (_, p, _, q) in enumerate(schedule)]
        for t in threads:
            t.start()
        time.sleep(0.8)
        cluster.kill("main")
        for t in threads:
            t.join(timeout=180)
    for i, (_, prompt, n, params) in enumerate(schedule):
        assert tuple(results[i]) == alone(path, PROMPTS[prompt], n, params), f"stream {i}"


@pytest.mark.extended  # every family: beyond the default run's time budget, CI runs it
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_batched_equals_alone(family, model_dirs, reap_children):
    path = model_dirs[family]
    schedule = [(0.05 * i, i, 16 + 4 * i, i % len(PARAMS)) for i in range(4)]
    with LocalCluster(path, workers=2, group_size=2, overrides=["server.max_running=4"]) as cluster:
        stats = check(cluster, path, schedule)
    assert max(s["batch_size_max"] for s in stats) >= 2


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_the_kv_cache_budget_makes_requests_wait_and_refuses_one_that_never_fits(model_dirs, reap_children):
    """server.kv_cache_memory: requests whose prompt + max_new_tokens would not fit beside the
    running ones wait (they run one after another here); one that alone exceeds it is refused."""
    path = model_dirs["mixtral"]
    # the tiny model's cache: 4 layers x 2 (K, V) x 2 heads x 16 dims x 4 bytes = 1 KiB per position
    words = ["server.max_running=4", "server.kv_cache_memory=60KiB", "shadow.enabled=false"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        cluster.client.generate(PROMPTS[0], max_new_tokens=2)  # measures the cache's bytes per position
        stats = check(cluster, path, [(0.0, p, 40, 0) for p in range(3)])  # ~45 positions each
        assert max(s["batch_size_max"] for s in stats) == 1, "two requests ran beyond the budget"
        with pytest.raises(grpc.RpcError) as refused:
            cluster.client.generate(PROMPTS[0], max_new_tokens=80)  # ~85 positions: never fits
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "kv_cache_memory" in refused.value.details()


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_a_lossy_policy_decides_per_request_in_a_batch(model_dirs, reap_children):
    """Opt-in lossy: with wrong predictions injected, batched requests each substitute from their
    own router scores, count their own substitutions and say they are not exact."""
    path = model_dirs["qwen2_moe"]
    words = [
        "lab=on",
        "server.max_running=4",
        "miss.policy=importance",
        "miss.importance_alpha=50",
        "miss.budget=8",
        "emulation.inject_wrong=0.5",
    ]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        results = run_schedule(cluster, [(0.0, p, 24, 0) for p in range(4)])
    stats = [r.stats for r in results.values()]
    assert max(s["batch_size_max"] for s in stats) >= 2
    assert all(s["substitutions"] == sum(s["substitutions_per_layer"].values()) for s in stats)
    assert any(s["substitutions"] > 0 and not s["exact"] for s in stats)
