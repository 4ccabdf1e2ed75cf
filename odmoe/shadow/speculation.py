"""The speculative shadow's bookkeeping (`alignment.mode=speculative`): pure, no tensors.

The shadow runs decode iterations from its own tokens without waiting for main. Main reports,
for each iteration n, the token it fed (every `token_period`-th iteration) and the K/V rows it
computed in iteration n-1 (every `kv_period`-th). This class decides what those reports mean:

- a token equal to the one the shadow fed at n: nothing to do, the speculation held;
- a different token at an iteration the shadow already ran: roll back. The cache keeps the
  positions before n's input (`keep_length(n)` = prompt + n - 1 rows) and the shadow runs n again
  from main's token. Predictions it republishes for n, n+1, ... supersede the earlier ones.
- a token for an iteration the shadow has not reached yet: it will feed main's token there;
- K/V rows: they overwrite the shadow's rows at their own positions, whenever the shadow's cache
  has those positions (at once when it is ahead, later when it is behind).

The shadow may run iteration n only while n <= newest reported iteration + `max_ahead`: it stays a
bounded number of iterations ahead, so a diverged shadow never wastes more than that much work.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Speculation:
    prompt_len: int
    max_ahead: int = 2
    next_iteration: int = 1  # the iteration the shadow runs next
    main_latest: int = 0  # the newest iteration main has reported (it has started it)
    fed: dict[int, int] = field(default_factory=dict)  # iteration -> token the shadow fed
    main_tokens: dict[int, int] = field(default_factory=dict)  # iteration -> main's token
    rollbacks: int = 0
    rolled_back_iterations: int = 0  # iterations computed again after rollbacks

    def __post_init__(self) -> None:
        if self.max_ahead < 1:
            raise ValueError(f"alignment.max_ahead must be at least 1, got {self.max_ahead}")

    def keep_length(self, iteration: int) -> int:
        """Cache rows before iteration's input token: what a rollback to `iteration` keeps."""
        return self.prompt_len + iteration - 1

    def rows_span(self, iteration: int, rows: int) -> tuple[int, int]:
        """Positions [start, end) of the K/V rows main reports with iteration's Align: the rows it
        computed in iteration-1 (the prompt's, for iteration 1)."""
        end = self.keep_length(iteration)
        return end - rows, end

    def on_main(self, iteration: int, token: int) -> int | None:
        """Main reported iteration (token -1: no token). Returns the iteration to roll back to, or None."""
        self.main_latest = max(self.main_latest, iteration)
        if token < 0:
            return None
        self.main_tokens[iteration] = token
        fed = self.fed.get(iteration)
        if fed is None or fed == token or iteration >= self.next_iteration:
            return None
        return iteration

    def roll_back(self, iteration: int) -> None:
        """Forget what was fed from `iteration` on; it runs next."""
        self.rollbacks += 1
        self.rolled_back_iterations += self.next_iteration - iteration
        self.fed = {n: t for n, t in self.fed.items() if n < iteration}
        self.next_iteration = iteration

    def may_run(self) -> bool:
        return self.next_iteration <= self.main_latest + self.max_ahead

    def token_for(self, own_token: int) -> int:
        """What to feed the next iteration: main's token when known, else the shadow's own."""
        return self.main_tokens.get(self.next_iteration, own_token)

    def ran(self, token: int) -> int:
        """The shadow fed `token` to the next iteration; returns that iteration."""
        iteration = self.next_iteration
        self.fed[iteration] = token
        self.next_iteration += 1
        return iteration

    @property
    def ahead(self) -> int:
        """Iterations the shadow is ahead of main's newest report (negative: behind)."""
        return self.next_iteration - self.main_latest
