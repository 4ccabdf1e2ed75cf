"""Peak memory of this process, as the per-node stats report it."""

from __future__ import annotations

import resource

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
