"""Nodes under real memory limits (launch/memory_cgroups.py): a process beyond its cgroup's limit
is OOM-killed and the report says so, a node sees its limit as the memory it may use, the death
signal survives the cgroup prefix, and a whole LocalCluster runs placed in cgroups with the tokens
it gives without them (the in-process reference's, which tests/test_cluster_fidelity.py holds a
cluster to). Those use real processes and real cgroups, skipped with the reason where this machine
cannot make memory cgroups (not root, no writable memory controller); v2's placement is checked on
a fake mount too, since machines with v1's memory controller cannot run it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from odmoe import LocalCluster
from odmoe.launch.memory_cgroups import CgroupHierarchy, MemoryCgroups
from tests.test_cluster_fidelity import reference

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

MiB, GiB = 2**20, 2**30

UNAVAILABLE = MemoryCgroups.available()
needs_cgroups = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def test_a_node_takes_its_limit_by_name_else_by_its_role():
    cg = MemoryCgroups({"main": 1, "worker": 2, "worker1": 3})
    assert [cg.limit(n) for n in ("main", "main1", "worker0", "worker1", "shadow")] == [1, 1, 2, 3, None]
    assert MemoryCgroups(lambda name: len(name)).limit("shadow") == 6


def fake_hierarchy(tmp_path, own: str, controllers: str, subtree: str):
    """A cgroup v2 mount with this process in `own`: its cgroup.controllers and subtree_control."""
    (tmp_path / "unified").mkdir(parents=True)
    (tmp_path / "unified" / "cgroup.controllers").write_text("cpu memory")
    node = tmp_path / "unified" / own.strip("/")
    node.mkdir(parents=True, exist_ok=True)
    (node / "cgroup.controllers").write_text(controllers)
    (node / "cgroup.subtree_control").write_text(subtree)
    (tmp_path / "self.cgroup").write_text(f"4:cpu:/\n0::{own}\n")
    return lambda: CgroupHierarchy.find(tmp_path, tmp_path / "self.cgroup")


def test_v2_puts_the_nodes_beside_this_process_unless_its_own_cgroup_delegates_memory(tmp_path):
    """v2 allows no process in a cgroup that hands a controller to its children, the root aside."""
    find = fake_hierarchy(tmp_path / "slice", "/user.slice/session.scope", "cpu memory", "")
    unified = tmp_path / "slice" / "unified"
    assert find() == CgroupHierarchy(2, unified / "user.slice", unified / "user.slice/session.scope")
    find = fake_hierarchy(tmp_path / "root", "/", "cpu memory", "cpu memory")
    assert find() == CgroupHierarchy(2, tmp_path / "root" / "unified", tmp_path / "root" / "unified")
    with pytest.raises(OSError, match="memory controller"):
        fake_hierarchy(tmp_path / "none", "/", "hugetlb", "hugetlb")()


def run_in(cg: MemoryCgroups, name: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*cg.prefix(name), sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )


@pytest.mark.integration
@needs_cgroups
def test_beyond_its_limit_a_process_is_oom_killed_and_the_report_says_so():
    with MemoryCgroups({"big": 100 * MiB, "small": 100 * MiB}) as cg:
        big = run_in(cg, "big", "b = bytearray(300 * 2**20)")
        small = run_in(cg, "small", "b = bytearray(20 * 2**20); print(len(b))")
        report = cg.report()
        parent = cg.parent
    assert big.returncode == -9 and report["big"].oom_kills >= 1
    assert report["big"].peak <= report["big"].limit == 100 * MiB
    assert small.returncode == 0 and small.stdout.strip() == str(20 * MiB)
    assert report["small"].oom_kills == 0 and 20 * MiB < report["small"].peak <= 100 * MiB
    assert not parent.exists()


@pytest.mark.integration
@needs_cgroups
def test_a_node_in_a_cgroup_sees_its_limit_as_its_memory():
    code = (
        "import json; from odmoe.node_memory import node_memory; m = node_memory('');"
        "print(json.dumps([m.bytes, m.source]))"
    )
    with MemoryCgroups({"worker": 512 * MiB}) as cg:
        seen = run_in(cg, "worker3", code)  # "worker3" takes the role's limit
    assert seen.returncode == 0, seen.stderr
    assert json.loads(seen.stdout) == [512 * MiB, f"cgroup v{cg.version} limit"]


PARENT = """
import sys, time
from odmoe.launch.spawn import SPAWNER, popen_node
argv = [*sys.argv[1:], sys.executable, "-c", "import time; time.sleep(60)"]
child = SPAWNER.submit(popen_node, argv).result()
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.integration
@needs_cgroups
def test_a_node_placed_in_a_cgroup_still_dies_with_its_launcher():
    """launch/spawn.py arms PR_SET_PDEATHSIG with setpriv, then execs the prefix, which execs the
    node: the signal must survive both execs, and the node keep the pid its launcher knows."""
    with MemoryCgroups({}) as cg:
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT, *cg.prefix("worker0")], stdout=subprocess.PIPE, text=True
        )
        child = psutil.Process(int(parent.stdout.readline()))
        try:
            deadline = time.monotonic() + 10  # the death signal is armed once the node runs
            while child.cmdline()[:1] != [sys.executable] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert str(child.pid) in (cg.path("worker0") / "cgroup.procs").read_text().split()
            parent.kill()
            parent.wait()
            child.wait(timeout=10)  # raises TimeoutExpired if it outlived its launcher
        finally:
            if child.is_running():
                child.kill()


@pytest.mark.integration
@needs_cgroups
@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_a_cluster_in_cgroups_gives_the_same_tokens_and_reports_each_node(reap_children):
    prompt, new_tokens = "def f(x):", 8
    with MemoryCgroups(lambda name: 3 * GiB // 2) as cg:
        with LocalCluster(workers=2, place=cg.place) as c:
            tokens = c.client.generate(prompt, max_new_tokens=new_tokens).token_ids
            report = cg.report(vm_hwm=c.peak_rss_bytes())
            model_path = c.model_path
        parent = cg.parent
    assert not parent.exists()
    assert list(tokens) == reference(model_path, prompt, new_tokens=new_tokens)[0]
    assert set(report) == {"main", "shadow", "worker0", "worker1"}
    for name, node in report.items():
        assert node.limit == 3 * GiB // 2, name
        assert 0 < node.peak <= node.limit and node.oom_kills == 0, (name, node)
        # No order between the two: the cgroup counts the page cache the node brought in, VmHWM the
        # shared libraries' pages the node maps, which another cgroup (this one's) had cached first.
        assert node.vm_hwm, (name, node)
