"""Main's side of the data plane: send a layer's expert rows to workers, gather, combine.

Contract: `RemoteExperts.__call__(layer, hidden[T, H], top_k_index[T, k], top_k_weights[T, k])`
returns exactly what transformers' experts module would have returned, computed by the workers.
It is attached to the main model (main_model.MainModel.attach) and called once per MoE layer of
every forward pass, for the `ForwardPass` the engine runs it in (`exchange_records.forward_pass`:
the request, or the batched pass's requests, and the decode tick that names its exchanges).

Two exchanges, one message (`ComputeExperts`) and one send / wait / resend path
(`odmoe.main.worker_calls`):
- prefill (a request's iteration 0): the request's own, as soon as it is called: every expert its
  prompt hits is spread over the live workers storing the layer, one call per expert (one segment;
  prompt mini-batches as several messages), named `(request, 0, layer)`.
- decode: inside the engine's lockstep (`odmoe.lockstep`) the call parks with the request's
  `DecodeRows` and the engine hands every running request's rows of that layer to
  `exchange_decode` at once, named `(stream, tick, layer)` by the engine: each expert any of them
  needs is placed once (where the shadow's prediction, the union over the requests, preloaded
  it), every worker gets one ComputeExperts with all its experts' rows, request by request in
  segments it computes as each request's own call would (odmoe.worker.stacked_segments), and each
  request's output is combined from its own rows exactly as when it runs alone. A call
  outside a lockstep task (the batched pass; a test's lone call) makes the same exchange at once.

Failures (`odmoe.main.worker_calls`): what a lost, silent or late call owed is sent again to a live
worker that stores the layer; when none does (after `no_worker_grace_s`) the exchange fails with
`WorkerUnavailable` naming the layer; a worker that answers with an error raises `WorkerFailed`.

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
import time
from dataclasses import dataclass

import torch

from odmoe.config import PrefillConfig
from odmoe.lockstep import in_task, park
from odmoe.lossy.miss_policy import TokenBudget
from odmoe.lossy.substitution import Substituter
from odmoe.main.exchange_observers import (
    DecodeExchange,
    Observers,
    PrefillExchange,
    Timeline,
    TrafficAccounting,
)
from odmoe.main.exchange_records import DecodeRows, ForwardPass, RunContext, current_pass
from odmoe.main.expert_traffic import ExpertTraffic
from odmoe.main.late_calls import LateCalls
from odmoe.main.membership import Membership, WorkerUnavailable
from odmoe.main.recall import RecallCounter
from odmoe.main.shadow_link import ShadowLink
from odmoe.main.straggler_steering import StragglerSteering
from odmoe.main.stragglers import StragglerWatch
from odmoe.main.worker_calls import WorkerCalls, WorkerFailed, calls_of, split_answers
from odmoe.models.expert_math import combine, expert_input, split_by_expert
from odmoe.tools.trace import Tracer
from odmoe.transport.messages import (
    EndRequest,
    Pong,
    Step,
    to_frames,
)
from odmoe.worker.expert_cache import complete

log = logging.getLogger("odmoe.main")
__all__ = ["DecodeRows", "ExpertTraffic", "RemoteExperts", "RunContext", "WorkerFailed", "WorkerUnavailable"]


@dataclass(frozen=True)
class PrefillLayer:
    """A request's prefill parked before exchanging this MoE layer (the engine meters prefills)."""

    layer: int


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
        self.late = late  # the late calls' rules and counts (the stats' late_calls); None: off
        # None: no steering. Judged from decode answers only (prefill's mini-batches time rows, not loads)
        self.stragglers = stragglers
        self.steering = (
            None if stragglers is None else StragglerSteering(stragglers, members, probe_every, move_horizon)
        )
        self.num_experts, self.kernel = num_experts, kernel
        self.shadow = shadow
        self.substituter = substituter  # None: every miss is reloaded (lossless)
        # accounting and the timeline watch every exchange; fault injection is added by main's node
        self._timeline = Timeline(tracer or Tracer("main"))
        self.observe = Observers(TrafficAccounting(), self._timeline)
        # the calls to the workers: sent, waited for, sent again (odmoe.main.worker_calls)
        self.calls = WorkerCalls(
            members, kernel, self.observe, prefill, reply_timeout_s, late, no_worker_grace_s
        )

    @property
    def tracer(self) -> Tracer:
        return self._timeline.tracer

    @tracer.setter
    def tracer(self, tracer: Tracer) -> None:
        self._timeline.tracer = tracer

    def caches_complete(self) -> bool:
        """Whether every live worker's cache holds every expert it serves
        (odmoe.worker.expert_cache.complete): a shadow's predictions would then load nothing."""
        return complete(self.calls.cache_reports, sorted(self.members.live))

    def context(self, request: str) -> RunContext:
        """A new running request's context (its lossy budget, where a miss policy is on)."""
        budget = TokenBudget(self.substituter.cfg.budget) if self.substituter is not None else None
        return RunContext(request, budget=budget)

    def end_stream(self, stream: str) -> None:
        """Main's decode stream is over (no request runs): workers drop what they hold for it."""
        message = to_frames(EndRequest(stream))
        for worker in self.members.live:
            self.members.send(worker, message)

    # -- a layer's call ------------------------------------------------------------------------
    def __call__(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        running = current_pass()
        if running.rows:  # one row per decoding request (odmoe.main.batched_decode)
            return self._decode_batch(running, layer, hidden, top_k_index, top_k_weights)
        ctx = running.runs[0]
        self.observe.layer_called(ctx, layer)
        if ctx.iteration <= 0:  # a prefill (0), or a prompt's scoring pass (-1)
            if in_task():
                park(PrefillLayer(layer))  # the engine resumes it when its prefill may go on this tick
            return self._prefill_layer(ctx, layer, hidden, top_k_index, top_k_weights)
        rows = self._decode_rows(running, ctx, layer, hidden, top_k_index, top_k_weights)
        if in_task():
            return park(rows)  # the engine exchanges every running request's rows of this layer at once
        return self.exchange_decode(Step(running.stream, running.tick, layer), [rows])[0]

    def _decode_batch(
        self, running: ForwardPass, layer: int, hidden, top_k_index, top_k_weights
    ) -> torch.Tensor:
        """Every decoding request's row of this layer in one exchange, each row split off as the
        request's own call would send it (outside any torch function mode: nothing of the data path
        is batched)."""
        with torch._C.DisableTorchFunction():
            rows = []
            for b, ctx in enumerate(running.runs):
                self.observe.layer_called(ctx, layer)
                one = slice(b, b + 1)
                rows.append(
                    self._decode_rows(running, ctx, layer, hidden[one], top_k_index[one], top_k_weights[one])
                )
            return torch.cat(self.exchange_decode(Step(running.stream, running.tick, layer), rows))

    def _decode_rows(
        self, running: ForwardPass, ctx: RunContext, layer: int, hidden, top_k_index, top_k_weights
    ) -> DecodeRows:
        groups = split_by_expert(top_k_index, self.num_experts, self.kernel)
        rows = DecodeRows(ctx, layer, hidden, top_k_index, top_k_weights, groups, {})
        if self.substituter is not None:  # its router's scores are this request's now (the tap's latest)
            self.substituter.budget = ctx.budget
            rows.stand_in = self._stand_ins(
                ctx, Step(running.stream, running.tick, layer), top_k_index, top_k_weights
            )
        return rows

    def _stand_ins(self, ctx: RunContext, step: Step, top_k_index, top_k_weights) -> dict[int, int]:
        """Lossy policy only: missing expert -> the resident one computed in its place, decided on
        the prediction as it stands now (what the workers preloaded)."""
        layer = step.layer
        prediction = self.shadow.prediction(step) if self.shadow else None
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
        placement = self.calls.prefill_placement(x.step, hidden.shape[0], groups)
        start = time.perf_counter()
        x.users = {
            rows.expert: [(0, expert_input(hidden, rows, top_k_weights, self.kernel))] for rows in groups
        }
        # "bmm": each expert's rows sit at their tokens' positions in the reference's [T] rows
        x.positions = {r.expert: r.token_idx.tolist() for r in groups} if self.kernel == "bmm" else {}
        # one call per expert, so that its transfer overlaps the other experts' compute
        grouped = reference_shape(self.kernel, top_k_index, self.num_experts)
        x.calls = self.calls.exchange(x, calls_of(placement, True), grouped)
        outputs = split_answers(x)[0]
        if hidden.device.type != "cpu":  # answers arrive in host memory; combine where main computes
            outputs = {e: y.to(hidden.device) for e, y in outputs.items()}
        x.waited = time.perf_counter() - start
        self.observe.gathered(x.step)
        self.observe.prefill_done(x)
        parts = [(rows, outputs[rows.expert]) for rows in groups]
        return combine(hidden, parts, top_k_weights, self.kernel, self.num_experts)

    # -- decode: every running request's rows of a layer at once --------------------------------
    def exchange_decode(self, step: Step, batch: list[DecodeRows]) -> list[torch.Tensor]:
        """Each request's experts output for the layer `step` names (in `batch` order), from one
        exchange: the union of their experts placed once, one ComputeExperts per worker."""
        x = DecodeExchange(step=step, batch=batch, entered=time.perf_counter())
        self.observe.entered(x.step)
        x.prediction = self.shadow.prediction(x.step) if self.shadow is not None else None
        x.users = _rows_by_expert(batch, self.kernel)
        placement = self.calls.decode_placement(x.step, sorted(x.users), x.prediction)
        grouped = reference_shape(self.kernel, batch[0].top_k_index, self.num_experts)
        x.started = time.perf_counter()
        # each worker's last (only) call says the layer is over for it; without a shadow nothing
        # is ever preloaded, so nothing to release
        releasing = self.shadow is not None
        x.calls = self.calls.exchange(x, calls_of(placement, False), grouped, releasing)
        x.gathered = time.perf_counter()
        outputs = split_answers(x, len(batch))
        self.observe.gathered(x.step)
        if self.steering is not None:
            self.steering.judge(x.step, x.calls, x.overtaken, x.gathered)
        if releasing:
            self.calls.release(x.step, x.calls)
        out = []
        for b, rows in enumerate(batch):
            parts = [(group, outputs[b][rows.computed(group.expert)]) for group in rows.groups]
            if rows.hidden.device.type != "cpu":
                parts = [(g, y.to(rows.hidden.device)) for g, y in parts]
            out.append(combine(rows.hidden, parts, rows.top_k_weights, self.kernel, self.num_experts))
        x.combined = time.perf_counter()
        self.observe.decode_done(x)
        return out

    # -- stats ---------------------------------------------------------------------------------
    def recall(self, ctx: RunContext, wait_s: float = 1.0) -> RecallCounter:
        """Recall as the paper defines it (accuracy of every prediction, whenever it arrived), for
        one request: waits up to wait_s for its predictions still in flight."""
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


def reference_shape(kernel: str, top_k_index: torch.Tensor, experts: int) -> list[int]:
    """The shape of the reference's call over the layer that a worker mirrors (expert_math):
    grouped_mm's (T*k, E) over every (token, slot) pair, bmm's (T, E), else none."""
    if kernel == "grouped_mm":
        return [top_k_index.numel(), experts]
    if kernel == "bmm":
        return [top_k_index.shape[0], experts]
    return []


def _rows_by_expert(batch: list[DecodeRows], kernel: str) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """expert -> [(request index, its rows of that expert)], requests in batch order; a lossy
    policy's stand-in is computed (and sent) in place of the missing expert."""
    users: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for b, rows in enumerate(batch):
        for group in rows.groups:
            x = expert_input(rows.hidden, group, rows.top_k_weights, kernel)
            users.setdefault(rows.computed(group.expert), []).append((b, x))
    return users
