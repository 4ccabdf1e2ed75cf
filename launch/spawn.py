"""How a launcher starts a node program as a child process (LocalCluster, and role=ray's actors).

Why one long-lived spawner thread: PR_SET_PDEATHSIG fires when the *thread* that forked the child
ends, not its process. A node (re)started from a short-lived thread (a test's or the soak's chaos
thread, a Ray actor's task) was SIGTERMed as soon as that thread returned. Every node is therefore
forked by the one thread of SPAWNER, and dies with the process that started it.
"""

from __future__ import annotations

import ctypes
import signal
from concurrent.futures import ThreadPoolExecutor

_PR_SET_PDEATHSIG = 1
SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="odmoe-spawn")


class ClusterStartError(RuntimeError):
    """A node failed to start or did not come up in time; the message names it."""


def die_with_parent() -> None:
    """preexec_fn of a node's Popen: SIGTERM it when its parent goes."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
