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
- decode: inside the engine's lockstep (`odmoe.lockstep`) the call parks with the request's
  `DecodeRows` and the engine hands every running request's rows of that layer to
  `exchange_decode` at once, named `(stream, tick, layer)`: each expert any of them needs is placed
  once (where the shadow's prediction, the union over the requests, preloaded it), every worker gets
  one ComputeExperts with all its experts' rows, request by request in segments it computes apart,
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

Misses: by default a missed expert is loaded and waited for (lossless). With a lossy miss policy
(`odmoe.substitution`, opt-in) a decode miss may instead be computed by a resident expert, the
predicted one its worker preloaded: main asks that worker for the resident expert by name, so the
worker computes exactly what main combines, and the result takes the missing expert's gate weight.
Each substitution is counted per layer (`ExpertTraffic.substitutions_per_layer`) of its request.

Accounting is per request (`RunContext.traffic`): what several requests shared (an expert loaded
once for all of them) is split between them, so the requests' sums are the cluster's totals.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from odmoe.codec import CodecError
from odmoe.config import PrefillConfig
from odmoe.dropped import DropLog
from odmoe.expert_cache import complete
from odmoe.expert_math import ExpertRows, combine, split_by_expert
from odmoe.faults import FaultTrigger
from odmoe.lockstep import in_task, park
from odmoe.membership import Membership, WorkerUnavailable
from odmoe.messages import (
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
from odmoe.miss_policy import TokenBudget
from odmoe.placement import LayerUnavailable
from odmoe.recall import RecallCounter
from odmoe.shadow_link import ShadowLink
from odmoe.substitution import Substituter
from odmoe.trace import Tracer, now_us

log = logging.getLogger("odmoe.main")
__all__ = ["DecodeRows", "ExpertTraffic", "RemoteExperts", "RunContext", "WorkerFailed", "WorkerUnavailable"]


class WorkerFailed(RuntimeError):
    """A worker answered but could not compute what it was asked (e.g. it lacks that expert)."""


@dataclass
class ExpertTraffic:
    """What the workers did for one request (summed over layers and iterations)."""

    wait_s: float = 0.0  # main blocked on workers (transfer + load + compute as seen by main)
    worker_peak_rss: dict[int, int] = field(default_factory=dict)
    worker_device_peak: dict[int, int] = field(default_factory=dict)  # CUDA max_memory_allocated
    preloaded: int = 0  # decode experts the shadow's prediction had already loaded
    reloads: int = 0  # decode experts loaded only after main asked (misses)
    # decode: per layer, summed over iterations, the longest any worker made main wait for a load
    stall_s_per_layer: dict[int, float] = field(default_factory=dict)
    # Predictions as they stood when main needed them (late = missing): what the workers could use.
    timely_recall: RecallCounter = field(default_factory=RecallCounter)
    activated: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (iteration, layer) -> experts
    resent: int = 0  # calls re-sent to another worker after theirs was lost
    # lossy miss policy: layer -> missed experts computed by a resident stand-in (0 everywhere: exact)
    substitutions_per_layer: dict[int, int] = field(default_factory=dict)
    # every substitution as (iteration, layer, missing expert, expert computed in its place)
    substituted: list[tuple[int, int, int, int]] = field(default_factory=list)
    # worker -> {"experts", "bytes_loaded", "load_s", "compute_s"}; the request's totals are their sums
    per_worker: dict[int, dict] = field(default_factory=dict)
    # hedged prefetch (odmoe.hedging): worker -> its latest [hedge loads, hedges used, bytes hedges loaded]
    hedging: dict[int, list[int]] = field(default_factory=dict)
    hedge_hits: int = 0  # activated experts the shadow had hedged (not predicted) and that arrived in time
    # worker.cache: experts computed from a worker's cache (no load), the bytes those loads would have
    # moved, and each worker's cache as of its latest answer (CacheBook.report)
    cache_hits: float = 0
    cache_bytes_saved: float = 0
    cache_hits_per_layer: dict[int, float] = field(default_factory=dict)
    cache: dict[int, list[int]] = field(default_factory=dict)

    # decode iterations only: what the pipeline model needs (main's own time = decode time - wait),
    # and where a layer's time goes (summed over layers, `_LayerClock`): main splitting, placing and
    # encoding; the round trip from the first send to the last answer, of which that worker handled
    # `worker_s`; main decoding answers; main combining them
    decode: dict = field(
        default_factory=lambda: {
            "wait_s": 0.0,
            "layers": 0,
            "experts": 0,
            "compute_s": 0.0,
            "loads": 0,
            "load_s": 0.0,
            "prepare_s": 0.0,
            "round_trip_s": 0.0,
            "worker_s": 0.0,
            "take_s": 0.0,
            "combine_s": 0.0,
        }
    )
    prefill: dict = field(
        default_factory=lambda: {
            "wait_s": 0.0,
            "load_s": 0.0,
            "compute_s": 0.0,
            "critical_s": 0.0,
            "experts_per_layer": {},
        }
    )
    _layer_busy: dict[int, float] = field(default_factory=dict)  # worker -> load+compute in this layer

    def _total(self, key: str):
        return sum(row[key] for row in self.per_worker.values())

    @property
    def experts_loaded(self) -> int:
        return self._total("experts")

    @property
    def bytes_loaded(self) -> int:
        return self._total("bytes_loaded")

    @property
    def load_s(self) -> float:
        return self._total("load_s")

    @property
    def compute_s(self) -> float:
        return self._total("compute_s")

    def note_prefill_layer(self, layer: int, waited: float, experts: int) -> None:
        p = self.prefill
        p["wait_s"] += waited
        p["critical_s"] += max(self._layer_busy.values(), default=0.0)  # the busiest worker bounds the layer
        p["experts_per_layer"][layer] = experts
        self._layer_busy = {}

    def add(self, result: ExpertResult) -> None:
        """One prefill answer (a ComputeExpert's; a prompt's scoring pass counts as prefill)."""
        if result.step.iteration <= 0:
            self.prefill["load_s"] += result.load_s
            self.prefill["compute_s"] += result.compute_s
            busy = self._layer_busy
            busy[result.worker] = busy.get(result.worker, 0.0) + result.load_s + result.compute_s
        else:
            self._add_decode(result.load_s, result.compute_s, result.bytes_loaded)
        self._add_worker(result.worker, result.peak_rss, result.device_peak_bytes)
        self._add_expert(
            result.worker, result.part == 0, result.bytes_loaded, result.load_s, result.compute_s
        )
        if result.cached and result.part == 0:
            self._cache_hit(result.step.layer, 1, result.cached)
        if result.cache:
            self.cache[result.worker] = result.cache

    def add_share(self, result: ExpertsResult, i: int, share: int, of: int) -> None:
        """This request's `share` of `of` segments of expert `result.experts[i]` (a decode answer):
        what loading and computing it cost, split by segments so the requests' sums are the totals."""
        part = share / of if of > 1 else share  # an int when nothing is shared: a lone request's stats
        load_s, compute_s = result.load_s[i] * part, result.compute_s[i] * part
        nbytes = result.bytes_loaded[i] * part
        self._add_decode(load_s, compute_s, nbytes, part)
        self._add_worker(result.worker, result.peak_rss, result.device_peak_bytes)
        self._add_expert(result.worker, part, nbytes, load_s, compute_s)
        if result.cached and result.cached[i]:
            self._cache_hit(result.step.layer, part, result.cached[i] * part)
        if result.cache:
            self.cache[result.worker] = result.cache

    def _cache_hit(self, layer: int, count: float, saved: float) -> None:
        self.cache_hits += count
        self.cache_bytes_saved += saved
        self.cache_hits_per_layer[layer] = self.cache_hits_per_layer.get(layer, 0) + count

    def _add_decode(self, load_s: float, compute_s: float, nbytes: float, count: float = 1) -> None:
        d = self.decode
        d["experts"] += count
        d["compute_s"] += compute_s
        d["loads"] += count if nbytes > 0 else 0
        d["load_s"] += load_s

    def _add_worker(self, worker: int, peak_rss: int, device_peak: int) -> None:
        self.worker_peak_rss[worker] = max(self.worker_peak_rss.get(worker, 0), peak_rss)
        self.worker_device_peak[worker] = max(self.worker_device_peak.get(worker, 0), device_peak)

    def _add_expert(self, worker: int, count: float, nbytes: float, load_s: float, compute_s: float) -> None:
        w = self.per_worker.setdefault(
            worker, {"experts": 0, "bytes_loaded": 0, "load_s": 0.0, "compute_s": 0.0}
        )
        w["experts"] += count
        w["bytes_loaded"] += nbytes
        w["load_s"] += load_s
        w["compute_s"] += compute_s


@dataclass
class _LayerClock:
    """perf_counter stamps of one layer's exchange on main (seconds)."""

    sending: float = 0.0  # every call encoded, the first about to be handed to ZeroMQ
    answered: float = 0.0  # the last answer's frames in hand
    worker_s: float = 0.0  # how long that answer's worker handled its call (its `handled_s`)
    take_s: float = 0.0  # decoding and checking every answer

    def note(self, decode: dict, entered: float, gathered: float, combined: float) -> None:
        decode["prepare_s"] += self.sending - entered
        # from the first send: a send can cost main its core at once (to the worker it woke), so
        # a stamp after the sends would count the workers' time as main's
        decode["round_trip_s"] += self.answered - self.sending
        decode["worker_s"] += self.worker_s
        decode["take_s"] += self.take_s
        decode["combine_s"] += combined - gathered


@dataclass
class _Call:
    """One expert's rows of one step, and where they are now."""

    worker: int
    rows: torch.Tensor  # [n, H]
    expected: int  # answers to wait for (mini-batch parts computed one by one, else 1)
    parts: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return len(self.parts) == self.expected


@dataclass
class RunContext:
    """One running request as the data plane sees it: its name, the iteration its forward pass is
    computing (0: prefill), and what its exchanges cost it."""

    request: str
    iteration: int = 0
    traffic: ExpertTraffic = field(default_factory=ExpertTraffic)
    budget: TokenBudget | None = None  # lossy miss policy: substitutions left to this token

    def begin(self, iteration: int) -> None:
        self.iteration = iteration
        if self.budget is not None:
            self.budget.reset()


@dataclass
class DecodeRows:
    """One request's share of a decode layer: its token's row, its router's choice, its groups."""

    ctx: RunContext
    layer: int
    hidden: torch.Tensor  # [1, H]
    top_k_index: torch.Tensor  # [1, k]
    top_k_weights: torch.Tensor  # [1, k]
    groups: list[ExpertRows]  # the experts it routes to, ascending
    stand_in: dict[int, int]  # lossy only: missing expert -> the resident one computed instead
    entered: float = 0.0  # perf_counter when its call began

    @property
    def experts(self) -> list[int]:
        return [rows.expert for rows in self.groups]

    def computed(self, expert: int) -> int:
        return self.stand_in.get(expert, expert)


@dataclass(frozen=True)
class PrefillLayer:
    """A request's prefill parked before exchanging this MoE layer (the engine meters prefills)."""

    layer: int


@dataclass
class _BatchCall:
    """One ComputeExperts: the experts placed on one worker for a decode layer, and its answer."""

    worker: int
    experts: list[int]
    releases: bool = False  # it says the layer is over for its worker (re-sent calls never do)
    answer: tuple[ExpertsResult, list[torch.Tensor]] | None = None

    @property
    def done(self) -> bool:
        return self.answer is not None


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
    ):
        self.members, self.topology = members, members.topology
        self.num_experts, self.kernel = num_experts, kernel
        self.shadow = shadow
        self.prefill = prefill or PrefillConfig()
        self.timeout_s = reply_timeout_s
        self.current = RunContext("")  # the request whose forward pass is running (the engine sets it)
        self.stream, self.tick = "", 0  # the decode batch's name and iteration (the engine sets them)
        self.tracer = tracer or Tracer("main")
        self.cache_reports: dict[int, list[int]] = {}  # worker -> its cache's latest report (worker.cache)
        self.substituter = substituter  # None: every miss is reloaded (lossless)
        self.fault: FaultTrigger | None = None  # fault injection at a chosen layer (tests, benchmarks)
        self.dropped = DropLog(log, "main")
        self._main_since_us = 0.0  # when main last got its rows back (its own work runs from there)
        self._resent: dict[int, int] = {}  # this decode layer: request (batch index) -> calls re-sent

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
        """Whether every live worker's cache holds every expert it serves (odmoe.expert_cache.complete):
        a shadow's predictions would then load nothing."""
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
        ctx = self.current
        if self.fault is not None:
            self.fault.at(ctx.request, ctx.iteration, layer)
        if ctx.iteration <= 0:  # a prefill (0), or a prompt's scoring pass (-1)
            if in_task():
                park(PrefillLayer(layer))  # the engine resumes it when its prefill may go on this tick
                self.current = ctx
            return self._prefill_layer(ctx, layer, hidden, top_k_index, top_k_weights)
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
        if in_task():
            return park(rows)  # the engine exchanges every running request's rows of this layer at once
        return self.exchange_decode(layer, [rows])[0]

    def _stand_ins(self, ctx: RunContext, layer: int, top_k_index, top_k_weights) -> dict[int, int]:
        """Lossy policy only: missing expert -> the resident one computed in its place, decided on
        the prediction as it stands now (what the workers preloaded)."""
        prediction = self.shadow.prediction(Step(self.stream, self.tick, layer)) if self.shadow else None
        predicted = prediction.experts if prediction is not None else None
        chosen = self.substituter.decide(layer, top_k_index, top_k_weights, predicted)
        if chosen:
            t = ctx.traffic
            t.substitutions_per_layer[layer] = t.substitutions_per_layer.get(layer, 0) + len(chosen)
            t.substituted += [(ctx.iteration, layer, e, p) for e, p in sorted(chosen.items())]
            log.debug("iteration %d layer %d: missing -> stand-in %s", ctx.iteration, layer, chosen)
        return chosen

    # -- prefill: one request's exchange -------------------------------------------------------
    def _prefill_layer(self, ctx: RunContext, layer: int, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        step = Step(ctx.request, ctx.iteration, layer)
        entered_us = now_us() if self.tracer.enabled else 0.0
        groups = split_by_expert(top_k_index, self.num_experts, self.kernel)
        placement = self._prefill_place(step, hidden.shape[0], groups)
        start = time.perf_counter()
        one = hidden.shape[0] == 1
        rows_of = {rows.expert: hidden if one else hidden[rows.token_idx] for rows in groups}
        # the reference's grouped call covers every (token, slot) pair over all E experts (expert_math)
        grouped = [top_k_index.numel(), self.num_experts] if self.kernel == "grouped_mm" else []
        outputs = self._exchange(ctx, step, rows_of, placement, _LayerClock(), grouped)
        if hidden.device.type != "cpu":  # answers arrive in host memory; combine where main computes
            outputs = {e: y.to(hidden.device) for e, y in outputs.items()}
        waited = time.perf_counter() - start
        ctx.traffic.wait_s += waited
        ctx.traffic.note_prefill_layer(layer, waited, len(groups))
        if self.tracer.enabled:
            self.tracer.span("main", f"prefill L{layer}", entered_us, now_us(), iteration=0)
        return combine(hidden, [(rows, outputs[rows.expert]) for rows in groups], top_k_weights, self.kernel)

    def _prefill_place(self, step: Step, tokens: int, groups) -> dict[int, int]:
        """Prefill: spread over every live worker storing the layer (a one-token prompt: its group)."""
        live, layer = self.members.live, step.layer
        try:
            if tokens > 1:
                counts = {rows.expert: len(rows.token_idx) for rows in groups}
                return self.topology.prefill_placement(
                    counts, self.prefill.placement, self.topology.live_holders(layer, live)
                )
            return self.topology.decode_placement(layer, [rows.expert for rows in groups], live)
        except LayerUnavailable as exc:
            raise WorkerUnavailable(str(exc)) from None

    # -- decode: every running request's rows of a layer at once --------------------------------
    def exchange_decode(self, layer: int, batch: list[DecodeRows]) -> list[torch.Tensor]:
        """Each request's experts output for this layer (in `batch` order), from one exchange: the
        union of their experts placed once, one ComputeExperts per worker."""
        step = Step(self.stream, self.tick, layer)
        entered, entered_us = time.perf_counter(), now_us() if self.tracer.enabled else 0.0
        if self.tracer.enabled:
            self.tracer.span("main", f"L{layer}", self._main_since_us, entered_us, iteration=self.tick)
        prediction = self.shadow.prediction(step) if self.shadow is not None else None
        hedges = prediction.hedges if prediction is not None else []
        for rows in batch:
            self._note_prediction(rows, layer, prediction)
        # expert -> [(request index, its rows of that expert)], requests in batch order
        users: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for b, rows in enumerate(batch):
            one = rows.hidden.shape[0] == 1
            for group in rows.groups:
                x = rows.hidden if one else rows.hidden[group.token_idx]
                users.setdefault(rows.computed(group.expert), []).append((b, x))
        experts = sorted(users)
        placement = self._decode_place(step, experts, prediction, hedges)
        grouped = [batch[0].top_k_index.numel(), self.num_experts] if self.kernel == "grouped_mm" else []
        clock = _LayerClock()
        start = time.perf_counter()
        # each worker's last (only) call says the layer is over for it; without a shadow nothing
        # is ever preloaded, so nothing to release
        releasing = self.shadow is not None
        calls = self._exchange_many(step, users, placement, grouped, clock, releasing)
        gathered = time.perf_counter()
        outputs = self._split_answers(calls, users, batch)
        if self.tracer.enabled:
            self._main_since_us = now_us()
            self.tracer.span("main", f"wait L{layer}", entered_us, self._main_since_us, iteration=self.tick)
        if releasing:
            called = {c.worker for c in calls if c.done and c.releases}
            release = to_frames(Release(step))
            for worker in [w for w in self._serving(layer) if w not in called]:
                self.members.send(worker, release)
        out = []
        for b, rows in enumerate(batch):
            parts = [(group, outputs[b][rows.computed(group.expert)]) for group in rows.groups]
            if rows.hidden.device.type != "cpu":
                parts = [(g, y.to(rows.hidden.device)) for g, y in parts]
            out.append(combine(rows.hidden, parts, rows.top_k_weights, self.kernel))
        combined = time.perf_counter()
        stall = max((max(r.waited_s, default=0.0) for r, _ in (c.answer for c in calls)), default=0.0)
        for rows in batch:
            t = rows.ctx.traffic
            t.wait_s += gathered - start
            t.decode["wait_s"] += gathered - start
            t.decode["layers"] += 1
            t.stall_s_per_layer[layer] = t.stall_s_per_layer.get(layer, 0.0) + stall
            clock.note(t.decode, entered, gathered, combined)
        return out

    def _note_prediction(self, rows: DecodeRows, layer: int, prediction: Prediction | None) -> None:
        """Timely recall, as the paper counts it, for this request at this layer."""
        t, experts = rows.ctx.traffic, rows.experts
        predicted = _requests_choice(prediction, rows.ctx.request)
        t.timely_recall.add(rows.ctx.iteration, layer, predicted, experts)
        t.activated[(rows.ctx.iteration, layer)] = experts
        if prediction is not None and prediction.hedges and predicted is not None:
            t.hedge_hits += len((set(prediction.hedges) - set(prediction.experts)) & set(experts))

    def _decode_place(self, step: Step, experts: list[int], prediction, hedges) -> dict[int, int]:
        """Where the shadow's (union) prediction preloaded, the misses repaired (Topology)."""
        predicted = prediction.experts if prediction is not None else []
        try:
            return self.topology.repair_placement(step.layer, predicted, experts, self.members.live, hedges)
        except LayerUnavailable as exc:
            raise WorkerUnavailable(str(exc)) from None

    def _exchange_many(
        self,
        step: Step,
        users: dict[int, list[tuple[int, torch.Tensor]]],
        placement: dict[int, int],
        grouped: list[int],
        clock: _LayerClock,
        releasing: bool,
    ) -> list[_BatchCall]:
        """One ComputeExperts per worker, gathered; what a lost worker owed is re-sent elsewhere."""
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
        while owing := [c for c in calls if not c.done and c.worker >= 0]:
            received, lost = self.members.wait(int((deadline - time.monotonic()) * 1000))
            for worker, frames in received:
                arrived = time.perf_counter()
                result = self._take_many(step, calls, worker, frames)
                clock.take_s += time.perf_counter() - arrived
                if result is not None:
                    clock.answered, clock.worker_s = arrived, result.handled_s
            if lost:
                calls += self._resend_many(step, calls, set(lost), users, grouped)
            elif time.monotonic() >= deadline and any(not c.done for c in owing):
                # the per-call deadline: alive by heartbeat, yet silent (a frozen process)
                silent = {c.worker for c in owing if not c.done}
                for worker in silent:
                    self.members.mark_lost(
                        worker, f"no answer for layer {step.layer} within {self.timeout_s:g}s"
                    )
                calls += self._resend_many(step, calls, silent, users, grouped)
                deadline = time.monotonic() + self.timeout_s
        return [c for c in calls if c.done]

    def _encode_many(self, step: Step, experts: list[int], users, grouped: list[int], release: bool) -> list:
        rows = [torch.cat([x for _, x in users[e]]) if len(users[e]) > 1 else users[e][0][1] for e in experts]
        segments = [[x.shape[0] for _, x in users[e]] for e in experts]
        return to_frames(ComputeExperts(step, experts, segments, self.kernel, grouped, release), rows)

    def _send_many(
        self, step: Step, worker: int, experts: list[int], users, grouped, frames=None, releases: bool = False
    ) -> _BatchCall:
        """Send one worker its experts' rows. A worker that cannot take them is lost, and they go to
        its replacement (as one call: the replacement is one worker)."""
        frames = frames or self._encode_many(step, experts, users, grouped, False)
        while not self.members.send(worker, frames, copy=False):
            self.members.mark_lost(worker, "cannot take messages")
            worker = self._replacement(step, dict.fromkeys(experts, worker))[experts[0]]
            frames, releases = self._encode_many(step, experts, users, grouped, False), False
        for expert in experts:
            self.tracer.message("main", "compute", step, expert, sent=True)
        return _BatchCall(worker, list(experts), releases)

    def _resend_many(
        self, step: Step, calls: list[_BatchCall], lost: set[int], users, grouped
    ) -> list[_BatchCall]:
        """Re-place and re-send the experts of every unanswered call on a lost worker; a re-sent
        call never releases (its new worker gets a Release after the layer if it got no call)."""
        owed = {e: c.worker for c in calls if not c.done and c.worker in lost for e in c.experts}
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
            self._resent[b] = self._resent.get(b, 0) + 1
        log.info(
            "layer %d of %s: re-sent experts %s to workers %s", step.layer, step.request, sorted(owed), new
        )
        return resent

    def _take_many(self, step: Step, calls: list[_BatchCall], worker: int, frames) -> ExpertsResult | None:
        """Record one answer if it is one this layer waits for, from the worker its call is on."""
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
        for expert in call.experts:
            self.tracer.message("main", "result", step, expert, sent=False)
        if result.cache:
            self.cache_reports[worker] = result.cache
        call.answer = (result, tensors)
        return result

    def _split_answers(
        self, calls: list[_BatchCall], users, batch: list[DecodeRows]
    ) -> list[dict[int, torch.Tensor]]:
        """Each request's outputs by expert, cut from the answers' segments; its share of each
        expert's cost goes to its traffic."""
        outputs: list[dict[int, torch.Tensor]] = [{} for _ in batch]
        for b, count in self._resent.items():
            batch[b].ctx.traffic.resent += count
        self._resent = {}
        for call in calls:
            result, tensors = call.answer
            for i, expert in enumerate(result.experts):
                segments = users[expert]
                sizes = [x.shape[0] for _, x in segments]
                if tensors[i].shape[0] != sum(sizes):
                    got = tensors[i].shape[0]
                    raise WorkerFailed(f"worker {call.worker} answered expert {expert} with {got} rows")
                pieces = torch.split(tensors[i], sizes) if len(sizes) > 1 else (tensors[i],)
                for (b, _), y in zip(segments, pieces, strict=True):
                    outputs[b][expert] = y
                    t = batch[b].ctx.traffic
                    t.add_share(result, i, 1, len(segments))
                    t.preloaded += result.preloaded[i]
                    t.reloads += not result.preloaded[i]
                    if len(result.hedges) == 3:
                        t.hedging[call.worker] = result.hedges
        return outputs

    def _serving(self, layer: int) -> list[int]:
        try:
            return self.topology.serving_group(layer, self.members.live)
        except LayerUnavailable:
            return []

    # -- prefill's per-expert calls --------------------------------------------------------------
    def _exchange(
        self,
        ctx: RunContext,
        step: Step,
        rows: dict[int, torch.Tensor],
        placement: dict[int, int],
        clock: _LayerClock,
        grouped: list[int],
    ) -> dict[int, torch.Tensor]:
        """Send every expert's rows, gather the answers; re-send what a lost worker owed."""
        # Every call is encoded before the first one leaves (see _exchange_many).
        messages = {e: self._encode(step, e, x, grouped) for e, x in rows.items()}
        clock.sending = time.perf_counter()
        calls = {e: self._send(step, e, x, placement[e], grouped, messages[e]) for e, x in rows.items()}
        deadline = time.monotonic() + self.timeout_s
        while not all(c.done for c in calls.values()):
            received, lost = self.members.wait(int((deadline - time.monotonic()) * 1000))
            for worker, frames in received:
                self._take(ctx, step, calls, worker, frames)
            if lost:
                self._resend(ctx, step, calls, set(lost), grouped)
            if time.monotonic() >= deadline and not all(c.done for c in calls.values()):
                # the per-call deadline: alive by heartbeat, yet silent (a frozen process)
                silent = {c.worker for c in calls.values() if not c.done}
                for worker in silent:
                    self.members.mark_lost(
                        worker, f"no answer for layer {step.layer} within {self.timeout_s:g}s"
                    )
                self._resend(ctx, step, calls, silent, grouped)
                deadline = time.monotonic() + self.timeout_s
        return {
            e: torch.cat([c.parts[i] for i in sorted(c.parts)]) if len(c.parts) > 1 else c.parts[0]
            for e, c in calls.items()
        }

    def _encode(self, step: Step, expert: int, x: torch.Tensor, grouped: list[int]) -> list[list]:
        """One expert's rows as the frames of each message: one message, or prefill mini-batches."""
        size = self.prefill.mini_batch if self.prefill.mini_batch > 0 else x.shape[0]
        chunks = torch.split(x, max(size, 1)) if x.shape[0] > size else (x,)
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
        messages: list[list] | None = None,
    ) -> _Call:
        """Send one expert's rows (`messages`: as `_encode` made them). A worker that cannot take
        them is lost, and the rows go to its replacement."""
        messages = messages or self._encode(step, expert, x, grouped)
        while True:
            sent = True
            for frames in messages:
                sent = sent and self.members.send(worker, frames, copy=False)
            if sent:
                break
            self.members.mark_lost(worker, "cannot take messages")
            worker = self._replacement(step, {expert: worker})[expert]
        self.tracer.message("main", "compute", step, expert, sent=True)
        per_part = len(messages) > 1 and self.prefill.compute_per_mini_batch
        return _Call(worker, x, len(messages) if per_part else 1)

    def _replacement(self, step: Step, lost: dict[int, int]) -> dict[int, int]:
        try:
            return self.topology.replace_lost(step.layer, lost, self.members.live, spread=step.iteration == 0)
        except LayerUnavailable as exc:
            raise WorkerUnavailable(f"{exc}; request {step.request} cannot go on") from None

    def _resend(self, ctx: RunContext, step: Step, calls: dict[int, _Call], lost: set[int], grouped) -> None:
        owed = owed_calls(calls, lost)
        if not owed:
            return
        new = self._replacement(step, owed)
        for e in owed:
            calls[e] = self._send(step, e, calls[e].rows, new[e], grouped)
            ctx.traffic.resent += 1
        log.info(
            "layer %d of %s: re-sent experts %s to workers %s", step.layer, step.request, sorted(owed), new
        )

    def _take(self, ctx: RunContext, step: Step, calls: dict[int, _Call], worker: int, frames) -> None:
        """Record one answer if it is one this step is waiting for, from the worker it is placed on."""
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
        self.tracer.message("main", "result", step, result.expert, sent=False)
        if result.cache:
            self.cache_reports[worker] = result.cache
        ctx.traffic.add(result)
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

    def ping_all(self, timeout_s: float) -> list[Pong]:
        """Check every worker is up, is the worker its address says, and holds what it will be asked.

        Raises WorkerUnavailable naming the workers that stay silent or are misconfigured.
        """
        shadow_pub = self.shadow.pub_address if self.shadow is not None else ""
        return self.members.ping_all(timeout_s, shadow_pub)

    def close(self) -> None:
        self.members.close()


def _requests_choice(prediction: Prediction | None, request: str) -> list[int] | None:
    """What the shadow predicted for this request (None: no prediction for it arrived in time)."""
    if prediction is None:
        return None
    if not prediction.requests:
        return prediction.experts  # one request alone
    try:
        return prediction.request_experts[prediction.requests.index(request)]
    except (ValueError, IndexError):
        return None
