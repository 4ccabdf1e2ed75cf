"""Main's side of the data plane: send a layer's expert rows to workers, gather, combine.

Contract: `RemoteExperts.__call__(layer, hidden[T, H], top_k_index[T, k], top_k_weights[T, k])`
returns exactly what transformers' experts module would have returned, computed by the workers.
It is attached to the main model (main_model.MainModel.attach) and called once per MoE layer of
every forward pass, for the request whose `RunContext` is `current` (the engine sets it before it
runs that request's forward pass).

Two exchanges, one message (`ComputeExperts`) and one send / wait / resend path (`_exchange`):
- prefill (a request's iteration 0): the request's own, as soon as it is called: every expert its
  prompt hits is spread over the live workers storing the layer, one call per expert (one segment;
  prompt mini-batches as several messages), named `(request, 0, layer)`.
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
from dataclasses import dataclass

import torch

from odmoe.config import PrefillConfig
from odmoe.lossy.miss_policy import TokenBudget
from odmoe.lossy.substitution import Substituter
from odmoe.main.exchange_observers import (
    DecodeExchange,
    Exchange,
    Observers,
    PrefillExchange,
    Timeline,
    TrafficAccounting,
)
from odmoe.main.exchange_records import BatchCall, DecodeRows, RunContext
from odmoe.main.expert_traffic import ExpertTraffic
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
    ComputeExperts,
    EndRequest,
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


@dataclass(frozen=True)
class PrefillLayer:
    """A request's prefill parked before exchanging this MoE layer (the engine meters prefills)."""

    layer: int


