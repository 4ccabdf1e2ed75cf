"""Main's calls to its workers for one layer: send them, wait, take the answers, and send again
what a lost, silent or late call owed. One path for prefill and decode.

Contract: `WorkerCalls.exchange(x, plan, grouped, releasing)` sends each call of `plan` (a worker
and its experts; `calls_of` makes a plan from a placement) with the experts' rows `x.users` holds,
as one `ComputeExperts` (a prefill expert's long rows as `prefill.mini_batch` messages), and returns
the answered `BatchCall`s once every expert has an answer; `split_answers` cuts each request's
outputs from them. `placed(place)` runs a placement, waiting up to `no_worker_grace_s` for a worker
to come back where none holds the layer; `prefill_placement` / `decode_placement` are the two
placements; `release(step, calls)` ends a decode layer for the workers no call released.

Failure policy: every call is self-contained (rows + its name), so a call outstanding on a worker
that is lost (Membership reports it, or it stays silent past `timeout_s`: the per-call deadline for
a frozen process) is re-sent, rows and all, to a live worker that stores the layer, placed by the
same pure rules over the live workers. A call still unanswered a few usual round trips after the
sends (`late`, odmoe.main.late_calls) is sent again once per layer to another live worker: a decode
call is doubled and the first answer taken (every worker computes an expert with the same bits), a
prefill call, whose rows are many, is moved. An answer is taken only from the worker its call is on
now, once per part, so a late or duplicated answer is never combined twice. A worker that answers
with an error (e.g. it lacks that expert) raises `WorkerFailed`; frames that do not decode are
dropped. What happens is told to the exchange's `observe`rs (accounting, timeline).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from odmoe.config import PrefillConfig
from odmoe.main.exchange_observers import Exchange, Observers
from odmoe.main.exchange_records import BatchCall
from odmoe.main.late_calls import LateCalls
from odmoe.main.membership import Membership, WorkerUnavailable
from odmoe.placement import LayerUnavailable, Topology
from odmoe.transport.codec import CodecError
from odmoe.transport.dropped import DropLog
from odmoe.transport.messages import (
    ComputeExperts,
    ExpertsResult,
    Prediction,
    Release,
    Step,
    from_frames,
    to_frames,
)

log = logging.getLogger("odmoe.main")


class WorkerFailed(RuntimeError):
    """A worker answered but could not compute what it was asked (e.g. it lacks that expert)."""


class WorkerCalls:
    def __init__(
        self,
        members: Membership,
        kernel: str,
        observe: Observers,
        prefill: PrefillConfig | None = None,
        timeout_s: float = 60.0,
        late: LateCalls | None = None,
        no_worker_grace_s: float = 0.0,
    ):
        self.members, self.kernel, self.observe = members, kernel, observe
        self.prefill = prefill or PrefillConfig()
        self.timeout_s = timeout_s
        # None: a late call waits for TCP; else its experts go again to a peer (late_calls)
        self.late = late
        # where no live worker holds a layer: how long to wait for one to come back before failing
        self.no_worker_grace_s = no_worker_grace_s
        self.cache_reports: dict[int, list[int]] = {}  # worker -> its cache's latest report (worker.cache)
        self.dropped = DropLog(log, "main")

    @property
    def topology(self) -> Topology:
        """Membership's: it learns the workers' cache rooms (weighted homes) once they have answered."""
        return self.members.topology

    # -- the one send / wait / resend path, prefill's and decode's ------------------------------
    def exchange(
        self, x: Exchange, plan: list[tuple[int, list[int]]], grouped: list[int], releasing: bool = False
    ) -> list[BatchCall]:
        """Send each call of `plan` (a worker, its experts); the answered calls (failure policy: above)."""
        step, clock = x.step, x.clock
        # Every call is encoded before the first leaves: a send wakes a worker, which on a machine of
        # few cores can take main's core at once (the next call would wait for its whole compute)
        messages = [self._encode(x, experts, grouped, releasing) for _, experts in plan]
        clock.sending = time.perf_counter()
        calls = [
            self._send(x, worker, experts, grouped, m, releasing)
            for (worker, experts), m in zip(plan, messages, strict=True)
        ]
        deadline = time.monotonic() + self.timeout_s
        done_s: list[float] = []  # seconds from the sends to each call's last answer
        late_sent = self.late is None  # once per layer: a second loss in a row waits for TCP
        decode_late_at = self._late_at(x, done_s, 0) if not late_sent and step.iteration >= 1 else None
        while owing := _owing(calls):
            wait_s = deadline - time.monotonic()
            late_at = None if late_sent else decode_late_at or self._late_at(x, done_s, len(calls))
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
        a decode call a few usual round trips after the sends (known then: taken once a layer), a
        prefill's once half its calls are done (odmoe.main.late_calls)."""
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
        resent = [self._send(x, w, es, grouped) for w, es in calls_of(new, step.iteration <= 0)]
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
            for worker, experts in calls_of(placed, step.iteration <= 0):
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
        open_calls = (c for c in calls if c.worker == worker and c.experts == result.experts and not c.done)
        call = next((c for c in open_calls if result.part not in c.answers), None)
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

    def _replacement(self, step: Step, lost: dict[int, int]) -> dict[int, int]:
        return self.placed(
            lambda: self.topology.replace_lost(
                step.layer, lost, self.members.live, spread=step.iteration == 0, iteration=step.iteration
            ),
            f"; request {step.request} cannot go on",
        )

    def placed(self, place: Callable[[], dict[int, int]], why: str = "") -> dict[int, int]:
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

    def prefill_placement(self, step: Step, tokens: int, groups) -> dict[int, int]:
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

        return self.placed(place)

    def decode_placement(
        self, step: Step, experts: list[int], prediction: Prediction | None
    ) -> dict[int, int]:
        """Where the shadow's (union) prediction preloaded, the misses repaired (Topology)."""
        predicted = prediction.experts if prediction is not None else []
        hedges = prediction.hedges if prediction is not None else []
        return self.placed(
            lambda: self.topology.repair_placement(
                step.layer, predicted, experts, self.members.live, hedges, step.iteration
            )
        )

    def release(self, step: Step, calls: list[BatchCall]) -> None:
        """The layer is over: every worker serving it that no releasing call told gets a Release."""
        called = {c.worker for c in calls if c.done and c.releases}
        release = to_frames(Release(step))
        for worker in [w for w in self.members.serving(step.layer) if w not in called]:
            self.members.send(worker, release)


