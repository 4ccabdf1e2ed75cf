"""Bad input gets a clear error and leaves nothing running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import psutil
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from odmoe import LocalCluster
from odmoe.launch.local_cluster import ClusterStartError
from odmoe.models.checkpoint import CheckpointError
from odmoe.models.families import UnsupportedModelError
from odmoe.rpc import odmoe_pb2

pytestmark = pytest.mark.integration
LAUNCH = [sys.executable, "-m", "odmoe.launch.cli"]


def test_missing_model_dir(tmp_path, reap_children):
    with pytest.raises(CheckpointError, match="does not exist"):
        LocalCluster(str(tmp_path / "nope"))


def test_dense_checkpoint_is_not_moe(tmp_path, reap_children):
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="not supported"):
        LocalCluster(str(tmp_path))


def test_workers_not_divisible_by_group_size(model_dirs):
    with pytest.raises(ValueError, match="not divisible"):
        LocalCluster(model_dirs["mixtral"], workers=3, group_size=2)


def test_bad_requests_get_invalid_argument(model_dirs, reap_children):
    with LocalCluster(model_dirs["mixtral"], workers=1, group_size=1) as cluster:
        for prompt, new, match in [("", 4, "empty"), ("x", 0, "at least 1"), ("x", 10_000, "context")]:
            with pytest.raises(grpc.RpcError) as err:
                cluster.client.generate(prompt, max_new_tokens=new)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert match in err.value.details()
        # text that is not UTF-8 in a string field (sent as raw bytes: protobuf refuses to build
        # it): INVALID_ARGUMENT naming the field, not gRPC's "Exception deserializing request!"
        creds = cluster.credentials
        with creds.channel(cluster.address) as channel:
            generate = channel.unary_stream("/odmoe.rpc.Inference/Generate")
            for fields, field in [({"prompt": "okay"}, "prompt"), ({"stop": ["okay"]}, "stop[0]")]:
                raw = odmoe_pb2.GenerateRequest(max_new_tokens=3, **fields).SerializeToString()
                bad = raw.replace(b"okay", b"o\xed\xa0\x80")  # a surrogate written as UTF-8 (same length)
                with pytest.raises(grpc.RpcError) as err:
                    list(generate(bad, metadata=creds.metadata, timeout=30))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith(f"{field} is not valid UTF-8"), err.value.details()
        with pytest.raises(ValueError, match="prompt is not valid Unicode"):  # refused before it is sent
            cluster.client.generate("\ud800abc", max_new_tokens=3)
        # the cluster still serves after rejecting bad requests
        assert len(cluster.client.generate("def f():", max_new_tokens=3).token_ids) == 3


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_no_live_worker_gives_unavailable_naming_the_layer_at_once(model_dirs, reap_children):
    with LocalCluster(model_dirs["mixtral"], workers=2, group_size=2) as cluster:
        for name in ("worker0", "worker1"):
            cluster.kill(name)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            cluster.client.generate("def f():", max_new_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no live worker holds layer 0" in err.value.details()
        assert time.monotonic() - start < 10  # not the 60 s reply deadline


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_port_in_use_is_reported(model_dirs, reap_children):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ClusterStartError, match="cannot bind"):
            with LocalCluster(
                model_dirs["mixtral"], workers=1, group_size=1, overrides=[f"cluster.main_port={port}"]
            ):
                pass


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_main_names_a_worker_that_never_comes_up(model_dirs, reap_children):
    with socket.socket() as s:  # a port with nobody behind it
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    proc = subprocess.run(
        [
            *LAUNCH,
            "role=main",
            f"model.path={model_dirs['mixtral']}",
            "cluster.workers=1",
            "cluster.group_size=1",
            f"cluster.worker_addresses=[tcp://127.0.0.1:{free}]",
            "worker.ready_timeout_s=2",
            "security.enabled=false",  # a bare role=main on loopback: no key directory needed
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "worker(s) [0]" in proc.stderr


def test_cli_rejects_bad_config_with_exit_code_2(reap_children):
    proc = subprocess.run(
        [*LAUNCH, "role=local", "cluster.workers=3", "cluster.group_size=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "not divisible" in proc.stderr


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _cmdline(p: psutil.Process) -> list[str]:
    """A short-lived helper child may be gone (or a zombie) by the time we look: not a node."""
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return []


def _children_after_cluster_up(proc: subprocess.Popen, timeout: float = 180) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    launcher = psutil.Process(proc.pid)
    while time.monotonic() < deadline:
        kids = [k for k in launcher.children(recursive=True) if _alive(k)]
        if any("role=main" in " ".join(_cmdline(k)) for k in kids):  # main starts last
            return kids
        time.sleep(0.2)
    raise AssertionError("cluster processes never appeared")


@pytest.mark.parametrize("how", ["sigint", pytest.param("sigkill", marks=pytest.mark.extended)])
def test_no_orphans_after_ctrl_c_or_launcher_death(model_dirs, how, reap_children):
    proc = subprocess.Popen(
        [*LAUNCH, "role=local", f"model.path={model_dirs['mixtral']}", "max_new_tokens=200"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kids = _children_after_cluster_up(proc)
    time.sleep(1)
    os.kill(proc.pid, signal.SIGINT if how == "sigint" else signal.SIGKILL)
    proc.wait(timeout=60)
    _, alive = psutil.wait_procs(kids, timeout=20)
    assert not alive, f"orphans after {how}: {[k.pid for k in alive]}"


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_cli_rejects_cpus_it_cannot_run_on_with_exit_code_2(reap_children):
    proc = subprocess.run(
        [*LAUNCH, "role=local", "cluster.cpus=[99999]"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "cluster.cpus=[99999]" in proc.stderr


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_spread_workers_puts_each_worker_on_a_core_of_its_own(model_dirs, reap_children):
    """cluster.spread_workers: worker i runs on the i-th of the launcher's CPUs (mod their count), its
    threads (ZeroMQ's, torch's) with it; main stays free."""
    cpus = sorted(os.sched_getaffinity(0))
    with LocalCluster(
        model_dirs["mixtral"], overrides=["cluster.spread_workers=true", "shadow.enabled=false"]
    ) as cluster:
        for i in range(2):
            worker = psutil.Process(cluster.node(f"worker{i}").process.pid)
            assert worker.cpu_affinity() == [cpus[i % len(cpus)]]
            assert {t.id for t in worker.threads()} and all(
                os.sched_getaffinity(t.id) == {cpus[i % len(cpus)]} for t in worker.threads()
            )
        assert set(psutil.Process(cluster.node("main").process.pid).cpu_affinity()) == set(cpus)
        assert cluster.client.generate([1, 2, 3], max_new_tokens=3).token_ids


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_a_niced_shadow_runs_at_that_priority_and_the_others_do_not(model_dirs, reap_children):
    """shadow.nice: the shadow process (and the threads it starts) at that nice value; the words
    reach every node, only the shadow applies it."""
    with LocalCluster(model_dirs["mixtral"], overrides=["shadow.nice=7"]) as cluster:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        shadow = psutil.Process(cluster.node("shadow").process.pid)
        assert shadow.nice() == base + 7
        assert psutil.Process(cluster.node("main").process.pid).nice() == base
        assert psutil.Process(cluster.node("worker0").process.pid).nice() == base
        assert cluster.client.generate([1, 2, 3], max_new_tokens=3).token_ids


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_a_started_cluster_entered_with_with_is_not_started_twice(model_dirs, reap_children):
    """`with LocalCluster(...).start() as c:` used to spawn a second set of nodes beside the first
    (the client talked to the second while the first idled until stop)."""
    cluster = LocalCluster(model_dirs["mixtral"], workers=1, group_size=1).start()
    pids = cluster.pids
    with cluster as again:
        assert again is cluster and cluster.pids == pids
        assert cluster.client.generate("def f(x):", max_new_tokens=2).token_ids
    assert cluster.pids == []
