"""The shadow node: a local copy of the model that runs ahead of main and publishes its routers'
choices as predictions (OD-MoE "scaled emulative prediction", paper §3.2).

Lifecycle: load the model at `shadow.precision`, bind a PULL socket (main's Begin/Align/End) and a
PUB socket (predictions), announce readiness, then serve every request main runs (several at once
when main batches them, `odmoe.main.engine`):
  1) Begin: prefill its own cache from the prompt (no predictions: prefill spreads every expert);
  2) each decode iteration n of each request, `alignment.mode=wait` (the paper's): wait for main's
     alignment where main said it would send one (the wait is the late departure), take main's
     token and/or overwrite its newest K/V rows with main's, run the forward pass.
     `alignment.mode=speculative`: never wait for alignment; run on from its own token and let
     main's reports catch up (odmoe.shadow.speculation): a token that differs from what it fed rolls the
     cache back to that iteration, main's K/V rows overwrite its own in place; at most
     `alignment.max_ahead` iterations ahead of main;
  3) End stops it. A shadow that is wrong or late never changes main's output.

Several requests: iteration n of a request runs in main's tick `first_tick + n - 1` (its Begin
says). The shadow steps every request due at the same tick together, one forward pass each in its
own cache, interleaved at the routers (`odmoe.main.lockstep`): once each has chosen its experts for a
layer it publishes one prediction for (stream, tick, layer), the union of their choices with each
request's own listed, so the workers preload each expert once, and main counts recall per request.
A request behind the others (just begun, rolled back) catches up alone, and the union for the ticks
it re-runs is published again (a later prediction for a step supersedes the earlier one).

`shadow.mode=random` publishes uniformly random experts instead (ablation case 5) and loads no model.

Every control frame is untrusted: one that does not decode, a Begin whose prompt the model cannot
take, an Align whose K/V rows do not fit the cache - each is dropped (the request it belongs to is
abandoned) with a rate-limited log line, and the shadow serves the next Begin. A Begin for a
request it already runs replaces that run (main resuming the request after losing this shadow:
its prompt then holds the tokens main fed since). Main's UDP beats are echoed on the control
port's number (odmoe/transport/beats.py). With
`cluster.main_addresses` set it announces itself to main on start, so a restarted shadow is used
again. With security on (the default) both sockets are CURVE servers admitting only the cluster's
keys, each for its roles: only main's key may send control messages, only main's and the workers'
may read predictions.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import torch
import zmq
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, DynamicCache

from odmoe.config import OdmoeConfig
from odmoe.main.alignment import make_plan
from odmoe.main.lockstep import Failed, Finished, Lockstep, Parked, in_task, park
from odmoe.models.cache_argument import with_cache
from odmoe.models.families import family_of
from odmoe.models.main_model import experts_modules
from odmoe.models.open_model import load_config
from odmoe.nodes.ready import announce_ready
from odmoe.placement import Topology
from odmoe.shadow.hedging import GroupLimit, shadow_hedges
from odmoe.shadow.made_wrong import MadeWrong
from odmoe.shadow.router_tap import RouterTap, rank
from odmoe.shadow.shadow_batch import RowCache, ShadowBatch, batchable
from odmoe.shadow.shadow_model import (
    load_shadow_model,
    model_bytes,
    resolve_precision,
    router_modules,
)
from odmoe.shadow.speculation import Speculation
from odmoe.tools.faults import FaultTrigger
from odmoe.tools.trace import Tracer, now_us
from odmoe.transport.announce import announce
from odmoe.transport.beats import echo_for
from odmoe.transport.codec import CodecError
from odmoe.transport.dropped import DropLog
from odmoe.transport.messages import (
    Align,
    BeginRequest,
    EndRequest,
    Prediction,
    ShadowEnded,
    ShadowIteration,
    Step,
    from_frames,
    to_frames,
)
from odmoe.transport.security import NodeSecurity, secure_server
from odmoe.worker.device_slots import device_peak_bytes

log = logging.getLogger("odmoe.shadow")
LINGER_MS = 1  # how long a batched step waits for main's next report while other rows lag


def topic(group: int) -> bytes:
    return f"g{group}".encode()


@dataclass
class _Run:
    """One request at the shadow: its cache, the token it goes on from, how it aligns."""

    begin: BeginRequest
    cache: RowCache | None  # None: random mode (no model)
    own_token: int
    next_wait: int  # wait mode: the next iteration main will align
    spec: Speculation | None = None  # speculative mode
    next_iteration: int = 1  # wait mode (speculative: spec.next_iteration)
    aligns: dict[int, tuple[Align, list[torch.Tensor]]] = field(default_factory=dict)  # wait mode
    rows: list = field(default_factory=list)  # speculative: main's K/V rows not placed yet
    forward_s: float = 0.0
    idle_since_us: float = 0.0  # when it last had to wait for main (alignment_wait_s)

    @property
    def request(self) -> str:
        return self.begin.request

    @property
    def iteration(self) -> int:
        return self.spec.next_iteration if self.spec is not None else self.next_iteration

    @property
    def tick(self) -> int:
        """Main's tick of this request's next iteration."""
        return self.begin.first_tick + self.iteration - 1

    @property
    def over(self) -> bool:
        return self.iteration >= self.begin.max_new_tokens


@dataclass(frozen=True)
class _Choice:
    """What one request's router chose at one layer (a task parks with it)."""

    layer: int
    experts: list[int]
    candidates: list[int]
    probs: list[float]
    hedges: list[int]


