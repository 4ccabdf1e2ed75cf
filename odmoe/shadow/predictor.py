"""The shadow's predictor: its copy of the model run ahead of main, its routers' choices as predictions.

Contract: `ShadowPredictor(model, setup, send)` takes main's control messages (`control`: a
BeginRequest, Align or EndRequest, decoded, with its tensors) and steps the requests it runs
(`step`, with those `runnable()` now); everything it says goes out through `send`, in order:
a `Prediction` per (tick, layer), a `ShadowIteration` as each request's iteration starts, a
`ShadowEnded` once main's EndRequest is taken. It never opens a socket, never imports zmq and
never reads a config: the shadow node (`odmoe.nodes.shadow`) loads the model, builds this, reads
the control socket, publishes what `send` gets, and decides when to wait for main.

1) Begin: a request prefills its own cache from the prompt (no predictions: prefill spreads every
   expert) and joins the batch (odmoe.shadow.shadow_batch) where the model's cache can be batched.
2) Each decode iteration n of a request runs in main's tick `first_tick + n - 1`; how it aligns
   with main (wait for main's token / K/V rows, or speculate and roll back) is its `ShadowRun`'s
   (odmoe.shadow.shadow_run). Every request due is stepped together, interleaved at the routers:
   batched, one forward pass for all; otherwise one pass each, as lockstep tasks (odmoe.lockstep).
   Once each has chosen its experts for a layer, one prediction for (stream, tick, layer) goes
   out: the union of their choices with each request's own listed (odmoe.shadow.choices). A
   request behind the others (just begun, rolled back) catches up alone, and the union for the
   ticks it re-runs goes out again (a later prediction for a step supersedes the earlier one).
3) End stops it. Random mode (`model` None, ablation case 5) publishes uniformly random experts,
   paced by main's Aligns.

Tests and benchmarks alter its output in one place, `knobs` (`Knobs`: the node's ShadowLab makes
predictions and own tokens wrong on purpose and fires fault injection at a router); the product's
are `Unaltered`. A request whose message or forward pass fails (a bad Begin, K/V rows that do not
fit) is abandoned with a rate-limited log line (`dropped`); the others go on.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from odmoe.lockstep import Failed, Finished, Lockstep, Outcome, Parked, in_task, park
from odmoe.models.cache_argument import with_cache
from odmoe.shadow.choices import Choice, StepChoices, router_choice
from odmoe.shadow.hedging import GroupLimit
from odmoe.shadow.router_tap import RouterTap
from odmoe.shadow.shadow_batch import RowCache, ShadowBatch, batchable
from odmoe.shadow.shadow_run import ShadowRun, check_begin
from odmoe.shadow.speculation import Speculation
from odmoe.transport.dropped import DropLog
from odmoe.transport.messages import Align, BeginRequest, EndRequest, ShadowEnded

log = logging.getLogger("odmoe.shadow")


@dataclass(frozen=True)
class PredictorSetup:
    """The model's shape and the shadow's settings, as plain values."""

    device: str
    num_experts: int
    top_k: int
    vocab_size: int
    max_positions: int  # 0: the model names no limit
    moe_layers: tuple[int, ...]
    hedge_margin: float = 0.0  # shadow.hedge_margin (odmoe.shadow.hedging)
    speculative: bool = False  # alignment.mode == "speculative"
    max_ahead: int = 2  # alignment.max_ahead
    first_wait: int = 0  # wait mode: the first iteration main aligns (its plan, odmoe.main.alignment)


class Knobs(Protocol):
    """Where tests and benchmarks alter the predictor's output (never a product setting)."""

    def choice(self, request: str, iteration: int, layer: int, experts: list[int]) -> list[int]:
        """A request's router chose `experts` at (iteration, layer): what is published instead."""
        ...

    def own_token(self, token: int) -> int:
        """The shadow computed `token` as a request's next one: what it goes on from instead."""
        ...


class Unaltered:
    """The product's knobs: nothing altered."""

    def choice(self, request: str, iteration: int, layer: int, experts: list[int]) -> list[int]:
        return experts

    def own_token(self, token: int) -> int:
        return token


class _Untraced:
    enabled = False

    def span(self, *args: Any, **kwargs: Any) -> None:
        pass


