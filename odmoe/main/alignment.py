"""When the shadow re-aligns with main (paper §3.2): pure schedules of decode iterations.

Iteration n >= 1 is the n-th decode iteration; its input is the token main chose at iteration n-1.
Every `token_period`-th iteration the shadow starts from main's token instead of its own guess;
every `kv_period`-th iteration it first overwrites its K/V rows of the previous iteration's input
with main's (for iteration 1 those are the whole prompt's rows; `prefill_kv` asks for them
always). 0 disables either.

Two ways of using main's data (`alignment.mode`):
- `wait` (the paper's): at an aligned iteration the shadow waits for main's data before it starts.
  The wait is the "late departure": the shadow starts that iteration together with main.
- `speculative`: the shadow never waits for alignment. It runs on from its own token; main's token
  arrives later and, when it differs from what the shadow fed, the shadow rolls its cache back to
  that iteration and goes on from main's token (`odmoe.shadow.speculation`). It stays at most `max_ahead`
  iterations ahead of the newest iteration main has reported, so main sends an Align every iteration.

`AlignmentPlan` is main's side: which iterations it aligns, and the next one it will align
(announced in every Align, so a shadow waits exactly where main will send). With
`alignment.tune=true` it is a `PeriodTuner`: both periods widen while predictions hold and halve
after an alignment window whose wrong predictions exceed the tolerance, within [min, max].
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("wait", "speculative")


@dataclass(frozen=True)
class AlignmentSchedule:
    token_period: int = 1
    kv_period: int = 1
    prefill_kv: bool = False  # iteration 1 also takes main's prompt K/V, whatever kv_period says

    def __post_init__(self) -> None:
        for name in ("token_period", "kv_period"):
            if getattr(self, name) < 0:
                raise ValueError(f"alignment.{name} must be >= 0 (0 disables), got {getattr(self, name)}")

    def align_token(self, iteration: int) -> bool:
        return iteration >= 1 and self.token_period > 0 and iteration % self.token_period == 0

    def align_kv(self, iteration: int) -> bool:
        if iteration == 1 and self.prefill_kv:
            return True
        return iteration >= 1 and self.kv_period > 0 and iteration % self.kv_period == 0

    def waits(self, iteration: int) -> bool:
        return self.align_token(iteration) or self.align_kv(iteration)

    def first_wait(self) -> int:
        """The first iteration the shadow waits at (0: never)."""
        if self.prefill_kv:
            return 1
        return min((p for p in (self.token_period, self.kv_period) if p > 0), default=0)


class AlignmentPlan:
    """Main's static plan: the schedule, and what it announces as the next aligned iteration."""

    def __init__(self, schedule: AlignmentSchedule):
        self.schedule = schedule

    def aligns(self, iteration: int) -> tuple[bool, bool]:
        """(send the token, send the K/V rows) before decode iteration `iteration`."""
        return self.schedule.align_token(iteration), self.schedule.align_kv(iteration)

    def sent(self, iteration: int, token: bool, kv: bool) -> None:
        """Main sent iteration's alignment (the static plan needs no memory of it)."""

    def next_after(self, iteration: int) -> int:
        """The next iteration after `iteration` that main aligns (0: none)."""
        if iteration == 0 and self.schedule.prefill_kv:
            return 1
        periods = [p for p in (self.schedule.token_period, self.schedule.kv_period) if p > 0]
        return min(((iteration // p + 1) * p for p in periods), default=0)

    def observe(self, iteration: int, wrong: int, predicted: int) -> None:
        """Predictions checked at `iteration`: `wrong` of `predicted` experts (arrived ones only)."""

    def report(self) -> dict:
        s = self.schedule
        return {"tuned": False, "token_period": s.token_period, "kv_period": s.kv_period}


@dataclass
class PeriodTuner(AlignmentPlan):
    """Adaptive periods: additive widening while predictions hold, halving after misses.

    A window is the iterations since the last alignment. At each alignment main looks back over
    it: if more than `tolerance` of the predicted experts that arrived were wrong, both periods
    halve (a drifting shadow needs main's data sooner); after `grow_after` clean windows in a row
    they grow by one. Periods stay within [min_period, max_period]; a period of 0 stays 0 (that
    kind of alignment is off). Changes take effect from the next alignment, which is what main
    announces, so a waiting shadow always waits where main will send.
    """

    token_period: int = 1
    kv_period: int = 1
    min_period: int = 1
    max_period: int = 16
    tolerance: float = 0.02
    grow_after: int = 2
    prefill_kv: bool = False
    next_token: int = 0  # the next iteration main sends its token (0: never)
    next_kv: int = 0
    window: list[int] = field(default_factory=lambda: [0, 0])  # [wrong, predicted] since the last alignment
    clean_windows: int = 0
    history: list[tuple[int, int, int]] = field(default_factory=list)  # (iteration, token_p, kv_p) changes

    def __post_init__(self) -> None:
        if not 1 <= self.min_period <= self.max_period:
            raise ValueError(
                f"alignment.min_period={self.min_period} and max_period={self.max_period} need "
                "1 <= min_period <= max_period"
            )
        AlignmentSchedule(self.token_period, self.kv_period)  # raises on negative periods
        self.token_period = self._clamp(self.token_period)
        self.kv_period = self._clamp(self.kv_period)
        self.next_token = self.token_period
        self.next_kv = 1 if self.prefill_kv else self.kv_period
        self.history.append((0, self.token_period, self.kv_period))

    def _clamp(self, period: int) -> int:
        return 0 if period == 0 else min(max(period, self.min_period), self.max_period)

    def aligns(self, iteration: int) -> tuple[bool, bool]:
        return iteration == self.next_token, iteration == self.next_kv

    def sent(self, iteration: int, token: bool, kv: bool) -> None:
        if token or kv:
            self._retune(iteration)
        if token:
            self.next_token = iteration + self.token_period
        if kv and self.kv_period:
            self.next_kv = iteration + self.kv_period
        elif kv:
            self.next_kv = 0  # prefill_kv only

    def next_after(self, iteration: int) -> int:
        return min((n for n in (self.next_token, self.next_kv) if n > iteration), default=0)

    def observe(self, iteration: int, wrong: int, predicted: int) -> None:
        self.window[0] += wrong
        self.window[1] += predicted

    def _retune(self, iteration: int) -> None:
        wrong, predicted = self.window
        self.window = [0, 0]
        if not predicted:
            return  # nothing arrived to judge by (e.g. the first window)
        before = (self.token_period, self.kv_period)
        if wrong / predicted > self.tolerance:
            self.clean_windows = 0
            self.token_period = self._clamp(max(self.token_period // 2, 1)) if self.token_period else 0
            self.kv_period = self._clamp(max(self.kv_period // 2, 1)) if self.kv_period else 0
        else:
            self.clean_windows += 1
            if self.clean_windows >= self.grow_after:
                self.clean_windows = 0
                self.token_period = self._clamp(self.token_period + 1) if self.token_period else 0
                self.kv_period = self._clamp(self.kv_period + 1) if self.kv_period else 0
        if (self.token_period, self.kv_period) != before:
            self.history.append((iteration, self.token_period, self.kv_period))

    def report(self) -> dict:
        return {
            "tuned": True,
            "token_period": self.token_period,
            "kv_period": self.kv_period,
            "changes": [list(h) for h in self.history],
        }


def make_plan(alignment) -> AlignmentPlan:
    """Main's plan from `cfg.alignment` (the shadow builds the same one to know its first wait)."""
    if alignment.mode not in MODES:
        raise ValueError(f"alignment.mode={alignment.mode!r} is not one of {', '.join(MODES)}")
    if alignment.tune:
        return PeriodTuner(
            alignment.token_period,
            alignment.kv_period,
            alignment.min_period,
            alignment.max_period,
            alignment.tolerance,
            alignment.grow_after,
            alignment.prefill_kv,
        )
    return AlignmentPlan(AlignmentSchedule(alignment.token_period, alignment.kv_period, alignment.prefill_kv))
