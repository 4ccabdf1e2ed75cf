"""Fault injection: a node kills or freezes itself at an exact point of a request (the lab overlay's
`fault.*`, with `lab=on`: tests and benchmarks only).

Contract: each node builds `FaultTrigger(fault_of(cfg), its_name)` ("main", "shadow", "worker<i>") and
calls `at(request, iteration, layer, part)` at every point it passes (main per MoE layer before it
sends the rows, a worker per compute message before it computes, the shadow per router). The first
point at or past the configured one - in the node's n-th request - fires, once: it appends a JSON
line to `fault.record` (what and when, wall clock, so a benchmark can time detection against it),
then SIGKILLs or SIGSTOPs the process, or (`raise`) raises InjectedFault there: an unexpected
error inside the node, the stand-in for a bug, to check that the node fails loudly, not silently.
A freeze with `resume_after_s` leaves behind a detached `sleep; kill -CONT`, since a stopped
process cannot wake itself. "At or past" rather than "at":
a worker is not asked for every layer, and the fault must still land.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from odmoe.config import FaultConfig
from odmoe.tools.trace import now_us


class InjectedFault(RuntimeError):
    """`fault.action=raise`: an error where none is expected."""


class FaultTrigger:
    def __init__(self, fault: FaultConfig, node: str):
        self.fault, self.node = fault, node
        self.armed = bool(fault.node) and fault.node == node
        self._requests: dict[str, int] = {}  # request id -> its order of arrival (1-based)

    def matches(self, request: str, iteration: int, layer: int, part: int = 0) -> bool:
        """Pure: is this point at or past the configured one?"""
        if not self.armed:
            return False
        nth = self._requests.setdefault(request, len(self._requests) + 1)
        f = self.fault
        return nth == f.request and (iteration, layer) >= (f.iteration, f.layer) and part >= f.part

    def at(self, request: str, iteration: int, layer: int, part: int = 0) -> None:
        if self.armed and self.matches(request, iteration, layer, part):
            self.armed = False
            self.fire(request=request, iteration=iteration, layer=layer, part=part)

    def fire(self, **where) -> None:
        f = self.fault
        if f.record:
            line = {"node": self.node, "action": f.action, "at_us": now_us(), "pid": os.getpid(), **where}
            with Path(f.record).open("a") as out:
                out.write(json.dumps(line) + "\n")
        if f.action == "raise":
            raise InjectedFault(f"fault.action=raise at {where} ({self.node})")
        if f.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f.resume_after_s > 0:
            subprocess.Popen(
                ["sh", "-c", f"sleep {f.resume_after_s}; kill -CONT {os.getpid()}"],
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        os.kill(os.getpid(), signal.SIGSTOP)
