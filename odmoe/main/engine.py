"""The decode loop of the main node: every running request advances one token per iteration.

Contract: `MainEngine.serve(requests, ...)` takes tickets from a `RequestQueue` and runs them to
their end, putting each request's `TokenEvent`s and its one `DoneEvent` (or the exception that
ended it) into its ticket; `generate(request)` runs one request alone and yields its events. The
engine knows nothing about gRPC or HTTP; experts are computed wherever the `RemoteExperts` attached
to the model sends them. Each request's inputs and choice of each token are those of a single-process
`generate()` (`odmoe.main.request_run`), so its tokens equal transformers' whatever else runs beside it.

Continuous batching, exactly (DESIGN: lossless batching). The loop, one *tick* at a time:
  1) admit: waiting requests join at the tick boundary, in arrival order, while the planner says
     there is room (`tick_plan.room`: `max_running`; `kv_fits`: the K/V budget); the planner also
     fixes each one's prefill (`tick_plan.admit`: its start, staggered, its quota of layers per
     tick, its first decode tick, of which the shadow is told);
  2) run, as the tick's plan says (`odmoe.main.tick_plan.plan_tick`, pure: decoding requests go in
     the batched pass, staggered prefills and followers wait): every other running request's
     forward pass runs as a lockstep task (`odmoe.lockstep`), on this thread, in its own shapes and
     cache, exactly as it would alone (one request alone too: a task of one). Each pass is handed
     its `ForwardPass` (`exchange_records.forward_pass`: whose experts calls it makes, which tick
     names them); nothing is set on the experts. At each MoE layer a decoding request parks with
     its token's rows; once all have, their rows of that layer go out in one exchange
     (`RemoteExperts.exchange_decode`, named `(stream, tick, layer)`: each expert loaded once for
     all of them, one message per worker, every request's rows computed as its own) and each gets
     back its own output. A request's
     prefill exchanges its own layers, its quota of MoE layers per tick (`prefill.chunk_tokens`),
     so running streams wait for at most that much of a long prompt: the prompt is still one forward
     pass, cut between layers rather than between tokens, so its bits are one-shot prefill's.
     Prompts arriving together prefill one per tick (`prefill.stagger`), so the
     streams running wait for one prompt an iteration and requests that came together part.
     The tick a prompt prefills in is fixed when it is admitted, so the shadow is told its first
     decode tick then.
     With batched decode (`server.decode=batched`, `odmoe.main.batched_decode`), two or more decoding
     requests skip the tasks: after the prefills, one pass through the layers computes all their
     rows, each as its own forward pass would, with the same one exchange per layer;
  3) choose: each request picks its token (`RequestRun.accept`), streams it, and tells the shadow;
     one that finished, was cancelled or ran past its deadline leaves now.
The tick counter names the decode exchanges `(stream, tick, layer)`: the stream is named after the
request that opened the busy period, and one request alone has tick n = its iteration n, so the
data plane of a lone request is what it was before batching.

Whatever way a request ends (done, failed, cancelled), the shadow is told, and when no request is
left the workers drop what they hold for the stream.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from odmoe.lockstep import Failed, Finished, Lockstep, Parked
from odmoe.main.alignment import AlignmentPlan, AlignmentSchedule
from odmoe.main.batched_decode import BatchedDecode
from odmoe.main.exchange_records import ForwardPass, forward_pass
from odmoe.main.remote_experts import DecodeRows, RemoteExperts, WorkerUnavailable
from odmoe.main.request_limits import MAX_LOGPROBS, MAX_STOPS
from odmoe.main.request_queue import END, DeadlineExceeded, RequestQueue, Ticket
from odmoe.main.request_run import (
    DoneEvent,
    GenerateRequest,
    InvalidRequest,
    PromptEvent,
    RequestRun,
    RunSchedule,
    TokenEvent,
)
from odmoe.main.run_stats import request_stats
from odmoe.main.sampling import InvalidSampling
from odmoe.main.tick_plan import AdmitState, Arrival, RunView, TickPlan, admit, kv_fits, plan_tick, room
from odmoe.models.main_model import MainModel
from odmoe.transport.messages import Step

log = logging.getLogger("odmoe.main")
__all__ = [
    "Batching",
    "DoneEvent",
    "GenerateRequest",
    "InvalidRequest",
    "MainEngine",
    "PromptEvent",
    "ShuttingDown",
    "TokenEvent",
]
IDLE_WAIT_S = 0.2  # an idle engine looks after the membership this often
RECALL_WAIT_S = 1.0  # how long a finished request's paper recall waits for predictions in flight


class ShuttingDown(WorkerUnavailable):
    """Main is stopping: what it had not finished fails UNAVAILABLE / 503 (clients fail over)."""


@dataclass(frozen=True)
class Batching:
    """How many requests run together (`server.max_running`), the K/V cache they may hold
    (`server.kv_cache_bytes`, 0: no bound), and how much of a prompt one tick prefills
    (`prefill.chunk_tokens`, 0: a whole prompt at once), and whether prompts that arrive together
    prefill one after another, a tick each (`prefill.stagger`)."""

    max_running: int = 8
    kv_cache_bytes: int = 0
    chunk_tokens: int = 0
    stagger: bool = True
    batched_decode: bool = True  # server.decode=batched: one pass for all decoding requests, where supported


class MainEngine:
    def __init__(
        self,
        main: MainModel,
        tokenizer: PreTrainedTokenizerBase,
        experts: RemoteExperts,
        make_plan: Callable[[], AlignmentPlan] | None = None,
        pace_shadow: bool = False,
        batching: Batching = Batching(),
        observer=None,
    ):
        self.main, self.tokenizer, self.experts = main, tokenizer, experts
        self.make_plan = make_plan or (lambda: AlignmentPlan(AlignmentSchedule()))
        self.pace_shadow = pace_shadow  # send an Align every iteration even when nothing is aligned
        self.batching = batching
        # metrics (odmoe.serving.metrics.ServerMetrics): token(ticket), finished(ticket, stats),
        # ended(ticket, how), tick(running, decoding)
        self.observer = observer or _NoObserver()
        main.attach(experts)
        config = main.model.config
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
        eos = main.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.moe_layers = len(main.moe_layers)
        self.running: list[tuple[Ticket, RequestRun]] = []
        self.finishing: list[tuple[Ticket, RequestRun, float, float]] = []  # Done held for the recall
        self.tasks = Lockstep()
        self.stream, self.tick = "", 0
        self.prefill_free_tick = 0  # the first tick no admitted prompt's prefill holds (stagger)
        self.prefilled_in_pass = 0  # prompts prefilled between layers of a decode pass (stagger)
        self.kv_bytes_per_position = 0  # measured on the first prefill; 0 = not yet
        self._queue: RequestQueue | None = None
        # decoding requests in one pass through the layers (each row its own bits), where the family
        # and the miss policy allow; else one forward pass per request
        together = batching.batched_decode and experts.substituter is None and BatchedDecode.supports(main)
        self.batched = BatchedDecode(main) if together else None

    # -- requests ------------------------------------------------------------------------------
    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The request checked against the model and the limits (InvalidRequest naming what is
        wrong), its prompt tokenized: its token ids."""
        if request.token_ids and request.prompt:
            raise InvalidRequest("give either a prompt or token_ids, not both")
        ids = list(request.token_ids) if request.token_ids else self.tokenizer(request.prompt)["input_ids"]
        if not ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.main.model.config.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise InvalidRequest(f"token ids must lie in [0, {vocab})")
        if request.max_new_tokens < (0 if request.prompt_logprobs else 1):
            raise InvalidRequest(
                f"max_new_tokens must be at least 1 (0 only to score the prompt), "
                f"got {request.max_new_tokens}"
            )
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must lie in [0, {MAX_LOGPROBS}], got {request.logprobs}")
        resume = request.resume_ids
        if len(resume) > request.max_new_tokens:
            raise InvalidRequest(
                f"{len(resume)} resumed tokens exceed max_new_tokens={request.max_new_tokens}"
            )
        try:
            request.sampling.validate()
        except InvalidSampling as exc:
            raise InvalidRequest(str(exc)) from None
        if len(request.stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in request.stop):
            raise InvalidRequest(f"stop takes at most {MAX_STOPS} non-empty strings")
        if any(not 0 <= i < vocab for i in resume):
            raise InvalidRequest(f"resume_ids must lie in [0, {vocab})")
        if set(resume[:-1]) & self.eos_ids and not request.ignore_eos:
            raise InvalidRequest("resume_ids continue past an end-of-sequence token")
        if self.max_positions and len(ids) + request.max_new_tokens > self.max_positions:
            raise InvalidRequest(
                f"{len(ids)} prompt tokens + max_new_tokens={request.max_new_tokens} exceed the model's "
                f"context of {self.max_positions} positions"
            )
        budget, per_position = self.batching.kv_cache_bytes, self.kv_bytes_per_position
        if budget and per_position and (len(ids) + request.max_new_tokens) * per_position > budget:
            raise InvalidRequest(
                f"{len(ids)} prompt tokens + max_new_tokens={request.max_new_tokens} need more K/V cache "
                f"than server.kv_cache_memory ({budget} bytes) holds"
            )
        return ids

    # -- the loop ------------------------------------------------------------------------------
    @torch.inference_mode()
    def serve(
        self,
        requests: RequestQueue,
        stopped: Callable[[], bool],
        between_ticks: Callable[[], None] = lambda: None,
    ) -> None:
        """Serve `requests` until `stopped()`; `between_ticks` runs at every tick boundary (and while
        idle): the membership upkeep, which owns the same sockets."""
        self._queue = requests
        try:
            while not stopped():
                self._admit(requests)
                between_ticks()
                self._iterate(requests)
        finally:
            self._abandon(requests, ShuttingDown("main is shutting down"))

    def generate(self, request: GenerateRequest) -> Iterator[TokenEvent | DoneEvent]:
        """One request alone, its events as they come (tests, tools; main's own front doors queue)."""
        queue = self._queue = RequestQueue(max_waiting=1, default_timeout_s=1e9)
        ticket = queue.submit(request)
        events: list = []
        ticket.put = events.append
        with torch.inference_mode():
            self._admit(queue)
            try:
                while self.running or self.finishing:
                    self._iterate(queue)
                    while events:
                        event = events.pop(0)
                        if isinstance(event, Exception):
                            raise event
                        if event is not END:
                            yield event
            finally:
                self._abandon(queue, RuntimeError("the caller stopped reading"))

    def _iterate(self, requests: RequestQueue) -> None:
        """One tick of the running requests (if any), then the finished ones' DoneEvents."""
        if self.running:
            self._tick()
            self._retire(requests)
        self._finish_held(requests, wait=not self.running)

    # 1) admit ---------------------------------------------------------------------------------
    def _admit(self, requests: RequestQueue) -> None:
        idle = not self.running and not self.finishing
        while room(self.batching.max_running, len(self.running)):
            ticket = requests.take(timeout=IDLE_WAIT_S if idle and not self.running else 0.0, fits=self._fits)
            if ticket is None:
                break
            self._start(ticket, requests)
        requests.capacity = room(self.batching.max_running, len(self.running))

    def _fits(self, ticket: Ticket) -> bool:
        """Whether the K/V cache budget has room for this request (tick_plan.kv_fits)."""
        budget = self.batching.kv_cache_bytes
        if not budget or not self.running:
            return True
        try:
            need = len(_validated_ids(ticket, self.prompt_ids)) + ticket.request.max_new_tokens
        except InvalidRequest:
            return True  # admitted only to be refused, with the reason
        held = sum(r.prompt_len + r.request.max_new_tokens for _, r in self.running)
        return kv_fits(budget, self.kv_bytes_per_position, held, need, first=False)

    def _start(self, ticket: Ticket, requests: RequestQueue, in_pass: bool = False) -> RequestRun | None:
        """The request admitted (its run, or None: refused, or over before it began). `in_pass`:
        admitted between two layers of a decode pass, where only a plain prefill may go at once."""
        request = ticket.request
        try:
            ids = _validated_ids(ticket, self.prompt_ids)
        except InvalidRequest as exc:
            ticket.put(exc)
            requests.done(ticket)
            return None
        if not self.running and not self.finishing:  # a new busy period: its stream is named after it
            self.stream, self.tick, self.prefill_free_tick = request.request_id, 0, 0
        arrival = Arrival(len(ids), request.prompt_logprobs, bool(request.prefill_group))
        state = AdmitState(
            self.tick,
            self.prefill_free_tick,
            self.moe_layers,
            self.batching.chunk_tokens,
            self.batching.stagger,
            bool(self.running),
            in_pass,
        )
        schedule = RunSchedule(admit(arrival, state), plan=self.make_plan())
        ctx = self.experts.context(request.request_id)
        sink = _sink(ticket, self.observer)
        run = RequestRun(request, ids, self.main, self.tokenizer, self.eos_ids, ctx, sink, schedule)
        if run.already_over():
            stats = _resumed_over_stats(run)
            ticket.put(DoneEvent(stats))
            self.observer.finished(ticket, stats)
            requests.done(ticket)
            return None
        schedule.leader = _prefill_leader([r for _, r in self.running], self.tasks, run, ids)
        if schedule.leader is not None:  # its prefill is the leader's: decode starts with the leader's
            schedule.admission = schedule.leader.schedule.admission
        else:
            self.prefill_free_tick = schedule.admission.first_tick
        # A prompt only scored has nothing to predict; while the workers' caches hold every expert
        # they serve, predictions would load nothing (and the shadow's compute would slow main's)
        shadow = self.experts.shadow
        if shadow is not None and request.max_new_tokens > 0 and not self.experts.caches_complete():
            schedule.shadow = shadow
            first_tick = schedule.admission.first_tick
            shadow.begin(request.request_id, ids, request.max_new_tokens, self.stream, first_tick)
        self.running.append((ticket, run))
        return run

    # 2) run -----------------------------------------------------------------------------------
    def _tick(self) -> None:
        """Every running request one iteration (a prefill: up to its quota of layers), as the tick's
        plan says (odmoe.main.tick_plan)."""
        decoding = sum(r.decoding for _, r in self.running)
        self.observer.tick(len(self.running), decoding)
        for _, run in self.running:
            if run.decoding:
                run.clock.batch_sizes.append(decoding)  # the requests it decoded beside (itself included)
        views = [_view(run, run.request_id in self.tasks) for _, run in self.running]
        plan = plan_tick(views, self.tick, self.batched is not None)
        runs = {run.request_id: (ticket, run) for ticket, run in self.running}
        self._run_tasks(plan, runs)
        # The batched decode pass after the prefills: a new request's first token then leaves as
        # soon as its prefill is done (the decoding requests' tokens leave at the tick's end anyway)
        if plan.together:
            self._decode_together([runs[key] for key in plan.together])
        self.tick += 1

    def _run_tasks(self, plan: TickPlan, runs: dict[str, tuple[Ticket, RequestRun]]) -> None:
        """The plan's lockstep tasks, exchanging layer by layer: every decoding task's rows of a
        layer in one exchange, prefills one at a time to the end of their quota."""
        decode: dict[str, DecodeRows] = {}  # parked with their rows at the current decode layer
        prefill: list[str] = []  # parked before a prefill layer
        for key in plan.tasks:
            run = runs[key][1]
            if key in plan.resume:  # a prefill parked across ticks: a new quota of layers
                prefill.append(key)
                run.schedule.prefill_layers = 0
                continue
            run.ctx.begin(run.iteration)
            task = self.tasks.start(key, _forward, run, ForwardPass((run.ctx,), self.stream, self.tick))
            self._route(task, runs, decode, prefill)
        while decode or prefill:
            if decode:
                layer = min(rows.layer for rows in decode.values())  # MoE layers in order
                group = {k: r for k, r in decode.items() if r.layer == layer}
                for key in group:
                    del decode[key]
                try:
                    outputs = self.experts.exchange_decode(
                        Step(self.stream, self.tick, layer), list(group.values())
                    )
                except Exception as exc:  # every request of the exchange needed that layer
                    for key in group:
                        self._fail(runs[key], exc)
                    continue
                for key, out in zip(group, outputs, strict=True):
                    self._route(self.tasks.resume(key, out), runs, decode, prefill)
                continue
            # One prefill at a time, to the end of its quota: of k prompts arriving together the
            # first streams its token after one prefill, not all after k
            key = prefill.pop(0)
            run = runs[key][1]
            if run.schedule.prefill_layers >= run.schedule.admission.quota:
                continue  # its quota for this tick is spent: it goes on next tick
            run.schedule.prefill_layers += 1
            self._route(self.tasks.resume(key), runs, decode, prefill)
            if prefill and prefill[-1] == key:  # parked before its next layer: it goes on first
                prefill.insert(0, prefill.pop())

    def _decode_together(self, entries: list[tuple[Ticket, RequestRun]]) -> None:
        """Their decode iterations in one pass (odmoe.main.batched_decode): each request's logits
        are those of its own forward pass; each layer's experts go out in one exchange."""
        assert self.batched is not None
        for _, run in entries:
            run.ctx.begin(run.iteration)
        running = ForwardPass(tuple(run.ctx for _, run in entries), self.stream, self.tick, rows=True)
        inputs = [run.decode_input() for _, run in entries]
        decode = self.batched.step(inputs, running)
        try:
            for _ in decode:  # one decoder layer at a time; between two, a new prompt may prefill
                if self.batching.stagger:
                    self._prefill_in_pass()
        except Exception as exc:  # every request of the pass needed each layer's exchange
            for entry in entries:
                self._fail(entry, exc)
            return
        for (ticket, run), row in zip(entries, decode.logits, strict=True):
            self._accept(ticket, run, row)

    def _prefill_in_pass(self) -> None:
        """Between two layers of the batched decode pass: a prompt that arrived since the tick began,
        if this tick has no prefill yet, is admitted and prefilled now, its first token streamed at
        once, rather than after the rest of the pass and at the next tick (in the closed loop of
        the serving suite a client's next request arrives just after a tick began: that wait was
        most of its TTFT). Its prefill is its own forward pass, outside the pass (nothing of a
        DecodePass is active between its layers), so its bits are what they are alone; it decodes
        from the next tick on, the tick it was admitted for. Only a plain prefill goes now, and none
        while a prefill task is parked: a prompt that is scored, chunked or in a prefill group is
        admitted now and prefills from the next tick (`_start(in_pass=True)`), its first decode
        tick told so."""
        queue = self._queue
        if queue is None or self.tasks or len(self.running) >= self.batching.max_running:
            return
        if self.prefill_free_tick > self.tick:
            return  # this tick has its prefill: the next prompt takes the next tick (stagger)
        ticket = queue.take(timeout=0.0, fits=self._fits)
        if ticket is None:
            return
        run = self._start(ticket, queue, in_pass=True)
        queue.capacity = room(self.batching.max_running, len(self.running))
        if run is None or run.schedule.leader is not None:
            return
        if run.schedule.admission.prefill_tick == self.tick:
            self.prefilled_in_pass += 1
            self._run_tasks(TickPlan(tasks=[run.request_id]), {run.request_id: (ticket, run)})

    def _route(self, outcome, runs, decode: dict, prefill: list) -> None:
        """Where a task stands after it ran: parked at a decode layer, before a prefill layer, or done."""
        key = outcome.key
        ticket, run = runs[key]
        if isinstance(outcome, Parked):
            if isinstance(outcome.payload, DecodeRows):
                decode[key] = outcome.payload
            else:
                prefill.append(key)
        elif isinstance(outcome, Failed):
            self._fail((ticket, run), outcome.error)
        elif isinstance(outcome, Finished):
            self._accept(ticket, run, outcome.value)

    # 3) choose --------------------------------------------------------------------------------
    def _accept(self, ticket: Ticket, run: RequestRun, logits: torch.Tensor) -> None:
        if run.iteration == 0:
            if not self.kv_bytes_per_position:
                self.kv_bytes_per_position = _cache_bytes(run.cache) // max(run.prompt_len, 1)
            for follower_ticket, follower in [(t, r) for t, r in self.running if r.schedule.leader is run]:
                follower.cache = copy.deepcopy(run.cache)  # the prompt's K/V rows, before any decode
                follower.schedule.leader = None
                self._accept(follower_ticket, follower, logits)
        finished = run.accept(logits)
        if not finished:
            run.align_shadow(self.pace_shadow)
        run.next_iteration()

    def _retire(self, requests: RequestQueue) -> None:
        """Requests over, cancelled or past their deadline leave now (at the tick boundary)."""
        keep = []
        for ticket, run in self.running:
            if run.done:
                self._end(ticket, run)
                self.finishing.append((ticket, run, time.perf_counter(), time.monotonic() + RECALL_WAIT_S))
            elif ticket.cancelled.is_set():  # its client went away
                log.info("request %s cancelled by its client", run.request_id)
                self._end(ticket, run)
                self.observer.ended(ticket, "cancelled")
                requests.done(ticket)
            elif ticket.expired():
                self._end(ticket, run)
                ticket.put(DeadlineExceeded(f"request {run.request_id} ran past its deadline"))
                self.observer.ended(ticket, "deadline")
                requests.done(ticket)
            else:
                keep.append((ticket, run))
        self.running = keep
        self._end_stream_if_idle()

    def _finish_held(self, requests: RequestQueue, wait: bool) -> None:
        """Finished requests get their DoneEvent once the shadow has sent every prediction for them
        (the paper's recall counts those that came late too), or after RECALL_WAIT_S."""
        held = []
        for ticket, run, ended_at, deadline in self.finishing:
            shadow = run.schedule.shadow
            ready = shadow is None or shadow.ended(run.request_id) or time.monotonic() >= deadline
            if not ready and wait:
                shadow.wait_ended(run.request_id, deadline)
                ready = True
            if not ready:
                held.append((ticket, run, ended_at, deadline))
                continue
            recall = self.experts.recall(run.ctx, wait_s=0.0)
            stats = request_stats(run, self.experts, self.main, recall, ended_at)
            if run.schedule.shadow is not None:
                run.schedule.shadow.forget(run.request_id)
            self.observer.finished(ticket, stats)
            # main's spans reach the trace file before the client learns the request is done
            self.experts.tracer.flush()
            ticket.put(DoneEvent(stats, run.logits[0].clone() if run.request.return_logits else None))
            requests.done(ticket)
        self.finishing = held
        self._end_stream_if_idle()

    def _end(self, ticket: Ticket, run: RequestRun) -> None:
        """The run leaves: its task (a prefill parked across ticks) ends, the shadow stops on it;
        requests that were to copy its prefill compute their own."""
        self.tasks.cancel(run.request_id)
        for _, follower in self.running:
            if follower.schedule.leader is run:
                follower.schedule.leader = None
        if run.schedule.shadow is not None:
            run.schedule.shadow.end(run.request_id)

    def _fail(self, entry: tuple[Ticket, RequestRun], error: BaseException) -> None:
        ticket, run = entry
        if isinstance(error, Exception) and not isinstance(error, InvalidRequest):
            log.error("request %s failed: %s: %s", run.request_id, type(error).__name__, error)
        self._end(ticket, run)
        self.running = [(t, r) for t, r in self.running if r is not run]
        ticket.put(error if isinstance(error, Exception) else RuntimeError(str(error)))
        self._queue.done(ticket)
        self.observer.ended(ticket, "error")

    def _abandon(self, requests: RequestQueue, reason: Exception) -> None:
        for ticket, run in self.running:
            self._end(ticket, run)
        for ticket in [t for t, _ in self.running] + [held[0] for held in self.finishing]:
            ticket.put(reason)
            self.observer.ended(ticket, "error")
            requests.done(ticket)
        self.running, self.finishing = [], []
        self._end_stream_if_idle()

    def _end_stream_if_idle(self) -> None:
        """No request left: the workers drop what they hold for the stream."""
        if not self.running and not self.finishing and self.stream:
            self.experts.end_stream(self.stream)
            self.stream = ""


