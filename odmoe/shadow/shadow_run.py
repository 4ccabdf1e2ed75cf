"""One request at the shadow: its cache, the token it goes on from, how it aligns with main.

Contract: a `ShadowRun` is bookkeeping over the request's `RowCache` (odmoe.shadow.shadow_batch; None
in random mode, where there is no model); it never runs the model. The predictor
(odmoe.shadow.predictor) asks it whether the request may run (`runnable`), hands it main's `Align`
reports (`align`), asks it for the token to feed before each iteration (`depart`, then the
`ShadowIteration` report for main, `report`) and tells it what the iteration fed and computed
(`ran`). Where a rollback needs the model (a cache that cannot be cut back), `align`'s caller builds
the cache again (`refill`).

Two ways to align (`alignment.mode`):
- wait (the paper's; `spec` None): an aligned iteration waits for main's Align (main said which,
  `next_wait`); its token and/or K/V rows replace the shadow's before the iteration runs.
- speculative (`spec`, odmoe.shadow.speculation): the request never waits; main's reports catch up.
  A token that differs from what it fed rolls the cache back to that iteration; main's K/V rows
  overwrite the shadow's in place as soon as the cache holds their positions (`rows` until then).

Every Align is untrusted: K/V rows that do not fit the cache raise ValueError (the predictor then
abandons the request).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from odmoe.shadow.shadow_batch import RowCache
from odmoe.shadow.speculation import Speculation
from odmoe.transport.messages import Align, BeginRequest, ShadowIteration

log = logging.getLogger("odmoe.shadow")

Rows = tuple[int, int, torch.Tensor, torch.Tensor]  # main's K/V rows for positions [start, end)


@dataclass
class ShadowRun:
    begin: BeginRequest
    cache: RowCache | None  # None: random mode (no model)
    own_token: int
    next_wait: int  # wait mode: the next iteration main will align
    spec: Speculation | None = None  # speculative mode
    next_iteration: int = 1  # wait mode (speculative: spec.next_iteration)
    aligns: dict[int, tuple[Align, list[torch.Tensor]]] = field(default_factory=dict)  # wait mode
    rows: list[Rows] = field(default_factory=list)  # speculative: main's K/V rows not placed yet
    forward_s: float = 0.0
    idle_since_us: float = 0.0  # when it last had to wait for main (alignment_wait_s)

    @property
    def request(self) -> str:
        return self.begin.request

    @property
    def iteration(self) -> int:
        return self.spec.next_iteration if self.spec is not None else self.next_iteration

    @property
    def tick(self) -> int:
        """Main's tick of this request's next iteration."""
        return self.begin.first_tick + self.iteration - 1

    @property
    def over(self) -> bool:
        return self.iteration >= self.begin.max_new_tokens

    @property
    def batched(self) -> bool:
        """Its cache is a row of the shadow's batch (odmoe.shadow.shadow_batch)."""
        return self.cache is not None and self.cache.batch is not None

    def runnable(self) -> bool:
        if self.over:
            return False
        if self.spec is not None:
            return self.spec.may_run()
        if self.cache is None:  # random: paced by main, one Align per iteration
            return self.next_iteration in self.aligns
        return self.next_iteration != self.next_wait or self.next_iteration in self.aligns

    def align(
        self, align: Align, tensors: list[torch.Tensor], refill: Callable[[ShadowRun, int], RowCache]
    ) -> None:
        """Main's report for one iteration: kept for it (wait mode), or applied (speculative: a
        differing token rolls back, by cropping the cache or by `refill(run, iteration)`)."""
        if self.cache is None:  # random mode: an Align only paces it
            self.aligns[align.iteration] = (align, [])
            return
        if align.kv:
            check_rows(tensors, self.cache)
        if self.spec is None:  # wait mode: kept for the iteration it is for
            if align.iteration >= self.next_iteration:
                self.aligns[align.iteration] = (align, tensors)
            return
        spec = self.spec
        if align.kv:
            start, end = spec.rows_span(align.iteration, tensors[0].shape[2])
            if start < 0:
                raise ValueError(f"an Align's {end - start} K/V rows do not fit its iteration")
            self.rows.append((start, end, tensors[0], tensors[1]))
        back = spec.on_main(align.iteration, align.token)
        if back is not None:
            if self.cache.croppable:
                self.cache.crop_to(spec.keep_length(back))
            else:
                self.cache = refill(self, back)
            spec.roll_back(back)
            log.debug("request %s: main's token differs at iteration %d: rolled back", self.request, back)
        place_rows(self.cache, self.rows)

    def depart(self) -> tuple[int, float]:
        """Before its next iteration: main's alignment for it applied (wait mode: the token and/or
        K/V rows main sent for it). Returns the token it feeds, and when main sent that alignment
        (main's wall clock, µs; 0: none)."""
        if self.spec is not None:
            place_rows(self.cache, self.rows)
            return self.spec.token_for(self.own_token), 0.0
        iteration, token, main_started_us = self.iteration, self.own_token, 0.0
        aligned = self.aligns.pop(iteration, None)
        self.aligns = {n: a for n, a in self.aligns.items() if n > iteration}
        if aligned is not None:
            align, tensors = aligned
            main_started_us = align.sent_at_us
            self.next_wait = align.next_align if align.next_align > iteration else 0
            if align.token >= 0:
                token = align.token
            if align.kv and self.cache is not None:  # main's rows of the previous iteration
                self.cache.overwrite(self.cache.length - tensors[0].shape[2], tensors[0], tensors[1])
        return token, main_started_us

    def report(self, start_us: float, late_us: float, device_peak_bytes: int) -> ShadowIteration:
        """What main hears as the iteration starts (at `start_us`, `late_us` after main did)."""
        started = ShadowIteration(
            self.request,
            self.iteration,
            late_departure_s=late_us / 1e6,
            alignment_wait_s=(start_us - self.idle_since_us) / 1e6 if self.idle_since_us else 0.0,
            previous_forward_s=self.forward_s,
            ahead=self.spec.ahead if self.spec is not None else 0,
            rollbacks=self.spec.rollbacks if self.spec is not None else 0,
            device_peak_bytes=device_peak_bytes,
        )
        self.forward_s, self.idle_since_us = 0.0, 0.0
        return started

    def ran(self, fed: int, own: int, clock: Callable[[], float]) -> None:
        """Its iteration fed `fed` and computed `own` as its next token."""
        self.own_token = own
        if self.spec is not None:
            self.spec.ran(fed)
            place_rows(self.cache, self.rows)
        else:
            self.next_iteration += 1
        if not self.runnable():
            self.idle_since_us = clock()  # waiting for main (its alignment, or to fall behind less)


