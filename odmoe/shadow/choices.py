"""What the shadow's routers chose, and the one prediction per step made of them.

Contract: `router_choice` reads one row of a router's output (the shadow's own rule:
odmoe.shadow.router_tap `rank`, odmoe.shadow.hedging) into a `Choice`: the experts it picked, the
top-(k+1) candidates with their scores, and the hedges it names besides. `StepChoices` keeps each
request's choice per step (main's tick, layer) and makes the step's `Prediction`: the union of
every request's experts (the first request's in its router's order, then the others' new ones),
each request's own listed, so the workers preload each expert once and main counts recall per
request. Pure but for reading the router's tensors; no socket, no model of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from odmoe.shadow.hedging import GroupLimit, shadow_hedges
from odmoe.shadow.router_tap import rank
from odmoe.transport.messages import Prediction, Step


@dataclass(frozen=True)
class Choice:
    """What one request's router chose at one layer (a lockstep task parks with it)."""

    layer: int
    experts: list[int]
    candidates: list[int]  # the top-(k+1), best first
    probs: list[float]  # their scores
    hedges: list[int]  # hedged experts not among `experts`


def router_choice(
    module,
    output: tuple,
    layer: int,
    top_k: int,
    margin: float,
    limit: GroupLimit | None,
    row: int = -1,
    alter: Callable[[list[int]], list[int]] | None = None,
) -> Choice:
    """What a router's `output` (logits [rows, E], weights, index [rows, k]) predicts for one of its
    rows (the newest token's by default). `alter` may change the chosen experts before the hedges
    are told apart from them (emulation.inject_wrong: odmoe.shadow.predictor `Knobs`)."""
    ranked = rank(module, output[0][row], top_k, limit)  # the one rule (odmoe.shadow.router_tap)
    experts = output[2][row].tolist()
    if alter is not None:
        experts = alter(experts)
    every = ranked.every if margin > 0 else None  # group hedges rank groups by it
    hedges = shadow_hedges(ranked.candidates, ranked.probs, top_k, margin, every, limit)
    return Choice(layer, experts, ranked.candidates, ranked.probs, [h for h in hedges if h not in experts])


class StepChoices:
    """(tick, layer) -> request -> its choice: what the prediction published for a step is made of."""

    def __init__(self) -> None:
        self._by_step: dict[tuple[int, int], dict[str, Choice]] = {}

    def choose(self, tick: int, layer: int, request: str, choice: Choice) -> None:
        self._by_step.setdefault((tick, layer), {})[request] = choice

    def prediction(self, stream: str, tick: int, layer: int) -> Prediction | None:
        """The union of every request's choice at (tick, layer), each request's own listed (None:
        no request chose there)."""
        chosen = self._by_step.get((tick, layer), {})
        if not chosen:
            return None
        experts: list[int] = []
        for choice in chosen.values():  # the first request's in its router's order, then the others'
            experts += [e for e in choice.experts if e not in experts]
        hedges = sorted({h for c in chosen.values() for h in c.hedges} - set(experts))
        first = next(iter(chosen.values()))
        return Prediction(
            Step(stream, tick, layer),
            experts,
            first.candidates,
            first.probs,
            hedges,
            requests=list(chosen),
            request_experts=[c.experts for c in chosen.values()],
        )

    def forget_before(self, tick: int) -> None:
        """Drop the choices of every step before `tick` (no request can run those again)."""
        self._by_step = {k: chosen for k, chosen in self._by_step.items() if k[0] >= tick}

    def drop(self, request: str) -> None:
        for chosen in self._by_step.values():
            chosen.pop(request, None)

    def clear(self) -> None:
        self._by_step = {}
