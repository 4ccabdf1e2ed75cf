"""How launchers start node programs (launch/spawn.py): the child dies with its parent, and no
fork handler of the parent's libraries runs in it (gRPC's aborted node starts: grpc/grpc#43055)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from odmoe.launch.spawn import SETPRIV, popen_node

PARENT = """
import sys, time
from odmoe.launch.spawn import SPAWNER, popen_node
child = SPAWNER.submit(popen_node, [sys.executable, "-c", "import time; time.sleep(60)"]).result()
print(child.pid, flush=True)
time.sleep(60)
"""


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_node_dies_with_the_process_that_started_it():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        assert child.is_running()
        # setpriv arms the death signal, then execs the node: kill the parent only once it has
        # (before that, under load, the parent's death could come first and nothing would be armed)
        deadline = time.monotonic() + 10
        while "setpriv" in " ".join(child.cmdline()) and time.monotonic() < deadline:
            time.sleep(0.01)
        parent.kill()
        parent.wait()
        # dead within 10 s: gone, or a zombie nobody has reaped yet (a container's PID 1 may reap
        # late: once seen under load, the child died but psutil's wait timed out on its zombie)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the node outlived the process that started it"
    finally:
        if child.is_running():
            child.kill()


@pytest.mark.skipif(SETPRIV is None, reason="util-linux's setpriv is not installed")
def test_a_node_is_started_without_forking_the_launcher(monkeypatch):
    """No preexec_fn: Python spawns with vfork, which runs no pthread_atfork handlers."""
    seen = {}
    real = subprocess.Popen

    def record(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", record)
    process = popen_node([sys.executable, "-c", "pass"])
    assert process.wait(timeout=30) == 0
    assert seen.get("preexec_fn") is None
