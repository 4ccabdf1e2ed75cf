"""Main's side of the data plane: send a layer's expert rows to workers, gather, combine.

Contract: `RemoteExperts.__call__(layer, hidden[T, H], top_k_index[T, k], top_k_weights[T, k])`
returns exactly what transformers' experts module would have returned, computed by the workers.
It is attached to the main model (main_model.MainModel.attach) and called once per MoE layer of
every forward pass, for the request whose `RunContext` is `current` (the engine sets it before it
runs that request's forward pass).

Two exchanges:
- prefill (a request's iteration 0): the request's own, as soon as it is called: every expert its
  prompt hits is spread over the live workers storing the layer, one ComputeExpert per expert
  (prompt mini-batches as several), named `(request, 0, layer)`.
- decode: inside the engine's lockstep (`odmoe.main.lockstep`) the call parks with the request's
  `DecodeRows` and the engine hands every running request's rows of that layer to
  `exchange_decode` at once, named `(stream, tick, layer)`: each expert any of them needs is placed
  once (where the shadow's prediction, the union over the requests, preloaded it), every worker gets
  one ComputeExperts with all its experts' rows, request by request in segments it computes as
  each request's own call would (odmoe.worker.stacked_segments),
  and each request's output is combined from its own rows exactly as when it runs alone. A call
  outside a lockstep task (one request alone) makes the same exchange with one request.

Failure policy: every call is self-contained (rows + its name), so a call outstanding on a worker
that is lost (Membership reports it, or it stays silent past `reply_timeout_s`: the per-call
deadline for a frozen process) is re-sent, rows and all, to a live worker that stores the layer,
placed by the same pure rules over the live workers. An answer is taken only from the worker the
call is currently placed on, once per part, so a late or duplicated answer is never combined twice.
When no live worker stores the layer the exchange fails at once with `WorkerUnavailable` naming the
layer; a worker that answers with an error (e.g. it lacks that expert) raises `WorkerFailed`.
Frames that do not decode are dropped.

Stragglers (`failover.steer_stragglers`): each decode answer's per-expert load + compute seconds go
to a `StragglerWatch` (odmoe.main.stragglers; with worker caches only the answers that loaded); when
its set of stragglers changes, Membership tells every worker and places by it (odmoe.placement's
`slow`). Cacheless, the group's other members take a straggler's decode experts, preloads included,
but on its probe iterations; prefill spares it too. With caches, a straggler's homes move to its
peers (it keeps `straggler_room` of its room) when `home_move` says the move pays within
`failover.straggler_move_horizon` tokens, weighed again every `straggler_after` decode iterations
while it does not; a recovered one gets its homes back. Where a prediction was dealt by the old set,
the expert is loaded after routing: time, never tokens.

Misses: by default a missed expert is loaded and waited for (lossless). With a lossy miss policy
(`odmoe.lossy.substitution`, opt-in) a decode miss may instead be computed by a resident expert, the
predicted one its worker preloaded: main asks that worker for the resident expert by name, so the
worker computes exactly what main combines, and the result takes the missing expert's gate weight.
Each substitution is counted per layer (`ExpertTraffic.substitutions_per_layer`) of its request.

Each exchange reads top to bottom — split, place, send, take, combine — and tells its observers
(`odmoe.main.exchange_observers`) what happened: the accounting (per request, `RunContext.traffic`, an
`odmoe.main.expert_traffic.ExpertTraffic`: what several requests shared is split between them, so the
requests' sums are the cluster's totals), the timeline and fault injection watch; none of them
changes what is computed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from odmoe.config import PrefillConfig
from odmoe.lossy.miss_policy import TokenBudget
from odmoe.lossy.substitution import Substituter
from odmoe.main.exchange_observers import (
    DecodeExchange,
    Observers,
    PrefillExchange,
    Timeline,
    TrafficAccounting,
)
from odmoe.main.exchange_records import BatchCall, DecodeRows, RunContext
from odmoe.main.expert_traffic import ExpertTraffic, LayerClock
from odmoe.main.late_calls import LateCalls
from odmoe.main.lockstep import in_task, park
from odmoe.main.membership import Membership, WorkerUnavailable
from odmoe.main.recall import RecallCounter
from odmoe.main.shadow_link import ShadowLink
from odmoe.main.straggler_steering import StragglerSteering
from odmoe.main.stragglers import StragglerWatch
from odmoe.models.expert_math import combine, expert_input, split_by_expert
from odmoe.placement import LayerUnavailable, Topology
from odmoe.tools.trace import Tracer
from odmoe.transport.codec import CodecError
from odmoe.transport.dropped import DropLog
from odmoe.transport.messages import (
    ComputeExpert,
    ComputeExperts,
    EndRequest,
    ExpertResult,
    ExpertsResult,
    Pong,
    Prediction,
    Release,
    Step,
    from_frames,
    to_frames,
)
from odmoe.worker.expert_cache import complete

log = logging.getLogger("odmoe.main")
__all__ = ["DecodeRows", "ExpertTraffic", "RemoteExperts", "RunContext", "WorkerFailed", "WorkerUnavailable"]


class WorkerFailed(RuntimeError):
    """A worker answered but could not compute what it was asked (e.g. it lacks that expert)."""


@dataclass
class _Call:
    """One expert's rows of one step, and where they are now."""

    worker: int
    rows: torch.Tensor  # [n, H]
    expected: int  # answers to wait for (mini-batch parts computed one by one, else 1)
    parts: dict[int, torch.Tensor] = field(default_factory=dict)
    positions: list[int] = field(default_factory=list)  # "bmm": the rows' token positions

    @property
    def done(self) -> bool:
        return len(self.parts) == self.expected


