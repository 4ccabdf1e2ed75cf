"""How strongly a silent peer is suspected of being gone: a phi-accrual failure detector.

Contract (pure: no clock, no socket; times are seconds on any monotonic clock): `Suspicion(interval_s)`
is fed the arrival time of every beat a peer answers (`beat(t)`); `phi(t)` is the suspicion level
at `t`, -log10 of the probability that a live peer stays silent this long given the gaps seen so
far, and `lost(t)` says it has reached `threshold`. `deadline()` is when, without another beat, it
will: a watcher can sleep exactly until then. Before the first beat nothing is suspected (phi 0).

Why phi accrual (Hayashibara et al. 2004, as Akka and Cassandra use it) and not a fixed gap: the
bound on silence follows the link. Gaps are modelled as normal with the mean and standard deviation
of the last `window` gaps; `acceptable_pause_s` is added to the mean (a beat or two lost, a
scheduler hiccup), and the deviation is never taken below `min_std_s` (on a clean LAN it is
microseconds, which would make any late beat look fatal). So a jittery, lossy link earns a longer
bound by what it has shown, while on any link the bound stays near
`mean + acceptable_pause_s + z(threshold) * min_std_s` (z(8) = 5.6): with the defaults and beats
every 0.1 s, 0.9 s on a clean link — a black hole is declared well within 1.5 s — and 8 beats in a
row must be lost before a live peer is suspected (at 5 % loss: 4e-11 per beat).

Gaps are what is learnt, so the first beat after a long silence (a peer that was away) teaches a
long gap: whoever takes a peer back starts a fresh `Suspicion` for it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist


@dataclass(frozen=True)
class SuspicionSettings:
    interval_s: float = 0.1  # how often the peer is asked for a beat
    threshold: float = 8.0  # phi at which it is lost: 1e-8 chance a live peer stays this silent
    acceptable_pause_s: float = 0.5  # silence beyond the usual gap that costs no suspicion by itself
    min_std_s: float = 0.05  # the gaps' deviation is never taken below this
    window: int = 100  # gaps remembered

    def check(self) -> None:
        """Raise ValueError naming the setting that cannot work."""
        if self.interval_s <= 0 or self.min_std_s <= 0 or self.acceptable_pause_s < 0:
            raise ValueError("interval_s and min_std_s must be positive, acceptable_pause_s >= 0")
        if not 0 < self.threshold <= 15:  # beyond 15, 1 - 10**-phi is 1.0 in a float
            raise ValueError(f"threshold must lie in (0, 15], got {self.threshold}")
        if self.window < 2:
            raise ValueError(f"window must be at least 2 gaps, got {self.window}")


class Suspicion:
    def __init__(self, settings: SuspicionSettings | None = None):
        self.settings = s = settings or SuspicionSettings()
        s.check()
        # seeded with two gaps around the expected one (mean interval, deviation a quarter of it),
        # so the first real gaps are judged against the interval asked for, not against nothing
        self.gaps: deque[float] = deque([s.interval_s * 0.75, s.interval_s * 1.25], maxlen=s.window)
        self.last: float | None = None  # when the latest beat arrived
        self._z = NormalDist().inv_cdf(1 - 10**-s.threshold)  # the threshold in deviations

    def beat(self, at: float) -> None:
        """A beat arrived at `at` (beats out of order, earlier than the latest, are ignored)."""
        if self.last is not None:
            if at < self.last:
                return
            self.gaps.append(at - self.last)
        self.last = at

    def _mean_std(self) -> tuple[float, float]:
        n = len(self.gaps)
        mean = sum(self.gaps) / n
        var = sum((g - mean) ** 2 for g in self.gaps) / n
        return mean + self.settings.acceptable_pause_s, max(math.sqrt(var), self.settings.min_std_s)

    def phi(self, now: float) -> float:
        if self.last is None:
            return 0.0
        mean, std = self._mean_std()
        y = (now - self.last - mean) / std
        tail = 0.5 * math.erfc(y / math.sqrt(2))  # P(a live peer's gap > this one)
        return -math.log10(tail) if tail > 0 else math.inf

    def lost(self, now: float) -> bool:
        return self.phi(now) >= self.settings.threshold

    @property
    def bound_s(self) -> float:
        """The silence that reaches the threshold, as the gaps seen so far make it (seconds)."""
        mean, std = self._mean_std()
        return mean + self._z * std

    def deadline(self) -> float | None:
        """When, without another beat, the peer will be lost (None before its first beat)."""
        return None if self.last is None else self.last + self.bound_s