def _wall_us() -> float:
    """Wall clock, µs: odmoe.tools.trace.now_us's (main stamps Align.sent_at_us with it)."""
    return time.time() * 1e6


def _abandoned(request: str, exc: BaseException) -> str:
    return f"request {request!r:.40} abandoned: {type(exc).__name__}: {exc}"


class ShadowPredictor:
    def __init__(
        self,
        model,
        setup: PredictorSetup,
        send: Callable[[Any], None],
        *,
        rng: random.Random | None = None,
        knobs: Knobs | None = None,
        tracer=None,
        clock: Callable[[], float] = _wall_us,
        device_peak: Callable[[], int] = lambda: 0,
        dropped: DropLog | None = None,
    ):
        self.model, self.setup, self.send = model, setup, send
        self.rng = rng or random.Random(0)  # random mode's experts
        self.knobs: Knobs = knobs or Unaltered()
        self.tracer = tracer or _Untraced()
        self.clock, self.device_peak = clock, device_peak
        self.dropped = dropped or DropLog(log, "shadow")
        self.runs: dict[str, ShadowRun] = {}  # the requests main runs, in the order they began
        self.stream = ""  # main's decode stream (the busy period's name)
        self.choices = StepChoices()
        self.tasks = Lockstep()
        self._running: ShadowRun | None = None  # the request whose forward pass runs (the router hooks')
        self.tap = RouterTap(model, setup.num_experts, on_route=self._on_route) if model is not None else None
        # every request whose model's cache can be batched (odmoe.shadow.shadow_batch): one forward per tick
        self.batch = ShadowBatch(model) if model is not None else None
        self._layer_since_us = 0.0  # when the current layer's computation began (timeline only)

    # -- control -----------------------------------------------------------------------------
    def control(self, message: BeginRequest | Align | EndRequest, tensors: list[torch.Tensor]) -> None:
        """Apply one of main's messages to its request; one that fails abandons that request."""
        try:
            if isinstance(message, BeginRequest):
                self._begin(message)
            elif isinstance(message, EndRequest):
                self.end(message.request)
            elif message.request in self.runs:
                self.runs[message.request].align(message, tensors, self._refilled)
        except Exception as exc:  # a bad Begin or Align: abandon that request, keep serving
            request = getattr(message, "request", "")
            self.dropped.drop(_abandoned(request, exc))
            self.runs.pop(request, None)

    def _begin(self, begin: BeginRequest) -> None:
        check_begin(begin, self.setup.vocab_size, self.setup.max_positions)
        if begin.request in self.runs:  # main resumes it after losing this shadow: start afresh
            self._drop(begin.request)
        stream = begin.stream or begin.request
        if stream != self.stream:  # main's new busy period: what was kept for the old one is no use
            self.stream = stream
            self.choices.clear()
            for request in list(self.runs):
                self.end(request)
        begin = BeginRequest(begin.request, begin.prompt_ids, begin.max_new_tokens, stream, begin.first_tick)
        cache, own, spec = None, -1, None
        if self.model is not None:
            cache, own = self._prefill(begin)
            if self.setup.speculative:
                spec = Speculation(len(begin.prompt_ids), self.setup.max_ahead)
        self.runs[begin.request] = ShadowRun(begin, cache, own, self.setup.first_wait, spec)

    def _prefill(self, begin: BeginRequest) -> tuple[RowCache, int]:
        """1) Its own prefill (nothing to predict), then into the batch: its cache and next token."""
        prefilled = DynamicCache(config=self.model.config)
        ids = torch.tensor([begin.prompt_ids], device=self.setup.device)
        self._running = None
        cached = with_cache(self.model, prefilled)
        out = self.model(input_ids=ids, **cached, use_cache=True, logits_to_keep=1)
        own = int(out.logits[0, -1].argmax())
        if batchable(prefilled):
            self.batch.add(begin.request, prefilled)
            return self.batch.row(begin.request), own
        return RowCache(prefilled), own

    def end(self, request: str) -> None:
        """Main is done with it: every prediction for it went out before this word (in order)."""
        self._drop(request)
        self.send(ShadowEnded(request))

    def _drop(self, request: str) -> None:
        self.runs.pop(request, None)
        if self.batch is not None:
            self.batch.remove(request)
        self.choices.drop(request)

    def runnable(self) -> list[ShadowRun]:
        """The requests that may run their next iteration now, in the order they began."""
        return [r for r in self.runs.values() if r.runnable()]

    def unfinished(self) -> int:
        return sum(not r.over for r in self.runs.values())

    # -- stepping ----------------------------------------------------------------------------
    def step(self, runnable: list[ShadowRun]) -> None:
        """2) One iteration of the earliest tick's requests (batched: of every runnable row, each
        at its own tick), their routers in step."""
        tick = min(r.tick for r in runnable)
        runs = runnable if runnable[0].batched else [r for r in runnable if r.tick == tick]
        tokens = {run.request: self._depart(run) for run in runs}
        self._layer_since_us = self.clock()
        if self.model is None:
            self._run_random(tick, runs)
            return
        if runs[0].batched:  # every run of a batchable model is
            self._run_batched(runs, tokens)
        elif len(runs) == 1:  # one request: its forward pass needs no lockstep (its hook publishes)
            self._run_alone(runs[0], tokens[runs[0].request])
        else:
            self._run_interleaved(tick, runs, tokens)
        # choices of ticks no request can run again (a rollback goes back at most max_ahead + 1)
        oldest = min((r.tick for r in self.runs.values()), default=tick)
        self.choices.forget_before(oldest - self.setup.max_ahead - 2)

    def _depart(self, run: ShadowRun) -> int:
        """Before a request's iteration: its alignment, its ShadowIteration report; the token it feeds."""
        token, main_started_us = run.depart()
        start_us = self.clock()
        late_us = max(start_us - main_started_us, 0.0) if main_started_us else 0.0
        self.send(run.report(start_us, late_us, self.device_peak()))
        if late_us:
            span = start_us - late_us, start_us
            self.tracer.span("shadow", "late departure", *span, iteration=run.iteration)
        return token

    def _run_alone(self, run: ShadowRun, token: int) -> None:
        self._running, start = run, time.perf_counter()
        try:
            run.ran(*self._forward(token, run), self.clock)
        except Exception as exc:  # a bad Align's rows, say: abandon that request, keep serving
            self.dropped.drop(_abandoned(run.request, exc))
            self.runs.pop(run.request, None)
        run.forward_s += time.perf_counter() - start
        self._running = None

    def _run_interleaved(self, tick: int, runs: list[ShadowRun], tokens: dict[str, int]) -> None:
        """Several requests, one forward pass each, as lockstep tasks: each parks at a router with its
        choice; once every one has chosen at a layer, that layer's union goes out and they go on."""
        parked: dict[str, Choice] = {}
        for run in runs:
            self._settle(
                run, partial(self.tasks.start, run.request, self._forward, tokens[run.request], run), parked
            )
        while parked:
            layer = min(c.layer for c in parked.values())
            group = [k for k, c in parked.items() if c.layer == layer]
            for request in group:
                self.choices.choose(tick, layer, request, parked.pop(request))
            self._publish(tick, layer)
            for request in group:
                self._settle(self.runs.get(request), partial(self.tasks.resume, request), parked)
        self._running = None

    def _settle(self, run: ShadowRun | None, go: Callable[[], Outcome], parked: dict[str, Choice]) -> None:
        """A task run on (`go`: started or resumed) until it parks with its choice or ends; its time
        counts as its forward pass's."""
        start, self._running = time.perf_counter(), run
        outcome = go()
        if run is not None:
            run.forward_s += time.perf_counter() - start
        if isinstance(outcome, Parked):
            parked[outcome.key] = outcome.payload
        elif isinstance(outcome, Finished) and run is not None:
            run.ran(*outcome.value, self.clock)
        elif isinstance(outcome, Failed):
            self.dropped.drop(_abandoned(str(outcome.key), outcome.error))
            self.runs.pop(str(outcome.key), None)

    def _run_batched(self, runs: list[ShadowRun], tokens: dict[str, int]) -> None:
        """One forward pass of the whole batch; the router hooks publish each layer's union."""
        start = time.perf_counter()
        try:
            own = self.batch.step(tokens)
        except Exception as exc:  # a bad Align's rows, say: those requests are abandoned
            for run in runs:
                self.dropped.drop(_abandoned(run.request, exc))
                self.end(run.request)
            return
        share = (time.perf_counter() - start) / len(runs)
        for run in runs:
            token = self.knobs.own_token(own[run.request])
            run.forward_s += share
            run.ran(tokens[run.request], token, self.clock)

    def _run_random(self, tick: int, runs: list[ShadowRun]) -> None:
        """Ablation case 5: no model, a random guess per layer and request, paced by main."""
        for layer in self.setup.moe_layers:
            for run in runs:
                experts = self.rng.sample(range(self.setup.num_experts), self.setup.top_k)
                choice = Choice(layer, experts, experts, [0.0] * len(experts), [])
                self.choices.choose(tick, layer, run.request, choice)
            self._publish(tick, layer)
        for run in runs:
            run.next_iteration += 1

    def _forward(self, token: int, run: ShadowRun) -> tuple[int, int]:
        """One decode step of the shadow's copy for one request (its routers' hooks park with their
        choices): the token it fed and its own next one."""
        logits = self.model(
            input_ids=torch.tensor([[token]], device=self.setup.device),
            **with_cache(self.model, run.cache.cache),
            use_cache=True,
            logits_to_keep=1,
        ).logits
        return token, self.knobs.own_token(int(logits[0, -1].argmax()))

    def _refilled(self, run: ShadowRun, iteration: int) -> RowCache:
        """A rollback for a hybrid model: a linear-attention layer's recurrent state has no earlier
        positions to cut back to, so the cache is built again by one forward pass over the tokens
        before `iteration`'s input (the prompt and the tokens fed since, which held). Rollbacks are
        rare when the shadow predicts well; each costs one prefill of the sequence so far."""
        tokens = [*run.begin.prompt_ids, *(run.spec.fed[n] for n in range(1, iteration))]
        cache, running, self._running = DynamicCache(config=self.model.config), self._running, None
        try:  # like a prefill: the router hooks see no running request and publish nothing
            self.model(
                input_ids=torch.tensor([tokens], device=self.setup.device),
                **with_cache(self.model, cache),
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            self._running = running
        return RowCache(cache)

    # -- predictions -------------------------------------------------------------------------
    def _on_route(self, layer: int, module, output) -> None:
        """Every router call: each stepping request's choice at `layer` (with the router's expert
        groups, where it picks only from some: group hedges need them); published once every
        request of the tick has chosen."""
        limit = self.tap.limits[layer]
        if self.batch is not None and self.batch.stepping:  # one row per batched request
            ticks = set()
            for row, request in self.batch.stepping:
                run = self.runs[request]  # each at its own tick (a speculative row may be ahead)
                choice = self._choice(run, layer, module, output, limit, row)
                self.choices.choose(run.tick, layer, request, choice)
                ticks.add(run.tick)
            for tick in sorted(ticks):
                self._publish(tick, layer)
            return
        run = self._running
        if run is None or run.iteration < 1:
            return  # prefill: nothing to predict
        choice = self._choice(run, layer, module, output, limit)
        if not in_task():  # the tick's only request: publish at once
            self.choices.choose(run.tick, layer, run.request, choice)
            self._publish(run.tick, layer)
            return
        park(choice)
        self._running = run

    def _choice(
        self, run: ShadowRun, layer: int, module, output, limit: GroupLimit | None, row: int = -1
    ) -> Choice:
        """A request's choice at `layer` (its router's `row`), as the knobs leave it."""
        alter = partial(self.knobs.choice, run.request, run.iteration, layer)
        s = self.setup
        return router_choice(module, output, layer, s.top_k, s.hedge_margin, limit, row, alter)

    def _publish(self, tick: int, layer: int) -> None:
        """The step's prediction out, and its layer's span on the timeline."""
        message = self.choices.prediction(self.stream, tick, layer)
        if message is None:
            return
        self.send(message)
        if self.tracer.enabled:
            now, since = self.clock(), self._layer_since_us
            self.tracer.span("shadow", f"L{layer}", since, now, iteration=tick, experts=message.experts)
            self._layer_since_us = now
