"""What the engine does in one tick, decided apart from doing it: a pure planner.

Contract: `plan_tick(runs, tick, batched) -> TickPlan` takes what the engine's loop needs to know
of each running request (`RunView`: a snapshot, no model, no cache) and says who runs how this
tick: the decoding requests one batched pass computes, the prefills parked across ticks that go
on, and the forward passes started as lockstep tasks (one request alone too); the rest wait (a
follower's prefill is its leader's; a staggered prefill's tick is later).
`admit(arrival, state) -> Admission` is the admission's plan for a request taken from the queue:
how many MoE layers its prefill exchanges a tick (`prefill_quota`), the tick it starts in
(`prefill_tick`), the tick of its first decode iteration; `kv_fits` whether the K/V budget holds
one more request, `room` how many more may run. The engine (`odmoe.main.engine`) asks and then
runs the plan; nothing here touches a request, a socket or a tensor, so each rule is tested on
its own (tests/test_tick_plan.py).

Why apart: the tick's choices (stagger, chunked prefill, the batched pass, followers) were branches
inside the loop that ran them; a plan is a value one can read, print and test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunView:
    """One running request as the planner sees it."""

    key: str
    decoding: bool  # past its prefill (its iterations are decode iterations)
    iteration: int = 0  # 0: its prefill is still to do
    prefill_tick: int = 0  # the tick its prefill starts in (stagger)
    follows: bool = False  # its prefill is a leader's (same prompt, `prefill_group`)
    parked: bool = False  # its forward pass is a task parked across ticks (a chunked prefill)


@dataclass(frozen=True)
class Arrival:
    """A request taken from the queue, as the planner sees it."""

    prompt_tokens: int
    scored: bool = False  # prompt_logprobs: a scoring pass over the prompt before its prefill
    grouped: bool = False  # in a prefill_group: it may copy a leader's prefill


@dataclass(frozen=True)
class AdmitState:
    """What admission needs to know of the engine at that moment."""

    tick: int
    free_tick: int  # the first tick no admitted prompt's prefill holds (stagger)
    moe_layers: int
    chunk_tokens: int  # prefill.chunk_tokens (0: a whole prompt at once)
    stagger: bool  # prefill.stagger
    others_running: bool
    in_pass: bool = False  # admitted between two layers of the batched decode pass


@dataclass(frozen=True)
class Admission:
    """Where an admitted request's prefill goes: the tick it starts in, the MoE layers it exchanges
    per tick, and the tick of its decode iteration 1 (which names its predictions)."""

    prefill_tick: int = 0
    quota: int = 0
    first_tick: int = 1


@dataclass(frozen=True)
class TickPlan:
    """Who runs how this tick; every running request is in at most one of these."""

    # lockstep tasks in running order (a prefill's place in it is its turn among the prefills):
    # each started, or resumed where it is a prefill parked across ticks (`resume`)
    tasks: list[str] = field(default_factory=list)
    resume: frozenset[str] = frozenset()
    together: list[str] = field(default_factory=list)  # decoding requests of the batched pass, after

    @property
    def runs(self) -> list[str]:
        """Every request that runs this tick."""
        return [*self.tasks, *self.together]


def plan_tick(runs: list[RunView], tick: int, batched: bool) -> TickPlan:
    """This tick's plan. With batched decode (`batched`), two or more decoding requests go in one
    pass after the prefills; parked prefills go on; every other request starts its forward pass as
    a task, but a follower (its leader's prefill is its own) and a prefill staggered to a later tick."""
    decoding = [r.key for r in runs if r.decoding and not r.parked]
    together = decoding if batched and len(decoding) >= 2 else []
    tasks = [
        run.key
        for run in runs
        if run.key not in together
        and (run.parked or not (run.iteration == 0 and (run.follows or run.prefill_tick > tick)))
    ]
    resume = frozenset(run.key for run in runs if run.parked)
    return TickPlan(tasks=tasks, resume=resume, together=together)


def admit(arrival: Arrival, state: AdmitState) -> Admission:
    """A request's admission: its prefill's quota of layers per tick, its start (staggered), and
    its first decode tick after the ticks its prefill (and a scoring pass before it) take."""
    layers = state.moe_layers
    quota = prefill_quota(arrival.prompt_tokens, layers, state.chunk_tokens, state.others_running)
    passes = 2 if arrival.scored else 1
    plain = passes == 1 and quota >= layers and not arrival.grouped
    starts = prefill_tick(state.tick, state.free_tick, state.stagger, state.in_pass, plain)
    return Admission(starts, quota, starts + math.ceil(passes * layers / quota))


def room(max_running: int, running: int) -> int:
    """How many more requests may be admitted now (`server.max_running`)."""
    return max(max_running - running, 0)


def prefill_quota(prompt_tokens: int, moe_layers: int, chunk_tokens: int, others_running: bool) -> int:
    """MoE layers a prefill exchanges per tick: all of them, unless requests are running and
    `chunk_tokens` cuts the prompt (a prompt of T tokens takes ~T / chunk_tokens ticks)."""
    layers = max(moe_layers, 1)
    if chunk_tokens <= 0 or prompt_tokens <= chunk_tokens or not others_running:
        return layers
    return max(1, math.floor(layers * chunk_tokens / prompt_tokens))


def prefill_tick(tick: int, free_tick: int, stagger: bool, in_pass: bool, plain: bool) -> int:
    """The tick a newly admitted prompt's prefill starts in. Staggered, the first tick no other
    prompt's prefill holds (`free_tick`): the streams running wait for one prompt per iteration,
    not k, and requests that arrived together do not finish (and come back) together again.
    Admitted mid-pass (`in_pass`), only a plain prefill (one pass, whole, alone) goes this tick."""
    earliest = tick + 1 if in_pass and not plain else tick
    return max(earliest, free_tick) if stagger else tick


def kv_fits(budget: int, per_position: int, held_positions: int, positions: int, first: bool) -> bool:
    """Whether a K/V budget of `budget` bytes (0: none) holds a request of `positions` positions
    beside the running ones' `held_positions`; the first request always fits, and until a prefill
    has measured `per_position` only one runs."""
    if not budget or first:
        return True
    if not per_position:
        return False
    return (held_positions + positions) * per_position <= budget
