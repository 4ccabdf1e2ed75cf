"""Who watches a layer exchange: accounting, the timeline, fault injection.

Contract: `RemoteExperts` (the data path) splits, places, sends, takes and combines, and tells its
`Observers` what happened at fixed points — a layer was called, an exchange was entered, calls were
sent, answers taken, the answers were all in (`gathered`), and, once the layer's output exists, the
whole exchange as a record (`PrefillExchange`, `DecodeExchange`). Observers never change what is
computed, sent or combined: removing every one leaves the tokens as they are. An observer that
raises fails the layer (that is how fault injection works; the others do not raise).

- `TrafficAccounting`: each request's `ExpertTraffic` (what its stats report), split between the
  requests that shared a layer's exchange.
- `Timeline`: the `Tracer` spans of main's own work and its waits, and one message per call and
  answer (`odmoe-bench suite=timeline`); does nothing when tracing is off.
- `FaultInjection`: fires `fault.*` on main at the layer it names (tests, benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from odmoe.main.expert_traffic import LayerClock
from odmoe.tools.faults import FaultTrigger
from odmoe.tools.trace import Tracer, now_us
from odmoe.transport.messages import ExpertsResult, Prediction, Step

if TYPE_CHECKING:
    import torch

    from odmoe.main.exchange_records import BatchCall, DecodeRows, RunContext


@dataclass(kw_only=True)
class Exchange:
    """What both exchanges carry through the one send / wait / resend path (RemoteExperts)."""

    # expert -> [(request index, its rows of that expert)]: a prefill's one request is index 0
    users: dict[int, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    positions: dict[int, list[int]] = field(default_factory=dict)  # "bmm" prefill: rows' token positions
    calls: list[BatchCall] = field(default_factory=list)  # the answered ones
    # first-time calls a late re-send overtook (odmoe.main.late_calls): unanswered when the layer ended
    overtaken: list[BatchCall] = field(default_factory=list)
    resent: dict[int, int] = field(default_factory=dict)  # request index -> calls re-sent with its rows
    clock: LayerClock = field(default_factory=LayerClock)
    answers: list[ExpertsResult] = field(default_factory=list)  # every answer taken, parts included


@dataclass
class PrefillExchange(Exchange):
    """One request's prefill (or scoring) exchange of one layer, as it happened."""

    ctx: RunContext
    step: Step
    experts: int = 0  # distinct experts its tokens routed to
    waited: float = 0.0  # seconds main waited on the workers


@dataclass
class DecodeExchange(Exchange):
    """Every running request's rows of one decode layer, exchanged at once, as it happened."""

    step: Step
    batch: list[DecodeRows]
    prediction: Prediction | None = None  # the shadow's (union) prediction as it stood
    entered: float = 0.0  # perf_counter: the layer's exchange began
    started: float = 0.0  # main began waiting (calls placed and about to be encoded)
    gathered: float = 0.0  # every answer in
    combined: float = 0.0  # every request's output combined


class ExchangeObserver:
    """The hooks; each does nothing unless an observer overrides it."""

    def layer_called(self, ctx: RunContext, layer: int) -> None: ...

    def substituted(self, ctx: RunContext, layer: int, chosen: dict[int, int]) -> None: ...

    def entered(self, step: Step) -> None: ...

    def sent(self, step: Step, experts: list[int]) -> None: ...

    def answered(self, step: Step, experts: list[int]) -> None: ...

    def gathered(self, step: Step) -> None: ...

    def prefill_done(self, exchange: PrefillExchange) -> None: ...

    def decode_done(self, exchange: DecodeExchange) -> None: ...


class Observers(ExchangeObserver):
    """Every observer of one data path, told in the order they were added."""

    def __init__(self, *observers: ExchangeObserver):
        self.all = list(observers)

    def add(self, observer: ExchangeObserver) -> None:
        self.all.append(observer)

    def layer_called(self, ctx: RunContext, layer: int) -> None:
        for o in self.all:
            o.layer_called(ctx, layer)

    def substituted(self, ctx: RunContext, layer: int, chosen: dict[int, int]) -> None:
        for o in self.all:
            o.substituted(ctx, layer, chosen)

    def entered(self, step: Step) -> None:
        for o in self.all:
            o.entered(step)

    def sent(self, step: Step, experts: list[int]) -> None:
        for o in self.all:
            o.sent(step, experts)

    def answered(self, step: Step, experts: list[int]) -> None:
        for o in self.all:
            o.answered(step, experts)

    def gathered(self, step: Step) -> None:
        for o in self.all:
            o.gathered(step)

    def prefill_done(self, exchange: PrefillExchange) -> None:
        for o in self.all:
            o.prefill_done(exchange)

    def decode_done(self, exchange: DecodeExchange) -> None:
        for o in self.all:
            o.decode_done(exchange)