def place_rows(cache: RowCache | None, rows: list[Rows]) -> None:
    """Overwrite the shadow's K/V rows with main's wherever the cache already has them."""
    if cache is None:
        return
    length = cache.length
    for item in [r for r in rows if r[1] <= length]:
        cache.overwrite(item[0], item[2], item[3])
        rows.remove(item)


def check_rows(tensors: list[torch.Tensor], cache: RowCache) -> None:
    if len(tensors) != 2 or any(t.dim() != 4 or t.shape[0] != cache.layers for t in tensors):
        raise ValueError("an Align's K/V rows do not fit the cache")


def check_begin(begin: BeginRequest, vocab_size: int, max_positions: int) -> None:
    """A Begin the model can take (`max_positions` 0: the model names no limit), else ValueError."""
    ids = begin.prompt_ids
    if not ids or any(not 0 <= i < vocab_size for i in ids):
        raise ValueError(f"prompt ids must be a non-empty list in [0, {vocab_size})")
    if begin.max_new_tokens < 1 or (max_positions and len(ids) + begin.max_new_tokens > max_positions):
        raise ValueError(f"max_new_tokens={begin.max_new_tokens} does not fit the context")
    if begin.first_tick < 1:
        raise ValueError(f"first_tick={begin.first_tick} is before the first decode tick")
