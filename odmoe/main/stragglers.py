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

With worker caches (homes), main feeds only the answers that loaded (a cache hit has no load time,
and mixing hits into a median would make it the hit rate's), load + compute: a slow link shows in
its loads, a slow core in every loaded answer. A straggler's homes move to its peers
(odmoe.placement's `slow_rooms`) only when that pays, by `home_move`: the move's cost is the
reloads it causes (every expert whose home changes is uncached at its new home: each one load at the
peers' measured seconds per expert), its saving the straggler's measured extra seconds per token
(its time above its peers', times its loaded answers per decode iteration) over the next `horizon`
tokens, less what its hits will cost at their new homes where the peers have no room to keep them
(`lost_hits`: each such hit a load there, at the peers' seconds). The room a straggler keeps is its
room times its measured speed against its peers (`straggler_room`). Back, when it recovers, always:
that move only undoes one that paid.
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
    # worker -> the decode iteration (main's running count) of each answer in `recent`: its rate
    _at: dict[int, deque[int]] = field(default_factory=dict)
    _hits: dict[int, deque[int]] = field(default_factory=dict)  # worker -> decode iteration of its last hits
    # the home moves weighed (`HomeMove.report`), the latest 8
    moves: deque[dict] = field(default_factory=lambda: deque(maxlen=8))

    def __post_init__(self) -> None:
        if not self.factor > 1:
            raise ValueError(f"straggler factor must be > 1, got {self.factor}")
        if self.window < 1 or self.leave_after < 1:
            raise ValueError(f"straggler answer counts must be >= 1, got {self.window}, {self.leave_after}")

    def time(self, worker: int) -> float | None:
        """The worker's seconds per expert: the median of its last answers (None: none yet)."""
        return self._time.get(worker)

    def observe(self, worker: int, seconds: float, peers: Collection[int], at: int = 0) -> bool:
        """One decode expert's load+compute seconds on `worker`; `peers`: the other live members of
        its group; `at`: main's count of decode iterations so far (for `per_token`). True when
        `slow` changed."""
        if seconds < 0:
            return False
        recent = self.recent.setdefault(worker, deque(maxlen=self.window))
        recent.append(seconds)
        self._at.setdefault(worker, deque(maxlen=self.window)).append(at)
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
            stamps = list(self._at[worker])[-len(fine) :]
            self._at[worker].clear()
            self._at[worker].extend(stamps)
            self._time[worker] = median(recent)
            del self._fine[worker]
        elif len(recent) < self.window or self._time[worker] <= self.factor * reference:
            return False
        self.slow = self.slow ^ {worker}
        self.changes += 1
        return True

    def hit(self, worker: int, at: int) -> None:
        """A cache hit on `worker` at decode iteration `at` (no load to judge, but a hit a move may lose)."""
        self._hits.setdefault(worker, deque(maxlen=self.window)).append(at)

    def per_token(self, worker: int) -> float:
        """The worker's judged answers per decode iteration over its last `window` (0: fewer than two)."""
        return _rate(self._at.get(worker))

    def hits_per_token(self, worker: int) -> float:
        """The worker's cache hits per decode iteration over its last `window` (0: fewer than two)."""
        return _rate(self._hits.get(worker))

    def extra_per_token(self, worker: int, peers: Collection[int]) -> float:
        """Seconds a token the worker costs beyond its peers: (its time - theirs) x its answers a token."""
        time, reference = self.time(worker), self.reference(worker, peers)
        if time is None or reference is None:
            return 0.0
        return max(0.0, time - reference) * self.per_token(worker)

    def reference(self, worker: int, peers: Collection[int]) -> float | None:
        """The median time of `worker`'s peers that are no stragglers (None: none known)."""
        known = [self._time[p] for p in peers if p != worker and p not in self.slow and p in self._time]
        if len(known) < 3:  # groups of 2 or 3: no sorting
            return sum(known) / len(known) if known else None
        return median(known)

    def forget(self, worker: int) -> bool:
        """A worker lost or taken back: judged afresh (True when `slow` changed)."""
        tables: tuple[dict, ...] = (self.recent, self._at, self._hits, self._time, self._fine)
        for table in tables:
            table.pop(worker, None)
        if worker in self.slow:
            self.slow = self.slow - {worker}
            self.changes += 1
            return True
        return False

    def report(self) -> dict:
        """What the stats show: the stragglers, each worker's seconds per expert, changes."""
        times = {f"worker{w}": round(t, 6) for w in sorted(self.recent) if (t := self.time(w)) is not None}
        report = {"slow": sorted(self.slow), "seconds_per_expert": times, "changes": self.changes}
        if self.moves:
            report["home_moves"] = list(self.moves)
        return report


@dataclass(frozen=True)
class HomeMove:
    """Whether to move a straggler's homes: what it costs against what it saves, in seconds."""

    worker: int
    reloads: int  # experts whose home changes (each uncached at its new home: one load)
    move_s: float  # reloads x the peers' seconds per loaded expert
    extra_s_per_token: float  # what the straggler costs a token now (measured)
    horizon: int  # tokens the move must pay for itself within
    room: int  # the room it is dealt by after the move
    # its hits a token that become loads at peers with no room for them, x the peers' seconds a load
    added_s_per_token: float = 0.0

    @property
    def saving_s(self) -> float:
        return (self.extra_s_per_token - self.added_s_per_token) * self.horizon

    @property
    def worth(self) -> bool:
        return self.reloads > 0 and self.saving_s > self.move_s

    def report(self, moved: bool) -> dict:
        return {
            "worker": self.worker,
            "reloads": self.reloads,
            "move_s": round(self.move_s, 4),
            "extra_s_per_token": round(self.extra_s_per_token, 5),
            "added_s_per_token": round(self.added_s_per_token, 5),
            "saving_s": round(self.saving_s, 4),
            "horizon": self.horizon,
            "room": self.room,
            "moved": moved,
        }


def _rate(stamps: deque[int] | None) -> float:
    """Events per decode iteration: how many `stamps` over the iterations they span."""
    if not stamps or len(stamps) < 2:
        return 0.0
    return len(stamps) / max(1, stamps[-1] - stamps[0] + 1)


def lost_hits(cached: int, room_after: int, peers_spare: int) -> float:
    """The share of a straggler's hits that become loads when its homes move: of the `cached` experts
    it keeps now, those beyond `room_after` leave, and those the peers' `peers_spare` room cannot
    keep are uncached at their new homes."""
    if cached <= 0:
        return 0.0
    leaving = max(0, cached - room_after)
    return max(0, leaving - max(0, peers_spare)) / cached


def straggler_room(room: int, time: float, reference: float) -> int:
    """The room a straggler is dealt homes by: its room times its speed against its peers (a worker
    10x slower keeps a tenth of its share), rounded down."""
    if time <= 0 or reference <= 0:
        return room
    return int(room * min(1.0, reference / time))


def home_move(
    worker: int,
    moved: int,
    reference_s: float,
    extra_s_per_token: float,
    horizon: int,
    room: int,
    added_s_per_token: float = 0.0,
) -> HomeMove:
    """The decision's figures (`HomeMove.worth` says whether): `moved` experts change home, each a
    load at the peers' `reference_s`; the straggler's `extra_s_per_token`, less the
    `added_s_per_token` its lost hits cost at their new homes, saved over `horizon` tokens."""
    return HomeMove(worker, moved, moved * reference_s, extra_s_per_token, horizon, room, added_s_per_token)