def _forward(run: RequestRun, context: ForwardPass) -> torch.Tensor | None:
    """A lockstep task's body: the run's forward pass, its experts calls its own (the task starts at
    once, so `context` holds the stream and tick it starts in)."""
    with forward_pass(context):
        return run.forward()


class _NoObserver:
    def token(self, ticket) -> None: ...
    def finished(self, ticket, stats: dict) -> None: ...
    def ended(self, ticket, how: str) -> None: ...
    def tick(self, running: int, decoding: int) -> None: ...


def _validated_ids(ticket: Ticket, check: Callable[[GenerateRequest], list[int]]) -> list[int]:
    """The ticket's prompt ids, validated once: at submit (main's front doors) or here, the first
    time the engine looks at a ticket made without them."""
    if ticket.prompt_ids is None:
        ticket.prompt_ids = check(ticket.request)
    return ticket.prompt_ids


def _prefill_leader(
    running: list[RequestRun], tasks: Lockstep, run: RequestRun, ids: list[int]
) -> RequestRun | None:
    """A running request of the same `prefill_group` and prompt whose prefill has not started."""
    group = run.request.prefill_group
    leaders = (
        other
        for other in running
        if other.request.prefill_group == group
        and other.schedule.leader is None
        and other.iteration == 0
        and other.request_id not in tasks
        and other.step_input[0].tolist() == ids
    )
    return next(leaders, None) if group else None


def _view(run: RequestRun, parked: bool) -> RunView:
    """What the tick's planner sees of a run."""
    follows, starts = run.schedule.leader is not None, run.schedule.admission.prefill_tick
    return RunView(run.request_id, run.decoding, run.iteration, starts, follows, parked)


def _sink(ticket: Ticket, observer):
    """Where a run's events go: its ticket, each streamed token counted by the metrics."""

    def put(event) -> None:
        if isinstance(event, TokenEvent):
            observer.token(ticket)
        ticket.put(event)

    return put


def _cache_bytes(cache) -> int:
    tensors = [
        getattr(layer, name, None) for layer in getattr(cache, "layers", ()) for name in ("keys", "values")
    ]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _resumed_over_stats(run: RequestRun) -> dict:
    return {
        "request_id": run.request_id,
        "new_tokens": 0,
        "resumed_tokens": len(run.resumed),
        "finish_reason": "length" if len(run.resumed) == run.request.max_new_tokens else "stop",
    }