@dataclass(frozen=True)
class PrefillLayer:
    """A request's prefill parked before exchanging this MoE layer (the engine meters prefills)."""

    layer: int


def owed_calls(calls: dict[int, _Call], lost: set[int]) -> dict[int, int]:
    """Pure: expert -> the lost worker it was placed on, for every call not fully answered yet.
    A call whose answer is in is kept, even from a worker lost since (it is correct)."""
    return {e: c.worker for e, c in calls.items() if not c.done and c.worker in lost}


class RemoteExperts:
    def __init__(
        self,
        members: Membership,
        num_experts: int,
        kernel: str,
        reply_timeout_s: float = 60.0,
        shadow: ShadowLink | None = None,
        prefill: PrefillConfig | None = None,
        tracer: Tracer | None = None,
        substituter: Substituter | None = None,
        stragglers: StragglerWatch | None = None,
        probe_every: int = 16,
        no_worker_grace_s: float = 0.0,
        move_horizon: int = 256,
        late: LateCalls | None = None,
    ):
        self.members = members
        # None: a late decode call waits for TCP; else its experts go again to a peer (late_calls)
        self.late = late
        # where no live worker holds a layer: how long to wait for one to come back before failing
        self.no_worker_grace_s = no_worker_grace_s
        # None: no steering. Judged from decode answers only (prefill's mini-batches time rows, not loads)
        self.stragglers = stragglers
        self.steering = (
            None if stragglers is None else StragglerSteering(stragglers, members, probe_every, move_horizon)
        )
        self.num_experts, self.kernel = num_experts, kernel
        self.shadow = shadow
        self.prefill = prefill or PrefillConfig()
        self.timeout_s = reply_timeout_s
        self.current = RunContext("")  # the request whose forward pass is running (the engine sets it)
        self.stream, self.tick = "", 0  # the decode batch's name and iteration (the engine sets them)
        self.batch: list[RunContext] | None = None  # batched decode: the requests, one row each
        self.cache_reports: dict[int, list[int]] = {}  # worker -> its cache's latest report (worker.cache)
        self.substituter = substituter  # None: every miss is reloaded (lossless)
        self.dropped = DropLog(log, "main")
        # accounting and the timeline watch every exchange; fault injection is added by main's node
        self._timeline = Timeline(tracer or Tracer("main"))
        self.observe = Observers(TrafficAccounting(), self._timeline)

    @property
    def topology(self) -> Topology:
        """Membership's: it learns the workers' cache rooms (weighted homes) once they have answered."""
        return self.members.topology

    @property
    def tracer(self) -> Tracer:
        return self._timeline.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer) -> None:
        self._timeline.tracer = tracer

    @property
    def traffic(self) -> ExpertTraffic:
        """The current request's (a lone request's, in tests and benchmarks)."""
        return self.current.traffic

    @property
    def emulated_links(self) -> dict[int, list[float]]:
        """worker -> [Gbit/s, ms] of its emulated load link (from its pong; absent when off)."""
        return {w: p.link for w, p in sorted(self.members.pongs.items()) if p.link}

    @property
    def device_bytes(self) -> dict[int, int]:
        """worker -> bytes its experts take on its device."""
        return {w: p.device_bytes for w, p in sorted(self.members.pongs.items())}

    def begin(self, request: str, iteration: int) -> None:
        """One request alone (no engine batch): its `iteration` runs next, in its own stream."""
        if request != self.current.request:
            self.current = RunContext(request, budget=self._budget())
        self.current.begin(iteration)
        self.stream, self.tick = request, iteration

    def caches_complete(self) -> bool:
        """Whether every live worker's cache holds every expert it serves
        (odmoe.worker.expert_cache.complete): a shadow's predictions would then load nothing."""
        return complete(self.cache_reports, sorted(self.members.live))

    def context(self, request: str) -> RunContext:
        return RunContext(request, budget=self._budget())

    def _budget(self) -> TokenBudget | None:
        return TokenBudget(self.substituter.cfg.budget) if self.substituter is not None else None

    def end_stream(self, stream: str) -> None:
        """Main's decode stream is over (no request runs): workers drop what they hold for it."""
        message = to_frames(EndRequest(stream))
        for worker in self.members.live:
            self.members.send(worker, message)

    def end_request(self) -> None:
        """A lone request is over (finished, failed or cancelled)."""
        self.end_stream(self.stream)

    # -- a layer's call ------------------------------------------------------------------------
    def __call__(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.batch is not None:  # one row per decoding request (odmoe.main.batched_decode)
            return self._decode_batch(layer, hidden, top_k_index, top_k_weights)
        ctx = self.current
        self.observe.layer_called(ctx, layer)
        if ctx.iteration <= 0:  # a prefill (0), or a prompt's scoring pass (-1)
            if in_task():
                park(PrefillLayer(layer))  # the engine resumes it when its prefill may go on this tick
                self.current = ctx
            return self._prefill_layer(ctx, layer, hidden, top_k_index, top_k_weights)
        rows = self._decode_rows(ctx, layer, hidden, top_k_index, top_k_weights)
        if in_task():
            return park(rows)  # the engine exchanges every running request's rows of this layer at once
        return self.exchange_decode(layer, [rows])[0]

    def decode_batch(self, contexts: list[RunContext] | None) -> None:
        """From now on (until None) a call's rows are one per request of `contexts`, in order."""
        self.batch = contexts

    def _decode_batch(self, layer: int, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        """Every decoding request's row of this layer in one exchange, each row split off as the
        request's own call would send it (outside any torch function mode: nothing of the data path
        is batched)."""
        with torch._C.DisableTorchFunction():
            rows = []
            for b, ctx in enumerate(self.batch or ()):
                self.observe.layer_called(ctx, layer)
                one = slice(b, b + 1)
                rows.append(self._decode_rows(ctx, layer, hidden[one], top_k_index[one], top_k_weights[one]))
            return torch.cat(self.exchange_decode(layer, rows))

    def _decode_rows(self, ctx: RunContext, layer: int, hidden, top_k_index, top_k_weights) -> DecodeRows:
        rows = DecodeRows(
            ctx,
            layer,
            hidden,
            top_k_index,
            top_k_weights,
            split_by_expert(top_k_index, self.num_experts, self.kernel),
            {},
            time.perf_counter(),
        )
        if self.substituter is not None:  # its router's scores are this request's now (the tap's latest)
            self.substituter.budget = ctx.budget
            rows.stand_in = self._stand_ins(ctx, layer, top_k_index, top_k_weights)
        return rows

    def _stand_ins(self, ctx: RunContext, layer: int, top_k_index, top_k_weights) -> dict[int, int]:
        """Lossy policy only: missing expert -> the resident one computed in its place, decided on
        the prediction as it stands now (what the workers preloaded)."""
        prediction = self.shadow.prediction(Step(self.stream, self.tick, layer)) if self.shadow else None
        predicted = prediction.experts if prediction is not None else None
        chosen = self.substituter.decide(layer, top_k_index, top_k_weights, predicted)
        if chosen:
            self.observe.substituted(ctx, layer, chosen)
            log.debug("iteration %d layer %d: missing -> stand-in %s", ctx.iteration, layer, chosen)
        return chosen

    # -- prefill: one request's exchange -------------------------------------------------------
    def _prefill_layer(self, ctx: RunContext, layer: int, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        """Split the prompt's rows by expert, place them over the workers, exchange, combine."""
        exchange = PrefillExchange(ctx, Step(ctx.request, ctx.iteration, layer))
        self.observe.entered(exchange.step)
        groups = split_by_expert(top_k_index, self.num_experts, self.kernel)
        exchange.experts = len(groups)
        placement = self._prefill_place(exchange.step, hidden.shape[0], groups)
        start = time.perf_counter()
        rows_of = {rows.expert: expert_input(hidden, rows, top_k_weights, self.kernel) for rows in groups}
        grouped = self._reference_shape(top_k_index)
        # "bmm": each expert's rows sit at their tokens' positions in the reference's [T] rows
        positions = {r.expert: r.token_idx.tolist() for r in groups} if self.kernel == "bmm" else {}
        outputs = self._exchange(exchange, rows_of, placement, LayerClock(), grouped, positions)
        if hidden.device.type != "cpu":  # answers arrive in host memory; combine where main computes
            outputs = {e: y.to(hidden.device) for e, y in outputs.items()}
        exchange.waited = time.perf_counter() - start
        self.observe.gathered(exchange.step)
        self.observe.prefill_done(exchange)
        parts = [(rows, outputs[rows.expert]) for rows in groups]
        return combine(hidden, parts, top_k_weights, self.kernel, self.num_experts)

    def _reference_shape(self, top_k_index: torch.Tensor) -> list[int]:
        """The shape of the reference's call over the layer that a worker mirrors (expert_math):
        grouped_mm's (T*k, E) over every (token, slot) pair, bmm's (T, E), else none."""
        if self.kernel == "grouped_mm":
            return [top_k_index.numel(), self.num_experts]
        if self.kernel == "bmm":
            return [top_k_index.shape[0], self.num_experts]
        return []

    def _prefill_place(self, step: Step, tokens: int, groups) -> dict[int, int]:
        """Prefill: spread over every live worker storing the layer, or with worker caches each
        expert to its home (`prefill.placement`); a one-token prompt: as decode places it."""
        layer, rule = step.layer, self.prefill.placement
        if rule in ("auto", "homes"):  # no caches, no homes: spread
            rule = "homes" if self.topology.homes else "modulo"

        def place() -> dict[int, int]:
            live, topology = self.members.live, self.topology
            if tokens > 1 and rule != "homes":
                counts = {rows.expert: len(rows.token_idx) for rows in groups}
                # stragglers are spared the prompt too (prefill is placed by main alone)
                holders = topology.steered(topology.live_holders(layer, live), 0)
                return topology.prefill_placement(counts, rule, holders)
            return topology.decode_placement(layer, [rows.expert for rows in groups], live)

        return self._placed(place)

    def _placed(self, place: Callable[[], dict[int, int]], why: str = "") -> dict[int, int]:
        """`place()`; where no live worker holds the layer, up to `no_worker_grace_s` spent taking
        lost workers back (a home router's hiccup can drop them all for a moment) before the
        request fails with WorkerUnavailable naming the layer."""
        try:
            return place()  # every decode layer: nothing more on this path unless no worker holds it
        except LayerUnavailable:
            pass
        deadline = time.monotonic() + self.no_worker_grace_s
        while True:
            self.members.maintain()
            try:
                return place()
            except LayerUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise WorkerUnavailable(f"{exc}{why}") from None
            time.sleep(0.05)

    # -- decode: every running request's rows of a layer at once --------------------------------
    def exchange_decode(self, layer: int, batch: list[DecodeRows]) -> list[torch.Tensor]:
        """Each request's experts output for this layer (in `batch` order), from one exchange: the
        union of their experts placed once, one ComputeExperts per worker."""
        x = DecodeExchange(Step(self.stream, self.tick, layer), batch, entered=time.perf_counter())
        self.observe.entered(x.step)
        x.prediction = self.shadow.prediction(x.step) if self.shadow is not None else None
        x.users = _rows_by_expert(batch, self.kernel)
        placement = self._decode_place(x.step, sorted(x.users), x.prediction)
        grouped = self._reference_shape(batch[0].top_k_index)
        x.started = time.perf_counter()
        # each worker's last (only) call says the layer is over for it; without a shadow nothing
        # is ever preloaded, so nothing to release
        releasing = self.shadow is not None
        x.calls = self._exchange_many(x, placement, grouped, releasing)
        x.gathered = time.perf_counter()
        outputs = self._split_answers(x)
        self.observe.gathered(x.step)
        if self.steering is not None:
            self.steering.judge(x.step, x.calls, x.overtaken, x.gathered)
        if releasing:
            self._release(x.step, x.calls)
        out = []
        for b, rows in enumerate(batch):
            parts = [(group, outputs[b][rows.computed(group.expert)]) for group in rows.groups]
            if rows.hidden.device.type != "cpu":
                parts = [(g, y.to(rows.hidden.device)) for g, y in parts]
            out.append(combine(rows.hidden, parts, rows.top_k_weights, self.kernel, self.num_experts))
        x.combined = time.perf_counter()
        self.observe.decode_done(x)
        return out

    def _release(self, step: Step, calls: list[BatchCall]) -> None:
        """The layer is over: every worker serving it that no releasing call told gets a Release."""
        called = {c.worker for c in calls if c.done and c.releases}
        release = to_frames(Release(step))
        for worker in [w for w in self._serving(step.layer) if w not in called]:
            self.members.send(worker, release)

    def _decode_place(self, step: Step, experts: list[int], prediction: Prediction | None) -> dict[int, int]:
        """Where the shadow's (union) prediction preloaded, the misses repaired (Topology)."""
        predicted = prediction.experts if prediction is not None else []
        hedges = prediction.hedges if prediction is not None else []
        return self._placed(
            lambda: self.topology.repair_placement(
                step.layer, predicted, experts, self.members.live, hedges, step.iteration
            )
        )

    def _exchange_many(
        self, x: DecodeExchange, placement: dict[int, int], grouped: list[int], releasing: bool
    ) -> list[BatchCall]:
        """One ComputeExperts per worker, gathered; what a lost worker owed is re-sent elsewhere."""
        step, users, clock = x.step, x.users, x.clock
        by_worker: dict[int, list[int]] = {}
        for expert in sorted(users):
            by_worker.setdefault(placement[expert], []).append(expert)
        # Every call is encoded before the first one leaves: a send wakes a worker (and ZeroMQ's I/O
        # threads), which on a machine with few cores can take main's core at once; the next call
        # would then leave only after that worker's whole computation.
        messages = {w: self._encode_many(step, es, users, grouped, releasing) for w, es in by_worker.items()}
        clock.sending = time.perf_counter()
        calls = [
            self._send_many(step, w, es, users, grouped, messages[w], releasing)
            for w, es in by_worker.items()
        ]
        deadline = time.monotonic() + self.timeout_s
        late = self.late.after_s() if self.late is not None else None
        again_at = None if late is None else clock.sending + late  # perf_counter's clock
        while owing := _owing(calls):
            wait_s = deadline - time.monotonic()
            if again_at is not None:
                wait_s = min(wait_s, again_at - time.perf_counter())
            received, lost = self.members.wait(math.ceil(max(wait_s, 0.0) * 1000))
            for worker, frames in received:
                arrived = time.perf_counter()
                result = self._take_many(step, calls, worker, frames, arrived)
                clock.take_s += time.perf_counter() - arrived
                if result is not None:
                    clock.answered, clock.worker_s = arrived, result.handled_s
            if lost:
                calls += self._resend_many(x, calls, set(lost), grouped)
            elif time.monotonic() >= deadline and any(not c.done for c in owing):
                # the per-call deadline: alive by heartbeat, yet silent (a frozen process)
                silent = {c.worker for c in owing if not c.done}
                for worker in silent:
                    self.members.mark_lost(
                        worker, f"no answer for layer {step.layer} within {self.timeout_s:g}s"
                    )
                calls += self._resend_many(x, calls, silent, grouped)
                deadline = time.monotonic() + self.timeout_s
            elif again_at is not None and time.perf_counter() >= again_at:
                calls += self._send_late_again(x, _owing(calls), grouped)
                again_at = None  # once per layer: a second loss in a row waits for TCP
        answered = [c for c in calls if c.done]
        if self.late is not None:
            self.late.note(answered)
            x.overtaken = [c for c in calls if not c.done and c.worker >= 0 and not c.again]
        return answered

    def _send_late_again(self, x: DecodeExchange, late: list[BatchCall], grouped) -> list[BatchCall]:
        """Each late call's experts sent again to the other live workers of their group (odmoe.main.
        late_calls); the late call stays open: whichever answer comes first is taken."""
        step, live = x.step, self.members.live
        again: list[BatchCall] = []
        for call in late:
            others = [w for w in live if w != call.worker]
            try:
                placed = self.topology.decode_placement(step.layer, call.experts, others, step.iteration)
            except LayerUnavailable:
                continue  # no other worker serves the layer: TCP's retransmission it is
            by_worker: dict[int, list[int]] = {}
            for expert in call.experts:
                by_worker.setdefault(placed[expert], []).append(expert)
            for worker, experts in by_worker.items():
                sent = self._send_many(step, worker, experts, x.users, grouped)
                sent.again = True
                again.append(sent)
            # the stats' resent_calls: every request whose rows went again, lost worker or late
            for b in {b for e in call.experts for b, _ in x.users[e]}:
                x.resent[b] = x.resent.get(b, 0) + 1
        if again:
            assert self.late is not None
            self.late.resent += len(again)
            log.info(
                "layer %d of %s: experts of late calls to workers %s sent again to %s",
                step.layer,
                step.request,
                sorted({c.worker for c in late}),
                sorted({c.worker for c in again}),
            )
        return again

    def _encode_many(self, step: Step, experts: list[int], users, grouped: list[int], release: bool) -> list:
        rows = [torch.cat([x for _, x in users[e]]) if len(users[e]) > 1 else users[e][0][1] for e in experts]
        segments = [[x.shape[0] for _, x in users[e]] for e in experts]
        return to_frames(ComputeExperts(step, experts, segments, self.kernel, grouped, release), rows)

    def _send_many(
        self, step: Step, worker: int, experts: list[int], users, grouped, frames=None, releases: bool = False
    ) -> BatchCall:
        """Send one worker its experts' rows. A worker that cannot take them is lost, and they go to
        its replacement (as one call: the replacement is one worker)."""
        frames = frames or self._encode_many(step, experts, users, grouped, False)
        while not self.members.send(worker, frames, copy=False):
            self.members.mark_lost(worker, "cannot take messages")
            worker = self._replacement(step, dict.fromkeys(experts, worker))[experts[0]]
            frames, releases = self._encode_many(step, experts, users, grouped, False), False
        self.observe.sent(step, experts)
        return BatchCall(worker, list(experts), releases, sent_at=time.perf_counter())

    def _resend_many(
        self, x: DecodeExchange, calls: list[BatchCall], lost: set[int], grouped
    ) -> list[BatchCall]:
        """Re-place and re-send the experts of every unanswered call on a lost worker; a re-sent
        call never releases (its new worker gets a Release after the layer if it got no call)."""
        step, users = x.step, x.users
        owed = {e: c.worker for c in _owing(calls) if c.worker in lost for e in c.experts}
        if not owed:
            return []
        for c in calls:
            if not c.done and c.worker in lost:
                c.worker = -1  # abandoned: an answer from the lost worker is never taken
        new = self._replacement(step, owed)
        by_worker: dict[int, list[int]] = {}
        for expert in sorted(owed):
            by_worker.setdefault(new[expert], []).append(expert)
        resent = [self._send_many(step, w, es, users, grouped) for w, es in by_worker.items()]
        for b in {b for e in owed for b, _ in users[e]}:  # every request whose rows went again
            x.resent[b] = x.resent.get(b, 0) + 1
        log.info(
            "layer %d of %s: re-sent experts %s to workers %s", step.layer, step.request, sorted(owed), new
        )
        return resent

    def _take_many(
        self, step: Step, calls: list[BatchCall], worker: int, frames, arrived: float = 0.0
    ) -> ExpertsResult | None:
        """Record one answer if it is one this layer waits for, from the worker its call is on
        (`arrived`: when main had its frames, for the call's wire time)."""
        try:
            result, tensors = from_frames(frames)
        except CodecError as exc:
            self.dropped.drop(f"from worker {worker}: {exc}")
            return None
        if not isinstance(result, ExpertsResult) or result.step != step or result.worker != worker:
            return None  # a Pong, or a late answer to an earlier, abandoned step
        call = next(
            (c for c in calls if c.worker == worker and c.experts == result.experts and not c.done), None
        )
        if call is None:
            return None  # re-sent elsewhere since, or a duplicate
        if result.error:
            raise WorkerFailed(f"worker {worker} failed on layer {step.layer}: {result.error}")
        n = len(call.experts)
        stats = (result.load_s, result.compute_s, result.bytes_loaded, result.preloaded, result.waited_s)
        if (
            len(tensors) != n
            or any(len(column) != n for column in stats)
            or any(t.dim() != 2 for t in tensors)
        ):
            self.dropped.drop(f"worker {worker} answered experts {call.experts} with malformed rows")
            return None
        self.observe.answered(step, call.experts)
        if result.cache:
            self.cache_reports[worker] = result.cache
        call.answer, call.answered_at = (result, tensors), arrived
        if arrived and call.sent_at:
            call.wire_s = max(0.0, arrived - call.sent_at - result.handled_s)
        return result

    def _split_answers(self, x: DecodeExchange) -> list[dict[int, torch.Tensor]]:
        """Each request's outputs by expert, cut from the answers' segments."""
        outputs: list[dict[int, torch.Tensor]] = [{} for _ in x.batch]
        for call in x.calls:
            assert call.answer is not None  # _exchange_many returns the answered calls
            result, tensors = call.answer
            for i, expert in enumerate(result.experts):
                segments = x.users[expert]
                sizes = [rows.shape[0] for _, rows in segments]
                if tensors[i].shape[0] != sum(sizes):
                    got = tensors[i].shape[0]
                    raise WorkerFailed(f"worker {call.worker} answered expert {expert} with {got} rows")
                pieces = torch.split(tensors[i], sizes) if len(sizes) > 1 else (tensors[i],)
                for (b, _), y in zip(segments, pieces, strict=True):
                    outputs[b][expert] = y
        return outputs

    def _serving(self, layer: int) -> list[int]:
        try:
            return self.topology.serving_group(layer, self.members.live)
        except LayerUnavailable:
            return []

    # -- prefill's per-expert calls --------------------------------------------------------------
    def _exchange(
        self,
        x: PrefillExchange,
        rows: dict[int, torch.Tensor],
        placement: dict[int, int],
        clock: LayerClock,
        grouped: list[int],
        positions: dict[int, list[int]],
    ) -> dict[int, torch.Tensor]:
        """Send every expert's rows, gather the answers; re-send what a lost worker owed."""
        step = x.step
        # Every call is encoded before the first one leaves (see _exchange_many).
        messages = {e: self._encode(step, e, x, grouped, positions.get(e, [])) for e, x in rows.items()}
        clock.sending = time.perf_counter()
        calls = {
            e: self._send(step, e, x, placement[e], grouped, positions.get(e, []), messages[e])
            for e, x in rows.items()
        }
        deadline = time.monotonic() + self.timeout_s
        done_s: list[float] = []  # seconds from the sends to each call's last answer
        moved = self.late is None  # late calls are moved once per layer
        while not all(c.done for c in calls.values()):
            wait_s = deadline - time.monotonic()
            late_at = None if moved else self.late.prefill_late_at(clock.sending, done_s, len(calls))
            if late_at is not None:
                wait_s = min(wait_s, late_at - time.perf_counter())
            received, lost = self.members.wait(math.ceil(max(wait_s, 0.0) * 1000))
            done = sum(c.done for c in calls.values())
            for worker, frames in received:
                self._take(x, calls, worker, frames)
            now_done = sum(c.done for c in calls.values())
            done_s += [time.perf_counter() - clock.sending] * (now_done - done)
            if lost:
                self._resend(x, calls, set(lost), grouped)
            if time.monotonic() >= deadline and not all(c.done for c in calls.values()):
                # the per-call deadline: alive by heartbeat, yet silent (a frozen process)
                silent = {c.worker for c in calls.values() if not c.done}
                for worker in silent:
                    self.members.mark_lost(
                        worker, f"no answer for layer {step.layer} within {self.timeout_s:g}s"
                    )
                self._resend(x, calls, silent, grouped)
                deadline = time.monotonic() + self.timeout_s
            elif late_at is not None and time.perf_counter() >= late_at:
                self._move_late(x, calls, grouped)
                moved = True
        return {
            e: torch.cat([c.parts[i] for i in sorted(c.parts)]) if len(c.parts) > 1 else c.parts[0]
            for e, c in calls.items()
        }

    def _encode(
        self, step: Step, expert: int, x: torch.Tensor, grouped: list[int], positions: list[int]
    ) -> list[list]:
        """One expert's rows as the frames of each message: one message, or prefill mini-batches
        (each with its rows' positions, "bmm")."""
        size = self.prefill.mini_batch if self.prefill.mini_batch > 0 else x.shape[0]
        size = max(size, 1)
        chunks = torch.split(x, size) if x.shape[0] > size else (x,)
        per_part = self.prefill.compute_per_mini_batch and len(chunks) > 1
        return [
            to_frames(
                ComputeExpert(
                    step,
                    expert,
                    self.kernel,
                    part=part,
                    parts=len(chunks),
                    per_part=per_part,
                    grouped_shape=grouped,
                    positions=positions[part * size : (part + 1) * size],
                ),
                [chunk],
            )
            for part, chunk in enumerate(chunks)
        ]

    def _send(
        self,
        step: Step,
        expert: int,
        x: torch.Tensor,
        worker: int,
        grouped: list[int],
        positions: list[int],
        messages: list[list] | None = None,
    ) -> _Call:
        """Send one expert's rows (`messages`: as `_encode` made them). A worker that cannot take
        them is lost, and the rows go to its replacement."""
        messages = messages or self._encode(step, expert, x, grouped, positions)
        while True:
            sent = True
            for frames in messages:
                sent = sent and self.members.send(worker, frames, copy=False)
            if sent:
                break
            self.members.mark_lost(worker, "cannot take messages")
            worker = self._replacement(step, {expert: worker})[expert]
        self.observe.sent(step, [expert])
        per_part = len(messages) > 1 and self.prefill.compute_per_mini_batch
        return _Call(worker, x, len(messages) if per_part else 1, positions=positions)

    def _replacement(self, step: Step, lost: dict[int, int]) -> dict[int, int]:
        return self._placed(
            lambda: self.topology.replace_lost(
                step.layer, lost, self.members.live, spread=step.iteration == 0, iteration=step.iteration
            ),
            f"; request {step.request} cannot go on",
        )

    def _resend(self, x: PrefillExchange, calls: dict[int, _Call], lost: set[int], grouped) -> None:
        step, owed = x.step, owed_calls(calls, lost)
        if not owed:
            return
        new = self._replacement(step, owed)
        for e in owed:
            calls[e] = self._send(step, e, calls[e].rows, new[e], grouped, calls[e].positions)
            x.resent += 1
        log.info(
            "layer %d of %s: re-sent experts %s to workers %s", step.layer, step.request, sorted(owed), new
        )

    def _move_late(self, x: PrefillExchange, calls: dict[int, _Call], grouped) -> None:
        """Each late prefill call placed again on another live holder of the layer (the old one's
        answer is then ignored: answers are taken from where a call is placed now). Moving rather
        than doubling: a prefill call's rows are many, and one call per expert is what _take keeps."""
        step, live = x.step, self.members.live
        late = {e: c.worker for e, c in calls.items() if not c.done}
        moved: dict[int, int] = {}
        for expert, worker in late.items():
            others = [w for w in live if w != worker]
            try:
                new = self.topology.replace_lost(step.layer, {expert: worker}, others, spread=True)[expert]
            except LayerUnavailable:
                continue  # no other holder: TCP's retransmission it is
            call = calls[expert]
            calls[expert] = self._send(step, expert, call.rows, new, grouped, call.positions)
            moved[expert] = new
            x.resent += 1  # the stats' resent_calls: every call sent again, lost worker or late
        if moved:
            assert self.late is not None
            self.late.resent += len(moved)
            log.info("layer %d of %s: late prefill experts moved %s", step.layer, step.request, moved)

    def _take(self, x: PrefillExchange, calls: dict[int, _Call], worker: int, frames) -> None:
        """Record one answer if it is one this step is waiting for, from the worker it is placed on."""
        step = x.step
        try:
            result, tensors = from_frames(frames)
        except CodecError as exc:
            self.dropped.drop(f"from worker {worker}: {exc}")
            return
        if not isinstance(result, ExpertResult) or result.step != step:
            return  # a Pong, or a late answer to an earlier, abandoned step
        call = calls.get(result.expert)
        if call is None or call.worker != worker or result.worker != worker or result.part in call.parts:
            return  # re-sent elsewhere since, or a duplicate
        if result.error:
            raise WorkerFailed(f"worker {worker} failed on layer {step.layer}: {result.error}")
        n = call.rows.shape[0] if call.expected == 1 else None
        if len(tensors) != 1 or tensors[0].dim() != 2 or (n is not None and tensors[0].shape[0] != n):
            self.dropped.drop(f"worker {worker} answered expert {result.expert} with malformed rows")
            return
        self.observe.answered(step, [result.expert])
        if result.cache:
            self.cache_reports[worker] = result.cache
        x.answers.append(result)
        call.parts[result.part] = tensors[0]

    # -- stats ---------------------------------------------------------------------------------
    def recall(self, ctx: RunContext | None = None, wait_s: float = 1.0) -> RecallCounter:
        """Recall as the paper defines it (accuracy of every prediction, whenever it arrived), for
        one request: waits up to wait_s for its predictions still in flight."""
        ctx = ctx or self.current
        counter = RecallCounter()
        predictions = (
            self.shadow.collect(ctx.request, list(ctx.traffic.activated), wait_s)
            if self.shadow is not None
            else {}
        )
        for (iteration, layer), experts in sorted(ctx.traffic.activated.items()):
            counter.add(iteration, layer, predictions.get((iteration, layer)), experts)
        return counter

    def ping_all(self, timeout_s: float, minimum: int = 0) -> list[Pong]:
        """Check every worker is up (or `minimum` of them: Membership.ping_all), is the worker its
        address says, and holds what it will be asked.

        Raises WorkerUnavailable naming the workers that stay silent or are misconfigured.
        """
        shadow_pub = self.shadow.pub_address if self.shadow is not None else ""
        return self.members.ping_all(timeout_s, shadow_pub, minimum)

    def close(self) -> None:
        self.members.close()


def _owing(calls: list[BatchCall]) -> list[BatchCall]:
    """The calls still waited for: unanswered, not abandoned, and with an expert no answered call
    (a late call's, or the one sent again for it) has brought."""
    answered = {e for c in calls if c.done for e in c.experts}
    return [c for c in calls if not c.done and c.worker >= 0 and not answered.issuperset(c.experts)]


def _rows_by_expert(batch: list[DecodeRows], kernel: str) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """expert -> [(request index, its rows of that expert)], requests in batch order; a lossy
    policy's stand-in is computed (and sent) in place of the missing expert."""
    users: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for b, rows in enumerate(batch):
        for group in rows.groups:
            x = expert_input(rows.hidden, group, rows.top_k_weights, kernel)
            users.setdefault(rows.computed(group.expert), []).append((b, x))
    return users