def calls_of(placement: dict[int, int], one_per_expert: bool) -> list[tuple[int, list[int]]]:
    """The calls a placement (expert -> worker) makes: one per worker with all its experts (decode),
    or one per expert (prefill: each expert's transfer overlaps the others' compute)."""
    if one_per_expert:
        return [(placement[e], [e]) for e in sorted(placement)]
    by_worker: dict[int, list[int]] = {}
    for expert in sorted(placement):
        by_worker.setdefault(placement[expert], []).append(expert)
    return list(by_worker.items())


def split_answers(x: Exchange, requests: int = 1) -> list[dict[int, torch.Tensor]]:
    """Each request's outputs by expert, cut from the answers' segments."""
    outputs: list[dict[int, torch.Tensor]] = [{} for _ in range(requests)]
    for call in x.calls:
        for expert, y in zip(call.experts, call.outputs(), strict=True):
            segments = x.users[expert]
            pieces = torch.split(y, [r.shape[0] for _, r in segments]) if len(segments) > 1 else (y,)
            for (b, _), piece in zip(segments, pieces, strict=True):
                outputs[b][expert] = piece
    return outputs


def owed_experts(calls: list[BatchCall], lost: set[int]) -> dict[int, int]:
    """Pure: expert -> the lost worker its call was placed on, for every call still waited for
    (`_owing`). A call whose answer is in is kept, even from a worker lost since (it is correct); a
    call half answered (some of its mini-batches) is owed whole."""
    return {e: c.worker for c in _owing(calls) if c.worker in lost for e in c.experts}


def _owing(calls: list[BatchCall]) -> list[BatchCall]:
    """The calls still waited for: unanswered, not abandoned, and with an expert no answered call
    (a late call's, or the one sent again for it) has brought."""
    answered = {e for c in calls if c.done for e in c.experts}
    return [c for c in calls if not c.done and c.worker >= 0 and not answered.issuperset(c.experts)]


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
