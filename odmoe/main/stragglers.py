"""Which workers are stragglers: main's pure judgement from the decode answers it already gets.

Contract: `StragglerWatch.observe(worker, seconds, peers)` takes one decode expert's load + compute
seconds as the worker reported them (`ExpertsResult.load_s` + `compute_s`) and the other live
members of its group, and returns True when the set of stragglers (`slow`) changed; main then tells
every worker (`LiveWorkers.slow`), and placement (odmoe.placement) deals a group's decode experts
over its other members, so main's calls and the workers' preloads agree. No sockets, no clocks: the
caller's numbers in, a set out.

The judgement, and why:
- A worker's time is the median of its last `window` per-expert seconds: one answer held up by a
  busy core (or a page fault, a GC pause) moves a median not at all, where it would drag a mean for
  many answers; per expert, so a worker given two experts of a layer (its slow peer's too) does
  not look slower for it.
- Its reference is the median of its peers' times (peers not themselves stragglers). It becomes a
  straggler once its window is full and its time is above `factor` x that reference: most of its
  last `window` answers were that slow (consistently slower, not once).
- A straggler is still given its share every `probe_every`-th decode iteration (placement's
  probes), so its recovery can be seen: it stops being one after `leave_after` answers in a row
  within `factor` x the reference, its window restarting from them (the window of a worker seldom
  asked would otherwise remember the slow link for many probes).
- A group never loses its last member that is no straggler: with no peer to compare with, or no
  fast peer left, nothing is judged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from statistics import median


@dataclass
class StragglerWatch:
    factor: float = 3.0  # slower than this many times its peers' median: slow
    window: int = 32  # answers a worker's time is the median of (and needed before it is judged)
    leave_after: int = 2  # answers in a row within the factor before a straggler is one no more
    recent: dict[int, deque[float]] = field(default_factory=dict)  # worker -> its last `window` seconds
    slow: frozenset[int] = frozenset()
    changes: int = 0  # how often `slow` changed (the stats' count)
    _fine: dict[int, list[float]] = field(default_factory=dict)  # a straggler's fine answers in a row
    _time: dict[int, float] = field(default_factory=dict)  # worker -> median of `recent`, kept current

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise ValueError(f"straggler factor must be > 1, got {self.factor}")
        if self.window < 1 or self.leave_after < 1:
            raise ValueError(f"straggler answer counts must be >= 1, got {self.window}, {self.leave_after}")

    def time(self, worker: int) -> float | None:
        """The worker's seconds per expert: the median of its last answers (None: none yet)."""
        return self._time.get(worker)

    def observe(self, worker: int, seconds: float, peers: Collection[int]) -> bool:
        """One decode expert's load+compute seconds on `worker`; `peers`: the other live members of
        its group. True when `slow` changed."""
        if seconds < 0:
            return False
        recent = self.recent.setdefault(worker, deque(maxlen=self.window))
        recent.append(seconds)
        self._time[worker] = median(recent)  # once per answer: main calls this for every decode expert
        reference = self.reference(worker, peers)
        if reference is None:
            return False
        if worker in self.slow:
            fine = self._fine.setdefault(worker, [])
            fine[:] = [*fine, seconds] if seconds <= self.factor * reference else []
            if len(fine) < self.leave_after:
                return False
            recent.clear()  # back: its time restarts from its fine answers
            recent.extend(fine)
            self._time[worker] = median(recent)
            del self._fine[worker]
        elif len(recent) < self.window or self._time[worker] <= self.factor * reference:
            return False
        self.slow = self.slow ^ {worker}
        self.changes += 1
        return True

    def reference(self, worker: int, peers: Collection[int]) -> float | None:
        """The median time of `worker`'s peers that are no stragglers (None: none known)."""
        known = [self._time[p] for p in peers if p != worker and p not in self.slow and p in self._time]
        if len(known) < 3:  # groups of 2 or 3: no sorting
            return sum(known) / len(known) if known else None
        return median(known)

    def forget(self, worker: int) -> bool:
        """A worker lost or taken back: judged afresh (True when `slow` changed)."""
        self.recent.pop(worker, None)
        self._time.pop(worker, None)
        self._fine.pop(worker, None)
        if worker in self.slow:
            self.slow = self.slow - {worker}
            self.changes += 1
            return True
        return False

    def report(self) -> dict:
        """What the stats show: the stragglers, each worker's seconds per expert, changes."""
        times = {f"worker{w}": round(t, 6) for w in sorted(self.recent) if (t := self.time(w)) is not None}
        return {"slow": sorted(self.slow), "seconds_per_expert": times, "changes": self.changes}