def owed_experts(calls: list[BatchCall], lost: set[int]) -> dict[int, int]:
    """Pure: expert -> the lost worker its call was placed on, for every call still waited for
    (`_owing`). A call whose answer is in is kept, even from a worker lost since (it is correct); a
    call half answered (some of its mini-batches) is owed whole."""
    return {e: c.worker for c in _owing(calls) if c.worker in lost for e in c.experts}


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
        x = PrefillExchange(ctx=ctx, step=Step(ctx.request, ctx.iteration, layer))
        self.observe.entered(x.step)
        groups = split_by_expert(top_k_index, self.num_experts, self.kernel)
        x.experts = len(groups)
        placement = self._prefill_place(x.step, hidden.shape[0], groups)
        start = time.perf_counter()
        x.users = {
            rows.expert: [(0, expert_input(hidden, rows, top_k_weights, self.kernel))] for rows in groups
        }
        # "bmm": each expert's rows sit at their tokens' positions in the reference's [T] rows
        x.positions = {r.expert: r.token_idx.tolist() for r in groups} if self.kernel == "bmm" else {}
        # one call per expert, so that its transfer overlaps the other experts' compute
        x.calls = self._exchange(x, _calls_of(placement, True), self._reference_shape(top_k_index))
        outputs = self._split_answers(x)[0]
        if hidden.device.type != "cpu":  # answers arrive in host memory; combine where main computes
            outputs = {e: y.to(hidden.device) for e, y in outputs.items()}
        x.waited = time.perf_counter() - start
        self.observe.gathered(x.step)
        self.observe.prefill_done(x)
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
        x = DecodeExchange(step=Step(self.stream, self.tick, layer), batch=batch, entered=time.perf_counter())
        self.observe.entered(x.step)
        x.prediction = self.shadow.prediction(x.step) if self.shadow is not None else None
        x.users = _rows_by_expert(batch, self.kernel)
        placement = self._decode_place(x.step, sorted(x.users), x.prediction)
        grouped = self._reference_shape(batch[0].top_k_index)
        x.started = time.perf_counter()
        # each worker's last (only) call says the layer is over for it; without a shadow nothing
        # is ever preloaded, so nothing to release
        releasing = self.shadow is not None
        x.calls = self._exchange(x, _calls_of(placement, False), grouped, releasing)
        x.gathered = time.perf_counter()
        outputs = self._split_answers(x, len(batch))
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

    # -- the one send / wait / resend path, prefill's and decode's ------------------------------
    def _exchange(
        self, x: Exchange, plan: list[tuple[int, list[int]]], grouped: list[int], releasing: bool = False
    ) -> list[BatchCall]:
        """Send each call of `plan` (a worker, its experts), gather the answers: what a lost or
        silent worker owed is re-sent elsewhere, the layer's late calls are sent again once. The
        answered calls."""
        step, clock = x.step, x.clock
        # Every call is encoded before the first one leaves: a send wakes a worker (and ZeroMQ's I/O
        # threads), which on a machine with few cores can take main's core at once; the next call
        # would then leave only after that worker's whole computation.
        messages = [self._encode(x, experts, grouped, releasing) for _, experts in plan]
        clock.sending = time.perf_counter()
        calls = [
            self._send(x, worker, experts, grouped, m, releasing)
            for (worker, experts), m in zip(plan, messages, strict=True)
        ]
        deadline = time.monotonic() + self.timeout_s
        done_s: list[float] = []  # seconds from the sends to each call's last answer
        late_sent = self.late is None  # once per layer: a second loss in a row waits for TCP
        while owing := _owing(calls):
            wait_s = deadline - time.monotonic()
            late_at = None if late_sent else self._late_at(x, done_s, len(calls))
            if late_at is not None:
                wait_s = min(wait_s, late_at - time.perf_counter())
            received, lost = self.members.wait(math.ceil(max(wait_s, 0.0) * 1000))
            for worker, frames in received:
                arrived = time.perf_counter()
                call = self._take(x, calls, worker, frames, arrived)
                clock.take_s += time.perf_counter() - arrived
                if call is not None and call.done:
                    clock.answered, clock.worker_s = arrived, call.answers[0][0].handled_s
                    done_s.append(arrived - clock.sending)
            if lost:
                calls += self._resend(x, calls, set(lost), grouped)
            elif time.monotonic() >= deadline and any(not c.done for c in owing):
                # the per-call deadline: alive by heartbeat, yet silent (a frozen process)
                silent = {c.worker for c in owing if not c.done}
                for worker in silent:
                    self.members.mark_lost(
                        worker, f"no answer for layer {step.layer} within {self.timeout_s:g}s"
                    )
                calls += self._resend(x, calls, silent, grouped)
                deadline = time.monotonic() + self.timeout_s
            elif late_at is not None and time.perf_counter() >= late_at:
                calls += self._send_late_again(x, _owing(calls), grouped)
                late_sent = True
        answered = [c for c in calls if c.done]
        x.answers = [result for c in calls for result, _ in c.answers.values()]
        if self.late is not None and step.iteration >= 1:
            self.late.note(answered)
            x.overtaken = [c for c in calls if not c.done and c.worker >= 0 and not c.again]
        return answered

    def _late_at(self, x: Exchange, done_s: list[float], calls: int) -> float | None:
        """When the layer's unanswered calls count as late (perf_counter; None: not yet, or never):
        a decode call a few usual round trips after the sends, a prefill's once half its calls are
        done (odmoe.main.late_calls)."""
        assert self.late is not None
        if x.step.iteration >= 1:
            after = self.late.after_s()
            return None if after is None else x.clock.sending + after
        return self.late.prefill_late_at(x.clock.sending, done_s, calls)

    def _encode(
        self, x: Exchange, experts: list[int], grouped: list[int], release: bool = False
    ) -> list[list]:
        """The frames of each message of one call: one ComputeExperts, or a prefill expert's rows in
        `prefill.mini_batch` messages (each with its rows' positions, "bmm")."""
        step, users = x.step, x.users
        rows = [torch.cat([r for _, r in users[e]]) if len(users[e]) > 1 else users[e][0][1] for e in experts]
        segments = [[r.shape[0] for _, r in users[e]] for e in experts]
        positions = [x.positions[e] for e in experts] if x.positions else []
        size = self.prefill.mini_batch
        if step.iteration >= 1 or len(experts) > 1 or size <= 0 or rows[0].shape[0] <= size:
            message = ComputeExperts(
                step, experts, segments, self.kernel, grouped, release, positions=positions
            )
            return [to_frames(message, rows)]
        chunks = torch.split(rows[0], size)
        return [
            to_frames(
                ComputeExperts(
                    step,
                    experts,
                    [[chunk.shape[0]]],
                    self.kernel,
                    grouped,
                    part=part,
                    parts=len(chunks),
                    per_part=self.prefill.compute_per_mini_batch,
                    positions=[positions[0][part * size : (part + 1) * size]] if positions else [],
                ),
                [chunk],
            )
            for part, chunk in enumerate(chunks)
        ]

    def _send(
        self, x: Exchange, worker: int, experts: list[int], grouped, messages=None, releases: bool = False
    ) -> BatchCall:
        """Send one call (`messages`: as `_encode` made them). A worker that cannot take them is
        lost, and the call goes to its replacement (one worker)."""
        step = x.step
        messages = messages or self._encode(x, experts, grouped)
        while not all(self.members.send(worker, frames, copy=False) for frames in messages):
            self.members.mark_lost(worker, "cannot take messages")
            worker = self._replacement(step, dict.fromkeys(experts, worker))[experts[0]]
            messages, releases = self._encode(x, experts, grouped), False
        self.observe.sent(step, experts)
        expected = len(messages) if len(messages) > 1 and self.prefill.compute_per_mini_batch else 1
        return BatchCall(worker, list(experts), releases, expected, sent_at=time.perf_counter())

    def _resend(self, x: Exchange, calls: list[BatchCall], lost: set[int], grouped) -> list[BatchCall]:
        """Re-place and re-send the experts of every unanswered call on a lost worker; a re-sent
        call never releases (its new worker gets a Release after the layer if it got no call)."""
        step = x.step
        owed = owed_experts(calls, lost)
        if not owed:
            return []
        for c in calls:
            if not c.done and c.worker in lost:
                c.worker = -1  # abandoned: an answer from the lost worker is never taken
        new = self._replacement(step, owed)
        resent = [self._send(x, w, es, grouped) for w, es in _calls_of(new, step.iteration <= 0)]
        _count_resent(x, resent)
        log.info(
            "layer %d of %s: re-sent experts %s to workers %s", step.layer, step.request, sorted(owed), new
        )
        return resent

    def _send_late_again(self, x: Exchange, late: list[BatchCall], grouped) -> list[BatchCall]:
        """Each late call's experts sent again to the other live workers that serve them (odmoe.main.
        late_calls). A decode call stays open: whichever answer comes first is taken. A prefill call
        is moved (its old answer is then never taken): its rows are many, so not sent twice over."""
        step, live = x.step, self.members.live
        again: list[BatchCall] = []
        for call in late:
            others = [w for w in live if w != call.worker]
            try:
                placed = self.topology.replace_lost(
                    step.layer,
                    dict.fromkeys(call.experts, call.worker),
                    others,
                    step.iteration == 0,
                    step.iteration,
                )
            except LayerUnavailable:
                continue  # no other worker serves the layer: TCP's retransmission it is
            if step.iteration <= 0:
                call.worker = -1
            for worker, experts in _calls_of(placed, step.iteration <= 0):
                sent = self._send(x, worker, experts, grouped)
                sent.again = True
                again.append(sent)
        if again:
            assert self.late is not None
            self.late.resent += len(again)
            _count_resent(x, again)  # the stats' resent_calls: every call sent again, lost worker or late
            log.info(
                "layer %d of %s: experts of late calls to workers %s sent again to %s",
                step.layer,
                step.request,
                sorted({c.worker for c in late}),
                sorted({c.worker for c in again}),
            )
        return again

    def _take(
        self, x: Exchange, calls: list[BatchCall], worker: int, frames, arrived: float
    ) -> BatchCall | None:
        """Record one answer if it is one this layer waits for, from the worker its call is on now
        (`arrived`: when main had its frames, for the call's wire time); the call it answered."""
        step = x.step
        try:
            result, tensors = from_frames(frames)
        except CodecError as exc:
            self.dropped.drop(f"from worker {worker}: {exc}")
            return None
        if not isinstance(result, ExpertsResult) or result.step != step or result.worker != worker:
            return None  # a Pong, or a late answer to an earlier, abandoned step
        call = next(
            (
                c
                for c in calls
                if c.worker == worker
                and c.experts == result.experts
                and not c.done
                and result.part not in c.answers
            ),
            None,
        )
        if call is None:
            return None  # re-sent elsewhere since, or a duplicate
        if result.error:
            raise WorkerFailed(f"worker {worker} failed on layer {step.layer}: {result.error}")
        if problem := _answer_problem(x, call, result, tensors):
            self.dropped.drop(f"worker {worker} answered experts {call.experts} with {problem}")
            return None
        self.observe.answered(step, call.experts)
        if result.cache:
            self.cache_reports[worker] = result.cache
        call.answers[result.part] = (result, tensors)
        call.answered_at = arrived
        if call.done and call.sent_at:
            call.wire_s = max(0.0, arrived - call.sent_at - result.handled_s)
        return call

    def _split_answers(self, x: Exchange, requests: int = 1) -> list[dict[int, torch.Tensor]]:
        """Each request's outputs by expert, cut from the answers' segments."""
        outputs: list[dict[int, torch.Tensor]] = [{} for _ in range(requests)]
        for call in x.calls:
            for expert, y in zip(call.experts, call.outputs(), strict=True):
                segments = x.users[expert]
                pieces = torch.split(y, [r.shape[0] for _, r in segments]) if len(segments) > 1 else (y,)
                for (b, _), piece in zip(segments, pieces, strict=True):
                    outputs[b][expert] = piece
        return outputs

    def _serving(self, layer: int) -> list[int]:
        try:
            return self.topology.serving_group(layer, self.members.live)
        except LayerUnavailable:
            return []

    def _replacement(self, step: Step, lost: dict[int, int]) -> dict[int, int]:
        return self._placed(
            lambda: self.topology.replace_lost(
                step.layer, lost, self.members.live, spread=step.iteration == 0, iteration=step.iteration
            ),
            f"; request {step.request} cannot go on",
        )

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