class TrafficAccounting(ExchangeObserver):
    """Each request's `ExpertTraffic`: its own prefill answers, its share of every decode answer."""

    def substituted(self, ctx: RunContext, layer: int, chosen: dict[int, int]) -> None:
        ctx.traffic.note_substitutions(ctx.iteration, layer, chosen)

    def prefill_done(self, exchange: PrefillExchange) -> None:
        t = exchange.ctx.traffic
        for result in exchange.answers:
            t.add(result)
        t.resent += sum(exchange.resent.values())
        t.note_prefill_layer(exchange.step.layer, exchange.waited, exchange.experts)

    def decode_done(self, exchange: DecodeExchange) -> None:
        x, layer = exchange, exchange.step.layer
        prediction = x.prediction
        hedged = set(prediction.hedges) - set(prediction.experts) if prediction is not None else set()
        for rows in x.batch:
            ctx = rows.ctx
            predicted = own_experts(prediction, ctx.request)
            ctx.traffic.note_prediction(ctx.iteration, layer, predicted, rows.experts, hedged)
        for b, count in x.resent.items():
            x.batch[b].ctx.traffic.resent += count
        for call in x.calls:
            assert call.answer is not None  # only answered calls are recorded
            result, _ = call.answer
            for i, expert in enumerate(result.experts):
                segments = x.users[expert]
                for b, _ in segments:
                    x.batch[b].ctx.traffic.add_share(result, i, 1, len(segments))
        stall = max((max(c.answer[0].waited_s, default=0.0) for c in x.calls if c.answer), default=0.0)
        for rows in x.batch:
            t = rows.ctx.traffic
            t.note_decode_layer(layer, x.gathered - x.started, stall)
            x.clock.note(t.decode, x.entered, x.gathered, x.combined)


class Timeline(ExchangeObserver):
    """Main's side of the timeline: its own work between layers, its waits, each call and answer."""

    def __init__(self, tracer: Tracer):
        self.tracer = tracer
        self._entered_us = 0.0
        self._main_since_us = 0.0  # when main last got its rows back (its own work runs from there)

    def entered(self, step: Step) -> None:
        if not self.tracer.enabled:
            return
        self._entered_us = now_us()
        if step.iteration >= 1:  # decode: main's own work since the previous layer's answers
            self.tracer.span(
                "main", f"L{step.layer}", self._main_since_us, self._entered_us, iteration=step.iteration
            )

    def sent(self, step: Step, experts: list[int]) -> None:
        for expert in experts:
            self.tracer.message("main", "compute", step, expert, sent=True)

    def answered(self, step: Step, experts: list[int]) -> None:
        for expert in experts:
            self.tracer.message("main", "result", step, expert, sent=False)

    def gathered(self, step: Step) -> None:
        if not self.tracer.enabled:
            return
        if step.iteration >= 1:
            self._main_since_us = now_us()
            span = f"wait L{step.layer}"
            self.tracer.span("main", span, self._entered_us, self._main_since_us, iteration=step.iteration)
        else:
            self.tracer.span("main", f"prefill L{step.layer}", self._entered_us, now_us(), iteration=0)


class FaultInjection(ExchangeObserver):
    """`fault.*` on main: fires (kills or freezes main) when the named layer is called."""

    def __init__(self, trigger: FaultTrigger):
        self.trigger = trigger

    def layer_called(self, ctx: RunContext, layer: int) -> None:
        self.trigger.at(ctx.request, ctx.iteration, layer)


def own_experts(prediction: Prediction | None, request: str) -> list[int] | None:
    """`request`'s own choice in a prediction: all of it when it names no requests (one request ran),
    else the request's entry; None when there is none (not here yet, or the request is not listed)."""
    if prediction is None:
        return None
    if not prediction.requests:
        return prediction.experts
    try:
        return prediction.request_experts[prediction.requests.index(request)]
    except (ValueError, IndexError):  # untrusted frames: the lists may disagree
        return None
