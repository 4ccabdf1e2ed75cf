"""When main sends a decode call again because its answer is late (issue 47: lossy home links).

Contract: `LateCalls(factor, min_s)`; `note(answered)` takes a decode layer's answered calls
(`observe(seconds)` each first-time call's round trip, main's send to main's receipt, and counts the
re-sent calls that won); `after_s()` is how long after its send an unanswered decode call is sent
again, to another live worker of its group: `factor` x the median of the last `window` round trips,
never under `min_s` (None when off: `factor` 0). `prefill_late_at(...)`: the same for a prefill
layer, whose calls' rows differ. Pure: the caller's numbers in, a deadline out.

Why: on a lossy link a lost segment of a call or of its answer waits for TCP's retransmission
timeout (200 ms at least on Linux; for a lone segment its tail-loss probe waits about as long), while
a decode call usually comes back in milliseconds. Sending the experts again to a peer once the call is
a few times later than usual turns that stall into the wait plus one more call. The tokens cannot
change: every worker computes an expert with the same kernel (the assumption failover's re-sends
already make), so the first answer taken is the answer; the other is dropped as a duplicate. The
median (not the mean) so that the late calls themselves do not lift the deadline; `min_s` so that a
busy core's hiccup on a fast cluster is not taken for a loss (each needless re-send is one more
expert computed).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from odmoe.main.exchange_records import BatchCall


@dataclass
class LateCalls:
    factor: float = 4.0  # a call later than this x the usual round trip is sent again (0: never)
    min_s: float = 0.02  # ...but never sooner than this after its send
    window: int = 64  # round trips the usual one is the median of
    recent: deque[float] = field(default_factory=deque)
    resent: int = 0  # calls sent again (the stats' count)
    won: int = 0  # of which the second call's answer came first

    def __post_init__(self) -> None:
        if self.factor < 0 or self.min_s < 0:
            raise ValueError(f"late-call factor and minimum must be >= 0, got {self.factor}, {self.min_s}")
        self.recent = deque(self.recent, maxlen=self.window)

    def observe(self, seconds: float) -> None:
        if seconds >= 0:
            self.recent.append(seconds)

    def after_s(self) -> float | None:
        """Seconds after its send at which an unanswered call goes again (None: never)."""
        if self.factor <= 0:
            return None
        usual = median(self.recent) if self.recent else 0.0
        return max(self.min_s, self.factor * usual)

    def note(self, answered: list[BatchCall]) -> None:
        """A decode layer's answered calls: each first-time call's round trip observed; a call sent
        again that answered before every first-time call for its experts counts as won."""
        first = [c for c in answered if not c.again]
        for call in first:
            self.observe(call.answered_at - call.sent_at)
        covered = {e for c in first for e in c.experts}
        self.won += sum(1 for c in answered if c.again and not covered.issuperset(c.experts))

    def prefill_late_at(self, sending: float, done_s: list[float], calls: int) -> float | None:
        """When a prefill layer's unanswered calls count as late (the caller's clock; None: not yet
        known): once half the layer's `calls` are done (`done_s`: seconds from `sending` to each),
        `factor` x the slowest of them after the sends (the slowest, not the median: experts' rows
        differ, and calls queued on one worker finish one after another), never sooner than `min_s`."""
        if self.factor <= 0 or not done_s or len(done_s) < calls / 2:
            return None
        return sending + max(self.min_s, self.factor * max(done_s))

    def report(self) -> dict:
        after = self.after_s()
        return {"resent": self.resent, "won": self.won, "after_s": None if after is None else round(after, 4)}