def _calls_of(placement: dict[int, int], one_per_expert: bool) -> list[tuple[int, list[int]]]:
    """The calls a placement (expert -> worker) makes: one per worker with all its experts (decode),
    or one per expert (prefill: each expert's transfer overlaps the others' compute)."""
    if one_per_expert:
        return [(placement[e], [e]) for e in sorted(placement)]
    by_worker: dict[int, list[int]] = {}
    for expert in sorted(placement):
        by_worker.setdefault(placement[expert], []).append(expert)
    return list(by_worker.items())


def _count_resent(x: Exchange, calls: list[BatchCall]) -> None:
    """The stats' resent_calls: each call sent again counts for every request whose rows it took."""
    for call in calls:
        for b in {b for e in call.experts for b, _ in x.users[e]}:
            x.resent[b] = x.resent.get(b, 0) + 1


def _answer_problem(x: Exchange, call: BatchCall, result: ExpertsResult, tensors: list[torch.Tensor]) -> str:
    """What is wrong with an answer's rows for `call`, or "": one 2-D tensor and one figure of each
    column per expert, each with its segments' rows (a mini-batch's: any rows)."""
    n = len(call.experts)
    columns = (result.load_s, result.compute_s, result.bytes_loaded, result.preloaded, result.waited_s)
    if len(tensors) != n or any(len(column) != n for column in columns) or any(t.dim() != 2 for t in tensors):
        return "malformed rows"
    if call.expected == 1:
        for expert, y in zip(call.experts, tensors, strict=True):
            if y.shape[0] != sum(r.shape[0] for _, r in x.users[expert]):
                return f"{y.shape[0]} rows for expert {expert}"
    return ""


def _rows_by_expert(batch: list[DecodeRows], kernel: str) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """expert -> [(request index, its rows of that expert)], requests in batch order; a lossy
    policy's stand-in is computed (and sent) in place of the missing expert."""
    users: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for b, rows in enumerate(batch):
        for group in rows.groups:
            x = expert_input(rows.hidden, group, rows.top_k_weights, kernel)
            users.setdefault(rows.computed(group.expert), []).append((b, x))
    return users