class ShadowNode:
    def __init__(self, cfg: OdmoeConfig, model_path: str):
        self.cfg, self.scfg = cfg, cfg.shadow
        self.alignment = cfg.alignment
        self.first_wait = make_plan(cfg.alignment).next_after(0)  # main's plan says the same
        config = load_config(model_path)  # a wrapper's text model; a GGUF file's as odmoe reads it
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.family = family_of(config)
        self.num_experts = int(getattr(config, self.family.num_experts_field))
        self.top_k = int(getattr(config, self.family.top_k_field))
        self.model = None
        if self.scfg.mode == "emulate":
            start = time.perf_counter()
            # auto: int8_dynamic or int4 (CUDA: int8 or nf4), by what fits this node's memory
            self.precision = resolve_precision(
                model_path, self.scfg.precision, self.scfg.device, cfg.node.memory
            )
            self.model = load_shadow_model(model_path, self.precision, self.scfg.device)
            self.weight_bytes = model_bytes(self.model)
            log.info(
                "shadow: %s copy, %.2f MiB of weights (%.1fs)",
                self.precision,
                self.weight_bytes / 2**20,
                time.perf_counter() - start,
            )
            self._hook_routers()
        else:
            self.precision, self.weight_bytes = "", 0
        self.moe_layers = sorted(self._router_layers(config))
        # the topic of a layer's predictions is its group, as main and the workers place it
        self.topology = Topology(cfg.cluster.workers, cfg.cluster.group_size).for_model(self.moe_layers)
        self.ctx = zmq.Context.instance()
        sec = cfg.security
        self.security = NodeSecurity.load(sec.enabled, sec.key_dir, sec.node_name("shadow", 0))
        self.zap = self.security.curve.authenticator(self.ctx) if self.security.curve else None
        self.control = self.ctx.socket(zmq.PULL)
        self.pub = self.ctx.socket(zmq.PUB)
        # control: main's key only; predictions: main's and the workers' (odmoe.transport.security)
        for sock, socket in ((self.control, "shadow-control"), (self.pub, "shadow-predictions")):
            sock.setsockopt(zmq.LINGER, 0)
            secure_server(sock, self.security.curve, socket)
        host, port = cfg.cluster.host, cfg.cluster.shadow_port
        if port:
            self.control.bind(f"tcp://{host}:{port}")
            self.pub.bind(f"tcp://{host}:{port + 1}")
            pub_port = port + 1
        else:
            port = self.control.bind_to_random_port(f"tcp://{host}")
            pub_port = self.pub.bind_to_random_port(f"tcp://{host}")
        self.address, self.pub_address = f"tcp://{host}:{port}", f"tcp://{host}:{pub_port}"
        self.beat_echo = echo_for(self.address)  # main's beats: UDP, the control port's number
        self.rng = random.Random(self.scfg.seed)
        # tests and benchmarks only (emulation.inject_wrong*): predictions and own tokens made wrong
        self.made_wrong = MadeWrong(cfg.emulation, self.num_experts, self.vocab_size, self.rng)
        self.runs: dict[str, _Run] = {}  # the requests main runs, in the order they began
        self.stream = ""  # main's decode stream (the busy period's name)
        # (tick, layer) -> request -> its choice: what the union published for that step is made of
        self.choices: dict[tuple[int, int], dict[str, _Choice]] = {}
        self.tasks = Lockstep()
        self._running: _Run | None = None  # the request whose forward pass runs (the router hooks')
        # every request whose model's cache can be batched (odmoe.shadow.shadow_batch): one forward per tick
        self.batch = ShadowBatch(self.model) if self.model is not None else None
        self.tracer = Tracer("shadow", cfg.trace_dir)
        self._layer_since_us = 0.0  # when the current layer's computation began (timeline only)
        self.main_addresses = cfg.cluster.main_addresses
        self.where = cfg.cluster.where
        self.fault = FaultTrigger(cfg.fault, "shadow")
        self.dropped = DropLog(log, "shadow")

    def _router_layers(self, config) -> list[int]:
        if self.model is not None:
            return [layer for layer, _ in router_modules(self.model, self.num_experts)]
        with init_empty_weights():
            skeleton = AutoModelForCausalLM.from_config(config)
        return [layer for layer, _ in experts_modules(skeleton)]

    # -- predictions -------------------------------------------------------------------------
    def _hook_routers(self) -> None:
        self.tap = RouterTap(self.model, self.num_experts, on_route=self._on_route)

    def _on_route(self, layer: int, module, output) -> None:
        """Every router call: this request's choice at `layer` (with the router's expert groups,
        where it picks only from some: group hedges need them), handed to the driver, which
        publishes once every request of the tick has chosen."""
        limit = self.tap.limits[layer]
        if self.batch is not None and self.batch.stepping:  # one row per batched request
            ticks = set()
            for row, request in self.batch.stepping:
                run = self.runs[request]  # each at its own tick (a speculative row may be ahead)
                self.fault.at(run.request, run.iteration, layer)
                self._choose(run.tick, layer, request, self.choice(module, output, layer, limit, row))
                ticks.add(run.tick)
            for tick in sorted(ticks):
                self.publish(tick, layer)
            return
        run = self._running
        if run is None or run.iteration < 1:
            return  # prefill: nothing to predict
        self.fault.at(run.request, run.iteration, layer)
        choice = self.choice(module, output, layer, limit)
        if not in_task():  # the tick's only request: publish at once
            self._choose(run.tick, layer, run.request, choice)
            self.publish(run.tick, layer)
            return
        park(choice)
        self._running = run

    def choice(self, module, output, layer: int, limit: GroupLimit | None, row: int = -1) -> _Choice:
        """What a router's output predicts for one of its rows (the newest token's by default): its
        experts, the top-(k+1) candidates with their scores, and the hedges (`odmoe.shadow.hedging`)."""
        ranked = rank(module, output[0][row], self.top_k, limit)  # the one rule (odmoe.shadow.router_tap)
        experts = self.made_wrong.experts(output[2][row].tolist())
        margin = self.scfg.hedge_margin
        every = ranked.every if margin > 0 else None  # group hedges rank groups by it
        hedges = shadow_hedges(ranked.candidates, ranked.probs, self.top_k, margin, every, limit)
        others = [h for h in hedges if h not in experts]
        return _Choice(layer, experts, ranked.candidates, ranked.probs, others)

    def _choose(self, tick: int, layer: int, request: str, choice: _Choice) -> None:
        self.choices.setdefault((tick, layer), {})[request] = choice

    def publish(self, tick: int, layer: int) -> None:
        """The union of every request's choice at (tick, layer), each request's own listed."""
        chosen = self.choices.get((tick, layer), {})
        if not chosen:
            return
        experts: list[int] = []
        for choice in chosen.values():  # the first request's in its router's order, then the others'
            experts += [e for e in choice.experts if e not in experts]
        hedges = sorted({h for c in chosen.values() for h in c.hedges} - set(experts))
        first = next(iter(chosen.values()))
        message = Prediction(
            Step(self.stream, tick, layer),
            experts,
            first.candidates,
            first.probs,
            hedges,
            requests=list(chosen),
            request_experts=[c.experts for c in chosen.values()],
        )
        self.pub.send_multipart([topic(self.topology.group_of_layer(layer)), *to_frames(message)])
        if self.tracer.enabled:
            now = now_us()
            self.tracer.span(
                "shadow", f"L{layer}", self._layer_since_us, now, iteration=tick, experts=experts
            )
            self._layer_since_us = now

    # -- control -----------------------------------------------------------------------------
    def _next_control(self, block: bool):
        """The next control message (Begin / Align / End); frames that are not one are dropped."""
        while block or self.control.poll(0):
            try:
                message, tensors = from_frames(self.control.recv_multipart(copy=False))
            except CodecError as exc:
                self.dropped.drop(exc)
                continue
            if isinstance(message, BeginRequest | Align | EndRequest):
                return message, tensors
            self.dropped.drop(f"{message.kind} is not a control message")
        return None

    def _take_control(self, block: bool) -> None:
        """Read main's messages (waiting for one when `block`) and apply each to its request."""
        item = self._next_control(block)
        while item is not None:
            message, tensors = item
            try:
                if isinstance(message, BeginRequest):
                    self._begin(message)
                elif isinstance(message, EndRequest):
                    self._end(message.request)
                elif message.request in self.runs:
                    self._align(self.runs[message.request], message, tensors)
            except Exception as exc:  # a bad Begin or Align: abandon that request, keep serving
                request = getattr(message, "request", "")
                self.dropped.drop(f"request {request!r:.40} abandoned: {type(exc).__name__}: {exc}")
                self.runs.pop(request, None)
            item = self._next_control(False)

    def _begin(self, begin: BeginRequest) -> None:
        self._check_begin(begin)
        if begin.request in self.runs:  # main resumes it after losing this shadow: start afresh
            self._drop(begin.request)
        stream = begin.stream or begin.request
        if stream != self.stream:  # main's new busy period: what was kept for the old one is no use
            self.stream, self.choices = stream, {}
            for request in list(self.runs):
                self._end(request)
        begin = BeginRequest(begin.request, begin.prompt_ids, begin.max_new_tokens, stream, begin.first_tick)
        cache, own = None, -1
        if self.model is not None:  # 1) its own prefill (nothing to predict), then into the batch
            prefilled = DynamicCache(config=self.model.config)
            ids = torch.tensor([begin.prompt_ids], device=self.scfg.device)
            self._running = None
            cached = with_cache(self.model, prefilled)
            out = self.model(input_ids=ids, **cached, use_cache=True, logits_to_keep=1)
            own = int(out.logits[0, -1].argmax())
            if batchable(prefilled):
                self.batch.add(begin.request, prefilled)
                cache = self.batch.row(begin.request)
            else:
                cache = RowCache(prefilled)
        spec = None
        if self.alignment.mode == "speculative" and self.model is not None:
            spec = Speculation(len(begin.prompt_ids), self.alignment.max_ahead)
        self.runs[begin.request] = _Run(begin, cache, own, self.first_wait, spec)

    def _end(self, request: str) -> None:
        """Main is done with it: every prediction for it went out before this word (in order)."""
        self._drop(request)
        self.pub.send_multipart([b"main", *to_frames(ShadowEnded(request))])

    def _drop(self, request: str) -> None:
        self.runs.pop(request, None)
        if self.batch is not None:
            self.batch.remove(request)
        for chosen in self.choices.values():
            chosen.pop(request, None)

    def _align(self, run: _Run, align: Align, tensors: list[torch.Tensor]) -> None:
        if run.cache is None:  # random mode: an Align only paces it
            run.aligns[align.iteration] = (align, [])
            return
        if align.kv:
            self._check_rows(tensors, run.cache)
        if run.spec is None:  # wait mode (or random): kept for the iteration it is for
            if align.iteration >= run.next_iteration:
                run.aligns[align.iteration] = (align, tensors)
            return
        spec = run.spec
        if align.kv:
            start, end = spec.rows_span(align.iteration, tensors[0].shape[2])
            if start < 0:
                raise ValueError(f"an Align's {end - start} K/V rows do not fit its iteration")
            run.rows.append((start, end, tensors[0], tensors[1]))
        back = spec.on_main(align.iteration, align.token)
        if back is not None:
            if run.cache.croppable:
                run.cache.crop_to(spec.keep_length(back))
            else:
                run.cache = self._refilled(run, back)
            spec.roll_back(back)
            log.debug("request %s: main's token differs at iteration %d: rolled back", run.request, back)
        self._place_rows(run.cache, run.rows)

    def _runnable(self, run: _Run) -> bool:
        if run.over:
            return False
        if run.spec is not None:
            return run.spec.may_run()
        if self.model is None:  # random: paced by main, one Align per iteration
            return run.next_iteration in run.aligns
        return run.next_iteration != run.next_wait or run.next_iteration in run.aligns

    # -- the loop ----------------------------------------------------------------------------
    def serve(self, ready_file: str | None = None) -> None:
        announce_ready(
            ready_file,
            role="shadow",
            address=self.address,
            pub_address=self.pub_address,
            weight_bytes=self.weight_bytes,
        )
        announce(
            self.main_addresses,
            "shadow",
            self.address,
            pub_address=self.pub_address,
            where=self.where,
            credentials=self.security.client,
        )
        log.info(
            "shadow (%s) serving: control %s, predictions %s", self.scfg.mode, self.address, self.pub_address
        )
        with torch.inference_mode():  # every cache is made, cropped and overwritten under it
            while True:
                runnable = [r for r in self.runs.values() if self._runnable(r)]
                self._take_control(block=not runnable)
                runnable = self._gather()
                if not runnable:
                    self.tracer.flush()
                    continue
                tick = min(r.tick for r in runnable)
                if runnable[0].cache is not None and runnable[0].cache.batch is not None:
                    self.run_tick(tick, runnable)  # batched: every runnable row steps, each at its tick
                else:
                    self.run_tick(tick, [r for r in runnable if r.tick == tick])

    def _gather(self) -> list[_Run]:
        """The requests that can run now. Batched, a step costs the same for one row as for all, and
        main reports every request's iteration at once at the end of its own: so while some rows
        still wait for main, wait a little (LINGER_MS, only while reports keep coming) for theirs."""
        runnable = [r for r in self.runs.values() if self._runnable(r)]
        if not runnable or runnable[0].cache is None or runnable[0].cache.batch is None:
            return runnable
        while len(runnable) < sum(not r.over for r in self.runs.values()) and self.control.poll(LINGER_MS):
            self._take_control(block=False)
            runnable = [r for r in self.runs.values() if self._runnable(r)]
        return runnable

    def _check_begin(self, begin: BeginRequest) -> None:
        ids = begin.prompt_ids
        if not ids or any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"prompt ids must be a non-empty list in [0, {self.vocab_size})")
        if begin.max_new_tokens < 1 or (
            self.max_positions and len(ids) + begin.max_new_tokens > self.max_positions
        ):
            raise ValueError(f"max_new_tokens={begin.max_new_tokens} does not fit the context")
        if begin.first_tick < 1:
            raise ValueError(f"first_tick={begin.first_tick} is before the first decode tick")

    def run_tick(self, tick: int, runs: list[_Run]) -> None:
        """2) One iteration of every request in `runs` (due at `tick`, or batched: each at its own),
        their routers in step."""
        tokens = {}
        for run in runs:
            tokens[run.request] = self._depart(run)
        self._layer_since_us = now_us()
        if self.model is None:
            self._run_random(tick, runs)
            return
        if runs[0].cache.batch is not None:  # batched (every run of a batchable model is)
            self._run_batched(tick, runs, tokens)
            return
        if len(runs) == 1:  # one request: its forward pass needs no lockstep (its hook publishes)
            run = runs[0]
            self._running, start = run, time.perf_counter()
            try:
                self._ran(run, self._forward(tokens[run.request], run))
            except Exception as exc:  # a bad Align's rows, say: abandon that request, keep serving
                self.dropped.drop(f"request {run.request!r:.40} abandoned: {type(exc).__name__}: {exc}")
                self.runs.pop(run.request, None)
            run.forward_s += time.perf_counter() - start
            self._running = None
            self._forget_before(tick)
            return
        parked: dict[str, _Choice] = {}
        for run in runs:
            start = time.perf_counter()
            self._running = run
            self._settle(
                run, self.tasks.start(run.request, self._forward, tokens[run.request], run), parked, tick
            )
            run.forward_s += time.perf_counter() - start
        while parked:
            layer = min(c.layer for c in parked.values())
            group = [k for k, c in parked.items() if c.layer == layer]
            for request in group:
                self._choose(tick, layer, request, parked.pop(request))
            self.publish(tick, layer)
            for request in group:
                run = self.runs.get(request)
                start = time.perf_counter()
                self._running = run
                self._settle(run, self.tasks.resume(request), parked, tick)
                if run is not None:
                    run.forward_s += time.perf_counter() - start
        self._running = None
        self._forget_before(tick)

    def _forget_before(self, tick: int) -> None:
        """Choices of ticks no request can run again (a rollback goes back at most max_ahead + 1)."""
        oldest = min((r.tick for r in self.runs.values()), default=tick) - self.alignment.max_ahead - 2
        for key in [k for k in self.choices if k[0] < oldest]:
            del self.choices[key]

    def _run_batched(self, tick: int, runs: list[_Run], tokens: dict[str, int]) -> None:
        """One forward pass of the whole batch; the router hooks publish each layer's union."""
        start = time.perf_counter()
        try:
            own = self.batch.step(tokens)
        except Exception as exc:  # a bad Align's rows, say: those requests are abandoned
            for run in runs:
                self.dropped.drop(f"request {run.request!r:.40} abandoned: {type(exc).__name__}: {exc}")
                self._end(run.request)
            return
        share = (time.perf_counter() - start) / len(runs)
        for run in runs:
            token = self.made_wrong.token(own[run.request])
            run.forward_s += share
            self._ran(run, (tokens[run.request], token))
        self._forget_before(tick)

    def _settle(self, run: _Run, outcome, parked: dict[str, _Choice], tick: int) -> None:
        if isinstance(outcome, Parked):
            parked[outcome.key] = outcome.payload
        elif isinstance(outcome, Finished):
            self._ran(run, outcome.value)
        elif isinstance(outcome, Failed):
            self.dropped.drop(
                f"request {outcome.key!r:.40} abandoned: {type(outcome.error).__name__}: {outcome.error}"
            )
            self.runs.pop(outcome.key, None)

    def _depart(self, run: _Run) -> int:
        """Before a request's iteration: its alignment (wait mode: the token and/or K/V rows main
        sent for it), its ShadowIteration report; the token it feeds."""
        iteration = run.iteration
        token, main_started_us = run.own_token, 0.0
        if run.spec is not None:
            self._place_rows(run.cache, run.rows)
            token = run.spec.token_for(run.own_token)
        else:
            aligned = run.aligns.pop(iteration, None)
            run.aligns = {n: a for n, a in run.aligns.items() if n > iteration}
            if aligned is not None:
                align, tensors = aligned
                main_started_us = align.sent_at_us
                run.next_wait = align.next_align if align.next_align > iteration else 0
                if align.token >= 0:
                    token = align.token
                if align.kv and run.cache is not None:  # main's rows of the previous iteration
                    run.cache.overwrite(run.cache.length - tensors[0].shape[2], tensors[0], tensors[1])
        start_us = now_us()
        late_us = max(start_us - main_started_us, 0.0) if main_started_us else 0.0
        started = ShadowIteration(
            run.request,
            iteration,
            late_departure_s=late_us / 1e6,
            alignment_wait_s=(start_us - run.idle_since_us) / 1e6 if run.idle_since_us else 0.0,
            previous_forward_s=run.forward_s,
            ahead=run.spec.ahead if run.spec is not None else 0,
            rollbacks=run.spec.rollbacks if run.spec is not None else 0,
            device_peak_bytes=device_peak_bytes(self.scfg.device),
        )
        run.forward_s, run.idle_since_us = 0.0, 0.0
        self.pub.send_multipart([b"main", *to_frames(started)])
        if late_us:
            self.tracer.span("shadow", "late departure", start_us - late_us, start_us, iteration=iteration)
        return token

    def _forward(self, token: int, run: _Run) -> tuple[int, int]:
        """One decode step of the shadow's copy for one request (its routers' hooks park with their
        choices): the token it fed and its own next one."""
        logits = self.model(
            input_ids=torch.tensor([[token]], device=self.scfg.device),
            **with_cache(self.model, run.cache.cache),
            use_cache=True,
            logits_to_keep=1,
        ).logits
        own = self.made_wrong.token(int(logits[0, -1].argmax()))
        return (token, own)

    def _ran(self, run: _Run, fed_and_own: tuple[int, int]) -> None:
        fed, own = fed_and_own
        run.own_token = own
        if run.spec is not None:
            run.spec.ran(fed)
            self._place_rows(run.cache, run.rows)
        else:
            run.next_iteration += 1
        if not self._runnable(run):
            run.idle_since_us = now_us()  # waiting for main (its alignment, or to fall behind less)

    def _run_random(self, tick: int, runs: list[_Run]) -> None:
        """Ablation case 5: no model, a random guess per layer and request, paced by main."""
        for layer in self.moe_layers:
            for run in runs:
                experts = self.rng.sample(range(self.num_experts), self.top_k)
                self._choose(
                    tick, layer, run.request, _Choice(layer, experts, experts, [0.0] * len(experts), [])
                )
            self.publish(tick, layer)
        for run in runs:
            run.next_iteration += 1

    def _refilled(self, run: _Run, iteration: int) -> RowCache:
        """A rollback for a hybrid model: a linear-attention layer's recurrent state has no earlier
        positions to cut back to, so the cache is built again by one forward pass over the tokens
        before `iteration`'s input (the prompt and the tokens fed since, which held). Rollbacks are
        rare when the shadow predicts well; each costs one prefill of the sequence so far."""
        tokens = [*run.begin.prompt_ids, *(run.spec.fed[n] for n in range(1, iteration))]
        cache, running, self._running = DynamicCache(config=self.model.config), self._running, None
        try:  # like a prefill: the router hooks see no running request and publish nothing
            self.model(
                input_ids=torch.tensor([tokens], device=self.scfg.device),
                **with_cache(self.model, cache),
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            self._running = running
        return RowCache(cache)

    @staticmethod
    def _place_rows(cache: RowCache, rows: list) -> None:
        """Overwrite the shadow's K/V rows with main's wherever the cache already has them."""
        length = cache.length
        for item in [r for r in rows if r[1] <= length]:
            cache.overwrite(item[0], item[2], item[3])
            rows.remove(item)

    def _check_rows(self, tensors: list[torch.Tensor], cache: RowCache) -> None:
        if cache is None:
            raise ValueError("K/V rows for a shadow without a model")
        if len(tensors) != 2 or any(t.dim() != 4 or t.shape[0] != cache.layers for t in tensors):
            raise ValueError("an Align's K/V rows do not fit the cache")
