"""Rate-limited logging of frames a node dropped (malformed, unknown kind, for no such request).

A node treats every incoming frame as untrusted and drops what it cannot use; a peer sending
garbage in a loop must not turn that into a log flood, so at most one line per `interval_s` is
written and the lines say how many drops they stand for.
"""

from __future__ import annotations

import logging
import time


class DropLog:
    def __init__(self, log: logging.Logger, node: str, interval_s: float = 1.0):
        self.log, self.node, self.interval_s = log, node, interval_s
        self.count = 0  # every drop since start
        self._silenced = 0
        self._last = -float("inf")

    def drop(self, reason: object) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._silenced += 1
            return
        more = f" (and {self._silenced} more since the last line)" if self._silenced else ""
        self.log.warning("%s dropped a frame: %.200s%s", self.node, reason, more)
        self._last, self._silenced = now, 0
