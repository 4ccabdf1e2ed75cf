"""How a launcher starts a node program as a child process (LocalCluster, and role=ray's actors).

Why one long-lived spawner thread: PR_SET_PDEATHSIG fires when the *thread* that forked the child
ends, not its process. A node (re)started from a short-lived thread (a test's or the soak's chaos
thread, a Ray actor's task) was SIGTERMed as soon as that thread returned. Every node is therefore
forked by the one thread of SPAWNER, and dies with the process that started it.

Why `setpriv` rather than a `preexec_fn`: a preexec_fn makes Python fork the launcher, and fork
runs the handlers of every library the launcher has loaded in the child; gRPC's (once the launcher
has used gRPC, as every benchmark and test does) restarts its poller there, which then meets the
file descriptors Popen closes before exec and aborts the child (SIGABRT, "epoll_wait error: Bad
file descriptor": grpc/grpc#43055; a node "exited with code -6 while starting" in CI). With
util-linux's `setpriv --pdeathsig` the child sets its death signal itself, after exec, and Python
starts it with vfork, which runs no fork handlers. `die_with_parent` is the fallback without setpriv.
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

_PR_SET_PDEATHSIG = 1
SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="odmoe-spawn")


class ClusterStartError(RuntimeError):
    """A node failed to start or did not come up in time; the message names it."""


def die_with_parent() -> None:
    """preexec_fn of a node's Popen: SIGTERM it when its parent goes."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


SETPRIV = shutil.which("setpriv")


def popen_node(argv: list[str], **kwargs) -> subprocess.Popen:
    """Start a node program that dies (SIGTERM) with the thread that started it. Call on SPAWNER."""
    if SETPRIV:
        return subprocess.Popen([SETPRIV, "--pdeathsig", "TERM", "--", *argv], **kwargs)
    return subprocess.Popen(argv, preexec_fn=die_with_parent, **kwargs)
