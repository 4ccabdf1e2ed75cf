"""When the shadow re-aligns with main (paper §3.2): a pure schedule of decode iterations.

Iteration n >= 1 is the n-th decode iteration; its input is the token main chose at iteration n-1.
Every `token_period`-th iteration the shadow starts from main's token instead of its own guess;
every `kv_period`-th iteration it first overwrites its K/V rows of the previous iteration's input
with main's (for iteration 1 those are the whole prompt's rows; `prefill_kv` asks for them
always). 0 disables either. Waiting for that data delays the shadow's start ("late departure").
"""

from __future__ import annotations

from dataclasses import dataclass


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
