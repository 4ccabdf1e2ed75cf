"""Main's side of the data plane: send a layer's expert rows to workers, gather, combine.

Contract: `RemoteExperts.__call__(layer, hidden[T, H], top_k_index[T, k], top_k_weights[T, k])`
returns exactly what transformers' experts module would have returned, computed by the workers.
It is attached to the main model (main_model.MainModel.attach) and called once per MoE layer of
every forward pass; `begin(request, iteration)` labels the calls that follow.

Failure policy: every call is self-contained (rows + the name `(request, iteration, layer,
expert)`), so a call outstanding on a worker that is lost (Membership reports it, or it stays
silent past `reply_timeout_s`: the per-call deadline for a frozen process) is re-sent, rows and
all, to a live worker that stores the layer, placed by the same pure rules over the live workers.
An answer is taken only from the worker the call is currently placed on, once per part, so a late
or duplicated answer is never combined twice. When no live worker stores the layer the request
fails at once with `WorkerUnavailable` naming the layer; a worker that answers with an error
(e.g. it lacks that expert) raises `WorkerFailed`. Frames that do not decode are dropped.

Misses: by default a missed expert is loaded and waited for (lossless). With a lossy miss policy
(`odmoe.substitution`, opt-in) a decode miss may instead be computed by a resident expert, the
predicted one its worker preloaded: main asks that worker for the resident expert by name, so the
worker computes exactly what main combines, and the result takes the missing expert's gate weight.
Each substitution is counted per layer (`ExpertTraffic.substitutions_per_layer`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from odmoe.codec import CodecError
from odmoe.config import PrefillConfig
from odmoe.dropped import DropLog
from odmoe.expert_math import combine, split_by_expert
from odmoe.faults import FaultTrigger
from odmoe.membership import Membership, WorkerUnavailable
from odmoe.messages import (
    ComputeExpert,
    EndRequest,
    ExpertResult,
    Pong,
    Release,
    Step,
    from_frames,
    to_frames,
)
from odmoe.placement import LayerUnavailable
from odmoe.recall import RecallCounter
from odmoe.shadow_link import ShadowLink
from odmoe.substitution import Substituter
from odmoe.trace import Tracer, now_us

log = logging.getLogger("odmoe.main")
__all__ = ["ExpertTraffic", "RemoteExperts", "WorkerFailed", "WorkerUnavailable"]


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
        if result.step.iteration >= 1:
            d = self.decode
            d["experts"] += 1
            d["compute_s"] += result.compute_s
            d["loads"] += result.bytes_loaded > 0
            d["load_s"] += result.load_s
        if result.step.iteration == 0:
            self.prefill["load_s"] += result.load_s
            self.prefill["compute_s"] += result.compute_s
            busy = self._layer_busy
            busy[result.worker] = busy.get(result.worker, 0.0) + result.load_s + result.compute_s
        self.worker_peak_rss[result.worker] = max(self.worker_peak_rss.get(result.worker, 0), result.peak_rss)
        peak = self.worker_device_peak
        peak[result.worker] = max(peak.get(result.worker, 0), result.device_peak_bytes)
        w = self.per_worker.setdefault(
            result.worker, {"experts": 0, "bytes_loaded": 0, "load_s": 0.0, "compute_s": 0.0}
        )
        w["experts"] += result.part == 0
        w["bytes_loaded"] += result.bytes_loaded
        w["load_s"] += result.load_s
        w["compute_s"] += result.compute_s


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
        self.request, self.iteration = "", 0
        self.traffic = ExpertTraffic()
        self.tracer = tracer or Tracer("main")
        self.substituter = substituter  # None: every miss is reloaded (lossless)
        self.fault: FaultTrigger | None = None  # fault injection at a chosen layer (tests, benchmarks)
        self.dropped = DropLog(log, "main")
        self._main_since_us = 0.0  # when main last got its rows back (its own work runs from there)
        self._grouped_shape: list[int] = []  # this layer's [T*k, E] for grouped_mm (see __call__)

    @property
    def emulated_links(self) -> dict[int, list[float]]:
        """worker -> [Gbit/s, ms] of its emulated load link (from its pong; absent when off)."""
        return {w: p.link for w, p in sorted(self.members.pongs.items()) if p.link}

    @property
    def device_bytes(self) -> dict[int, int]:
        """worker -> bytes its experts take on its device."""
        return {w: p.device_bytes for w, p in sorted(self.members.pongs.items())}

    def begin(self, request: str, iteration: int) -> None:
        now = now_us()
        if self.tracer.enabled and request == self.request and self._main_since_us:
            self.tracer.span(
                "main", "lm_head, next token", self._main_since_us, now, iteration=self.iteration
            )
        self.request, self.iteration = request, iteration
        self._main_since_us = now
        if self.substituter is not None:
            self.substituter.begin_token()

    def end_request(self) -> None:
        """The request is over (finished, failed or cancelled): workers drop what they hold for it."""
        message = to_frames(EndRequest(self.request))
        for worker in self.members.live:
            self.members.send(worker, message)

    def __call__(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        entered = time.perf_counter()
        step = Step(self.request, self.iteration, layer)
        if self.fault is not None:
            self.fault.at(step.request, step.iteration, layer)
        entered_us = 0.0
        if self.tracer.enabled:
            entered_us = now_us()
            self.tracer.span("main", f"L{layer}", self._main_since_us, entered_us, iteration=self.iteration)
        groups = split_by_expert(top_k_index, self.num_experts, self.kernel)
        experts = [rows.expert for rows in groups]
        decode = self.iteration >= 1
        predicted, hedges = None, []
        if decode:
            prediction = self.shadow.prediction(step) if self.shadow is not None else None
            predicted = prediction.experts if prediction is not None else None
            self.traffic.timely_recall.add(self.iteration, layer, predicted, experts)
            self.traffic.activated[(self.iteration, layer)] = experts
            if prediction is not None and prediction.hedges:
                hedges = prediction.hedges
                self.traffic.hedge_hits += len((set(hedges) - set(predicted)) & set(experts))
        # lossy policy only: missing expert -> the resident expert computed in its place
        stand_in = self._stand_ins(layer, top_k_index, top_k_weights, predicted) if decode else {}
        computed = [stand_in.get(e, e) for e in experts]
        placement = self._place(step, computed, hidden.shape[0], predicted, groups, hedges)
        start = time.perf_counter()
        # one token (decode): every expert's rows are that token's row, `hidden` itself
        rows_of = {
            stand_in.get(rows.expert, rows.expert): (
                hidden if hidden.shape[0] == rows.token_idx.shape[0] == 1 else hidden[rows.token_idx]
            )
            for rows in groups
        }
        # the reference's grouped call covers every (token, slot) pair over all E experts (expert_math)
        self._grouped_shape = [top_k_index.numel(), self.num_experts] if self.kernel == "grouped_mm" else []
        clock = _LayerClock()
        # what the group preloaded for this layer and did not use is stale once main is past it: each
        # worker's last call of the layer says so itself (a Release goes only to the group's others).
        # Without a shadow nothing is ever preloaded: no releasing at all.
        releasing = decode and self.shadow is not None
        outputs, released = self._exchange(step, rows_of, placement, clock, releasing)
        if hidden.device.type != "cpu":  # answers arrive in host memory; combine where main computes
            outputs = {e: y.to(hidden.device) for e, y in outputs.items()}
        gathered = time.perf_counter()
        waited = gathered - start
        self.traffic.wait_s += waited
        if self.tracer.enabled:
            self._main_since_us = now_us()
            self.tracer.span(
                "main", f"wait L{layer}", entered_us, self._main_since_us, iteration=self.iteration
            )
        if decode:
            self.traffic.decode["wait_s"] += waited
            self.traffic.decode["layers"] += 1
            if releasing:
                unreleased = [w for w in self._serving(layer) if w not in released]
                if unreleased:
                    release = to_frames(Release(step))
                    for worker in unreleased:
                        self.members.send(worker, release)
        else:
            self.traffic.note_prefill_layer(layer, waited, len(groups))
        parts = [(rows, outputs[stand_in.get(rows.expert, rows.expert)]) for rows in groups]
        out = combine(hidden, parts, top_k_weights, self.kernel)
        if decode:
            clock.note(self.traffic.decode, entered, gathered, time.perf_counter())
        return out

    def _stand_ins(
        self, layer: int, top_k_index, top_k_weights, predicted: list[int] | None
    ) -> dict[int, int]:
        if self.substituter is None:
            return {}
        chosen = self.substituter.decide(layer, top_k_index, top_k_weights, predicted)
        if chosen:
            subs = self.traffic.substitutions_per_layer
            subs[layer] = subs.get(layer, 0) + len(chosen)
            self.traffic.substituted += [(self.iteration, layer, e, p) for e, p in sorted(chosen.items())]
            log.debug("iteration %d layer %d: missing -> stand-in %s", self.iteration, layer, chosen)
        return chosen

    def _place(
        self, step: Step, experts: list[int], tokens: int, predicted: list[int] | None, groups, hedges=()
    ) -> dict[int, int]:
        """Decode: where the shadow's prediction (and its hedges) preloaded, repairing the misses;
        prefill: spread over every live worker storing the layer; all over the live workers only."""
        live, layer = self.members.live, step.layer
        try:
            if step.iteration >= 1:
                return self.topology.repair_placement(layer, predicted or [], experts, live, hedges)
            if tokens > 1:
                counts = {rows.expert: len(rows.token_idx) for rows in groups}
                return self.topology.prefill_placement(
                    counts, self.prefill.placement, self.topology.live_holders(layer, live)
                )
            return self.topology.decode_placement(layer, experts, live)
        except LayerUnavailable as exc:
            raise WorkerUnavailable(str(exc)) from None

    def _serving(self, layer: int) -> list[int]:
        try:
            return self.topology.serving_group(layer, self.members.live)
        except LayerUnavailable:
            return []

    def _exchange(
        self,
        step: Step,
        rows: dict[int, torch.Tensor],
        placement: dict[int, int],
        clock: _LayerClock,
        releasing: bool = False,
    ) -> tuple[dict[int, torch.Tensor], set[int]]:
        """Send every expert's rows, gather the answers; re-send what a lost worker owed. With
        `releasing`, each worker's last call (in send order, the order it handles them) carries
        `release`; returns the outputs and the workers whose releasing call they answered."""
        last_call = {placement[e]: e for e in rows} if releasing else {}
        # Every call is encoded before the first one leaves: a send wakes a worker (and ZeroMQ's I/O
        # threads), which on a machine with few cores can take main's core at once; the next call
        # would then leave only after that worker's whole computation, and the workers of a layer
        # would compute one after the other instead of together.
        messages = {e: self._encode(step, e, x, last_call.get(placement[e]) == e) for e, x in rows.items()}
        clock.sending = time.perf_counter()
        calls = {e: self._send(step, e, x, placement[e], messages[e]) for e, x in rows.items()}
        layer_stall = 0.0  # workers load in parallel: the slowest wait is what main waited for
        deadline = time.monotonic() + self.timeout_s
        while not all(c.done for c in calls.values()):
            received, lost = self.members.wait(int((deadline - time.monotonic()) * 1000))
            for worker, frames in received:
                arrived = time.perf_counter()
                result = self._take(step, calls, worker, frames)
                clock.take_s += time.perf_counter() - arrived
                if result is not None:
                    clock.answered, clock.worker_s = arrived, result.handled_s
                    layer_stall = max(layer_stall, result.waited_s)
            if lost:
                self._resend(step, calls, set(lost))
            if time.monotonic() >= deadline and not all(c.done for c in calls.values()):
                # the per-call deadline: alive by heartbeat, yet silent (a frozen process)
                silent = {c.worker for c in calls.values() if not c.done}
                for worker in silent:
                    self.members.mark_lost(
                        worker, f"no answer for layer {step.layer} within {self.timeout_s:g}s"
                    )
                self._resend(step, calls, silent)
                deadline = time.monotonic() + self.timeout_s
        if step.iteration >= 1:
            stall = self.traffic.stall_s_per_layer
            stall[step.layer] = stall.get(step.layer, 0.0) + layer_stall
        outputs = {
            e: torch.cat([c.parts[i] for i in sorted(c.parts)]) if len(c.parts) > 1 else c.parts[0]
            for e, c in calls.items()
        }
        # a re-sent call never releases: its new worker gets a Release after the layer
        return outputs, {w for w, e in last_call.items() if calls[e].worker == w}

    def _encode(self, step: Step, expert: int, x: torch.Tensor, release: bool = False) -> list[list]:
        """One expert's rows as the frames of each message: one message, or prefill mini-batches."""
        size = self.prefill.mini_batch if step.iteration == 0 and self.prefill.mini_batch > 0 else x.shape[0]
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
                    grouped_shape=self._grouped_shape,
                    release=release,
                ),
                [chunk],
            )
            for part, chunk in enumerate(chunks)
        ]

    def _send(
        self, step: Step, expert: int, x: torch.Tensor, worker: int, messages: list[list] | None = None
    ) -> _Call:
        """Send one expert's rows (`messages`: as `_encode` made them). A worker that cannot take
        them is lost, and the rows go to its replacement."""
        messages = messages or self._encode(step, expert, x)
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

    def _resend(self, step: Step, calls: dict[int, _Call], lost: set[int]) -> None:
        owed = owed_calls(calls, lost)
        if not owed:
            return
        new = self._replacement(step, owed)
        for e in owed:
            calls[e] = self._send(step, e, calls[e].rows, new[e])
            self.traffic.resent += 1
        log.info(
            "layer %d of %s: re-sent experts %s to workers %s", step.layer, step.request, sorted(owed), new
        )

    def _take(self, step: Step, calls: dict[int, _Call], worker: int, frames) -> ExpertResult | None:
        """Record one answer if it is one this step is waiting for, from the worker it is placed on."""
        try:
            result, tensors = from_frames(frames)
        except CodecError as exc:
            self.dropped.drop(f"from worker {worker}: {exc}")
            return None
        if not isinstance(result, ExpertResult) or result.step != step:
            return None  # a Pong, or a late answer to an earlier, abandoned step
        call = calls.get(result.expert)
        if call is None or call.worker != worker or result.worker != worker or result.part in call.parts:
            return None  # re-sent elsewhere since, or a duplicate
        if result.error:
            raise WorkerFailed(f"worker {worker} failed on layer {step.layer}: {result.error}")
        n = call.rows.shape[0] if call.expected == 1 else None
        if len(tensors) != 1 or tensors[0].dim() != 2 or (n is not None and tensors[0].shape[0] != n):
            self.dropped.drop(f"worker {worker} answered expert {result.expert} with malformed rows")
            return None
        self.tracer.message("main", "result", step, result.expert, sent=False)
        self.traffic.add(result)
        if len(result.hedges) == 3:
            self.traffic.hedging[worker] = result.hedges
        if step.iteration >= 1:
            self.traffic.preloaded += result.preloaded
            self.traffic.reloads += not result.preloaded
        call.parts[result.part] = tensors[0]
        return result

    def recall(self, wait_s: float = 1.0) -> RecallCounter:
        """Recall as the paper defines it (accuracy of every prediction, whenever it arrived): waits up to
        wait_s for predictions of this request still in flight."""
        counter = RecallCounter()
        predictions = (
            self.shadow.collect(list(self.traffic.activated), wait_s) if self.shadow is not None else {}
        )
        for (iteration, layer), experts in sorted(self.traffic.activated.items()):
            prediction = predictions.get((iteration, layer))
            counter.add(iteration, layer, prediction.experts if prediction else None, experts)
        return counter

    def ping_all(self, timeout_s: float) -> list[Pong]:
        """Check every worker is up, is the worker its address says, and holds what it will be asked.

        Raises WorkerUnavailable naming the workers that stay silent or are misconfigured.
        """
        shadow_pub = self.shadow.pub_address if self.shadow is not None else ""
        return self.members.ping_all(timeout_s, shadow_pub)

    def close(self) -> None:
        self.members.close()
