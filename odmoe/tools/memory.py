"""Peak memory of this process, as the per-node stats report it."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable

# byte sizes live with the memory figures they size (odmoe.node_memory); re-exported for their users
from odmoe.node_memory import parse_bytes  # noqa: F401


def peak_rss_bytes() -> int:
    """This process's peak resident memory: /proc's VmHWM, which belongs to the process's own image.
    Not getrusage's ru_maxrss: Linux carries that across exec from the image before, so a node
    spawned by a large process (a benchmark holding the reference model) reported its parent's peak
    (seen: main at 3252 MiB whose own peak was 601 MiB). ru_maxrss only where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class PeakEvery:
    """The process's peak (`peak_rss_bytes`) read at most once per `every_s`, the last value in
    between: a worker reports its peak in every answer, and reading /proc's status (~45 us) on each
    was 6 % of an in-process decode's time, on main's critical path. A peak reported up to
    `every_s` late only delays when a request's stats see a rise."""

    def __init__(self, every_s: float = 0.1, read: Callable[[], int] = peak_rss_bytes, clock=time.monotonic):
        self.every_s, self.read, self.clock = every_s, read, clock
        self.value, self.at = 0, float("-inf")

    def __call__(self) -> int:
        now = self.clock()
        if now - self.at >= self.every_s:
            self.value, self.at = self.read(), now
        return self.value
