"""The main node: the gRPC front door and the one thread that runs the decode loop.

Lifecycle: the constructor builds (the model without its experts, the engine) and touches no
network; `start` connects (the workers' and the shadow's sockets and UDP beats; waits for the
shadow, checks each worker answers as the worker it is supposed to be); `serve` then starts the
gRPC server (Inference + standard health checking), announces readiness and serves until
SIGINT/SIGTERM.

Two front doors, one queue: the gRPC API (odmoe.Client) and the OpenAI-compatible HTTP API
(`odmoe/serving/http_api.py`, `server.http`) both validate a request on the thread that receives it (bad
input fails at once: INVALID_ARGUMENT / 400) and put it in the bounded `RequestQueue` (full:
RESOURCE_EXHAUSTED / 429); a single engine thread runs them, up to `server.max_running` together
(continuous batching, `odmoe/main/engine.py`: each request's tokens exactly those it gets alone), in
arrival order, because the ZeroMQ sockets are its alone. Each request has a deadline
(`server.request_timeout_s`, or less if it asks) counted from its arrival.

Failover: the engine thread also keeps the membership (between decode iterations and every
`odmoe.main.engine.IDLE_WAIT_S` while idle): lost workers are probed, announced ones (gRPC `Join`)
checked and taken back, a re-announced shadow reconnected. A request whose client has gone
(cancelled or disconnected) stops at the next iteration boundary, or is skipped if not started. A standby
main is just another main started with the same config: clients fail over to it and resume.

Security (odmoe/transport/security.py, on by default): gRPC is served over TLS and every call, Join and
health checks included, must carry the cluster's bearer token (`BearerToken` refuses the others
UNAUTHENTICATED before a handler runs); the HTTP API is HTTPS with the same token. Main's ZeroMQ
connections are CURVE clients that complete a handshake only with the keys the cluster gave each
worker and the shadow; a worker holding another key is refused at start-up, by name. A live worker
whose key is revoked (`odmoe-keys revoke`) is dropped as lost within a second, and not taken back
until its name has a new key.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import asdict
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from odmoe.config import OdmoeConfig, fault_of
from odmoe.lossy.substitution import Substituter
from odmoe.main.alignment import make_plan
from odmoe.main.engine import (
    Batching,
    DoneEvent,
    GenerateRequest,
    InvalidRequest,
    MainEngine,
    PromptEvent,
    ShuttingDown,
)
from odmoe.main.exchange_observers import FaultInjection
from odmoe.main.membership import Membership
from odmoe.main.remote_experts import RemoteExperts
from odmoe.main.request_queue import END, QueueClosed, QueueFull, RequestQueue, Ticket
from odmoe.main.sampling import SamplingParams
from odmoe.main.shadow_link import ShadowLink
from odmoe.memory_plan import MemoryPlanError, unfit_homes
from odmoe.models.main_model import build_main_model, resolve_dtype
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.nodes.ready import announce_ready
from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.serving.error_status import message_of, status_of
from odmoe.serving.http_api import start_http
from odmoe.serving.metrics import ServerMetrics
from odmoe.serving.text_check import TextCheck
from odmoe.tools.faults import FaultTrigger
from odmoe.tools.memory import parse_bytes
from odmoe.tools.trace import Tracer
from odmoe.transport.beats import BeatWatch
from odmoe.transport.heartbeat import Heartbeat
from odmoe.transport.security import BearerToken, NodeSecurity
from odmoe.validation import late_calls, straggler_watch, suspicion_settings

log = logging.getLogger("odmoe.main")
ADOPT_SHADOW_WAIT_S = 2.0  # while no request runs, look after the membership this often
KEY_CHECK_S = 1.0  # how often main checks that each live worker's key is still admitted
# Clients' keepalive pings (how they notice a frozen main) must be allowed, however often they come.
SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 100),
    ("grpc.http2.max_ping_strikes", 0),
]


def server_options(ping_s: float, ping_timeout_s: float) -> list[tuple[str, int]]:
    """SERVER_OPTIONS plus main's own pings to each client (server.client_ping_s): a connection
    whose ping is unanswered for `ping_timeout_s` is closed, which cancels its calls (each Generate's
    `context.add_callback(ticket.cancel)`), so a client whose link black-holed mid-stream leaves at
    the next decode iteration. Without them gRPC's server pings every 2 hours, and a stream into a
    black hole (the bytes ACKed by nobody, or by a relay that holds them) kept its place until its
    deadline. Pings go on while a stream sends nothing (queued, a long prefill): no limit on those.
    The timeout must be set twice: gRPC 1.85 waits for a ping's answer `ping_timeout_ms` (1 minute
    by default), whatever `keepalive_timeout_ms` says (measured: unset, a black-holed stream stayed)."""
    ping_ms, timeout_ms = max(int(ping_s * 1000), 1), max(int(ping_timeout_s * 1000), 1)
    return [
        *SERVER_OPTIONS,
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class PortInUse(RuntimeError):
    pass


class MainNode(odmoe_pb2_grpc.InferenceServicer):
    def __init__(self, cfg: OdmoeConfig, model_path: str):
        self.cfg, self.model_path = cfg, model_path
        self.checkpoint = open_checkpoint(model_path)
        main = build_main_model(
            self.checkpoint, resolve_dtype(cfg.model.dtype, self.checkpoint), cfg.model.device
        )
        tokenizer = load_tokenizer(model_path)
        self.heartbeat = Heartbeat(cfg.failover.heartbeat_interval_s, cfg.failover.heartbeat_timeout_s)
        sec = cfg.security
        self.security = NodeSecurity.load(
            sec.enabled, sec.key_dir, sec.node_name("main", 0), serves_clients=True
        )
        # main's side of the workers (and of the shadow): no connection yet, start() makes them
        self.experts = remote_experts(cfg, model_path, self.checkpoint, main, self.heartbeat, self.security)
        self.connect_s = 0.0  # connections + (CURVE) handshakes + pings (`start`), for the ready file
        # the homes' fit against the workers' rooms: checked at start when every worker is there, else
        # once a growing cluster's last worker has told its room (_check_grown_homes); its verdict
        self.homes_checked, self.homes_problem = False, ""
        self.shadow_joins: queue.Queue[tuple[str, str]] = queue.Queue()
        self.shadow_where = cfg.cluster.shadow_where  # a rejoining shadow says where it now runs
        self._next_key_check = 0.0  # when _drop_revoked_workers next reads the workers' keys
        # a random or speculative shadow is paced by main: it hears of every iteration
        pace = cfg.shadow.mode == "random" or cfg.alignment.mode == "speculative"
        self.requests = RequestQueue(cfg.server.max_waiting, cfg.server.request_timeout_s)
        self.metrics = ServerMetrics(self.requests)
        batching = Batching(
            max_running=cfg.server.max_running,
            kv_cache_bytes=parse_bytes(cfg.server.kv_cache_memory),
            chunk_tokens=cfg.prefill.chunk_tokens,
            stagger=cfg.prefill.stagger,
            batched_decode=cfg.server.decode == "batched",
        )
        self.engine = MainEngine(
            main,
            tokenizer,
            self.experts,
            lambda: make_plan(cfg.alignment),
            pace_shadow=pace,
            batching=batching,
            observer=self.metrics,
        )
        self.model_name = cfg.server.model_name or Path(model_path).name
        self.tokenizer = tokenizer
        self.stopped = threading.Event()
        self.engine_started = threading.Event()
        self.engine_failed: Exception | None = None

    @property
    def tokenizer_vocab_size(self) -> int:
        return self.engine.main.model.config.vocab_size

    @property
    def context_length(self) -> int:
        return self.engine.max_positions

    # -- the engine thread -------------------------------------------------------------------
    def run_engine(self, on_failure: Callable[[], None] = lambda: None) -> None:
        """The decode loop until main stops. An error it does not expect (a bug) ends it: its
        requests get an error (not a wait that never ends), and main stops with exit status 1, so
        clients fail over to a standby main and a supervisor sees it, instead of a main that looks
        healthy and queues requests for a loop that is gone."""
        self.engine_started.set()
        try:
            self.engine.serve(self.requests, self.stopped.is_set, between_ticks=self._maintain)
        except Exception as exc:
            log.exception("main's decode loop failed; main stops (this is a bug: please report it)")
            self.engine_failed = exc
            on_failure()

    # -- what both front doors call ----------------------------------------------------------
    def submit(self, request: GenerateRequest, timeout_s: float | None = None) -> Ticket:
        """Validate and queue a request (InvalidRequest / QueueFull at once)."""
        ids = self.engine.prompt_ids(request)
        try:
            return self.requests.submit(request, timeout_s, prompt_ids=ids)
        except QueueFull:
            self.metrics.ended(None, "rejected")
            raise

    def health(self) -> str | None:
        """None when main can serve a request now, else why not (the HTTP /health's 503)."""
        if self.engine_failed is not None:
            return f"main's decode loop failed: {self.engine_failed}"
        if self.stopped.is_set():
            return "main is shutting down"
        if not self.engine_started.is_set():
            return "main is starting"
        members = self.experts.members
        try:
            live = members.live
            missing = [layer for layer in members.layers if not members.topology.holders(layer, live)]
        except RuntimeError:  # the membership changed under us: it is being repaired
            return None
        return f"no live worker holds MoE layer {missing[0]}" if missing else None

    def _maintain(self) -> None:
        """Membership upkeep, on the engine thread (it owns every ZeroMQ socket)."""
        while not self.shadow_joins.empty():
            address, pub_address = self.shadow_joins.get()
            self._adopt_shadow(address, pub_address)
        if self.experts.shadow is not None:
            self.experts.shadow.up  # noqa: B018 - drains its connection's events: Info says where it is
        self._drop_revoked_workers()
        self.experts.members.maintain()
        self._check_grown_homes()

    def _drop_revoked_workers(self) -> None:
        """A live worker whose key was revoked (or replaced) since main connected to it is dropped as
        lost: its calls are re-sent to the others, tokens unchanged, and main's probes then never
        reach that key again (odmoe.transport.security: Curve.server_key). Checked once a second:
        a few file reads per worker."""
        curve = self.security.curve
        if curve is None or time.monotonic() < self._next_key_check:
            return
        self._next_key_check = time.monotonic() + KEY_CHECK_S
        members = self.experts.members
        for worker in sorted(members.live):
            if not curve.still_admitted(f"worker{worker}"):
                members.mark_lost(worker, "its key was revoked (odmoe-keys revoke)")

    def _beats(self) -> BeatWatch | None:
        """UDP beats to judge a peer by (odmoe/transport/beats.py; None: heartbeats alone)."""
        return BeatWatch(suspicion_settings(self.cfg)) if self.cfg.failover.beat_interval_s > 0 else None

    def _shadow_link(self, address: str, pub_address: str) -> ShadowLink:
        """Connections to the shadow at these addresses (its control and its predictions)."""
        layers, curve = self.checkpoint.moe_layers, self.security.curve
        return ShadowLink(address, pub_address, layers, self.heartbeat, curve, self._beats())

    def _adopt_shadow(self, address: str, pub_address: str) -> None:
        shadow = self.experts.shadow
        if shadow is None:
            shadow = self.experts.shadow = self._shadow_link(address, pub_address)
        elif (shadow.address, shadow.pub_address) != (address, pub_address) or not shadow.up:
            shadow.replace(address, pub_address)
        # briefly: requests wait meanwhile, and a shadow that is gone again only costs speed
        if shadow.wait_up(ADOPT_SHADOW_WAIT_S):
            log.info("shadow at %s is back: the next request uses it", address)
        self.experts.members.broadcast(shadow_pub=pub_address)

    # -- gRPC handlers -----------------------------------------------------------------------
    def Generate(self, request, context):
        req = GenerateRequest(
            prompt=request.prompt,
            token_ids=tuple(request.token_ids),
            max_new_tokens=request.max_new_tokens,
            return_logits=request.return_logits,
            resume_ids=tuple(request.resume_ids),
            sampling=_sampling(request.sampling) if request.HasField("sampling") else SamplingParams(),
            stop=tuple(request.stop),
            ignore_eos=request.ignore_eos,
            logprobs=request.logprobs if request.HasField("logprobs") else None,
            prompt_logprobs=request.prompt_logprobs,
            **({"request_id": request.request_id} if request.request_id else {}),
        )
        # the request's own timeout_s and the client's gRPC deadline, whichever is set and sooner
        limits = [t for t in (request.timeout_s, context.time_remaining()) if t]
        try:
            ticket = self.submit(req, min(limits) if limits else None)
        except (InvalidRequest, QueueFull, QueueClosed) as exc:
            context.abort(status_of(exc).grpc, message_of(exc))
        context.add_callback(ticket.cancel)
        while (event := self._next_reply(ticket, context)) is not END:
            if isinstance(event, Exception):  # the same table as the HTTP door's (odmoe.serving.error_status)
                context.abort(status_of(event).grpc, message_of(event))
            if isinstance(event, DoneEvent):
                logits = b"" if event.final_logits is None else event.final_logits.float().numpy().tobytes()
                done = odmoe_pb2.Done(stats_json=json.dumps(event.stats), final_logits=logits)
                yield odmoe_pb2.GenerateReply(done=done)
            elif isinstance(event, PromptEvent):
                tokens = [
                    odmoe_pb2.TokenLogprob(token_id=t, logprob=lp, top=_top(top))
                    for t, lp, top in zip(event.token_ids, event.logprobs, event.top, strict=True)
                ]
                yield odmoe_pb2.GenerateReply(prompt=odmoe_pb2.PromptLogprobs(tokens=tokens))
            else:
                piece = odmoe_pb2.TokenPiece(
                    token_id=event.token_id, text=event.text, logprob=event.logprob, top=_top(event.top)
                )
                yield odmoe_pb2.GenerateReply(token=piece)

    def _next_reply(self, ticket: Ticket, context):
        """The engine's next event for this request; UNAVAILABLE once main is shutting down (the
        engine will not answer any more, and a waiting handler thread would keep main alive)."""
        while (event := ticket.next(timeout=0.5)) is None:
            if self.stopped.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, "main is shutting down")
        return event

    def Info(self, request, context):
        members = self.experts.members
        shadow = self.experts.shadow
        info = {
            "moe_layers": self.checkpoint.moe_layers,
            "kernel": self.engine.main.kernel,
            "workers": [
                {
                    "index": i,
                    "address": members.addresses[i],
                    "live": i in members.live,
                    "layers": members.pongs[i].layers if i in members.pongs else self.checkpoint.moe_layers,
                }
                for i in range(self.cfg.cluster.workers)
            ],
            "live_workers": sorted(members.live),
            # the latest losses and returns (operators, and tests timing detection and rejoin)
            "membership_events": [asdict(e) for e in members.events[-20:]],
            "shadow": None if shadow is None else {"address": shadow.address, "up": shadow.control.connected},
            "placement": self._placement(),
            "homes_problem": self.homes_problem,  # a grown cluster whose homes do not fit ("": they do)
        }
        return odmoe_pb2.InfoReply(
            model_path=self.model_path,
            family=self.checkpoint.family.model_type,
            workers=self.cfg.cluster.workers,
            group_size=self.cfg.cluster.group_size,
            info_json=json.dumps(info),
        )

    def _placement(self) -> dict[str, str]:
        """Where each node runs, as its launcher named it (cluster.where; "" where none did): a
        worker's from its last Pong, so a worker that Ray restarted elsewhere shows its new place."""
        pongs = self.experts.members.pongs
        places = {"main": self.cfg.cluster.where}
        if self.cfg.shadow.enabled:
            places["shadow"] = self.shadow_where
        return places | {
            f"worker{i}": pongs[i].where if i in pongs else "" for i in range(self.cfg.cluster.workers)
        }

    def take_in(self, name: str, address: str, pub_address: str = "") -> None:
        """A node the join link admitted became ready while main serves (any thread): a worker is
        checked and taken in (a cluster growing, or a box restarted), a shadow used again."""
        if name == "shadow" and self.cfg.shadow.enabled:
            self.shadow_joins.put((address, pub_address))
        elif name.startswith("worker"):
            self.experts.members.join(int(name.removeprefix("worker")), address)

    def Join(self, request, context):
        if request.role == "worker":
            if not 0 <= request.index < self.cfg.cluster.workers:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"worker index {request.index} is outside 0..{self.cfg.cluster.workers - 1}",
                )
            self.experts.members.join(request.index, request.address)
            detail = f"worker {request.index} at {request.address} will be checked and taken back"
        elif request.role == "shadow":
            if not self.cfg.shadow.enabled:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this main runs with shadow.enabled=false")
            self.shadow_joins.put((request.address, request.pub_address))
            self.shadow_where = request.where
            detail = f"shadow at {request.address} will be used from the next request"
        else:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role {request.role!r} cannot join")
        log.info("join: %s", detail)
        return odmoe_pb2.JoinReply(detail=detail)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """The node's network start (the constructor only builds): connect to the workers and the
        shadow (with their UDP beats), wait for the shadow, ping every worker (or
        cluster.min_workers of them) and check the homes fit the workers' rooms. Raises
        WorkerUnavailable or MemoryPlanError naming what is wrong."""
        cfg, start = self.cfg, time.perf_counter()
        self.experts.members.connect(self._beats())
        if cfg.shadow.enabled and cfg.cluster.shadow_address:
            address, pub_address = cfg.cluster.shadow_address, cfg.cluster.shadow_pub_address
            self.experts.shadow = self._shadow_link(address, pub_address)
        shadow = self.experts.shadow
        if shadow is not None and not shadow.wait_up(cfg.worker.ready_timeout_s):
            why = f" (CURVE handshake failed: {shadow.control.refused})" if shadow.control.refused else ""
            log.warning("shadow %s is not reachable%s: requests run without it", shadow.address, why)
        pongs = self.experts.ping_all(cfg.worker.ready_timeout_s, cfg.cluster.min_workers)
        # the homes' fit is known once every worker has told its room (a cluster still growing: later)
        topology = self.experts.members.topology
        if len(pongs) == topology.workers:
            self.homes_checked = True
            if problem := _unfit(topology, pongs):
                raise MemoryPlanError(problem)
        self.connect_s = time.perf_counter() - start

    def _check_grown_homes(self) -> None:
        """A cluster that started below its size (cluster.min_workers): once its last worker has told
        its room, the homes' fit is checked as start() checks a full start. Serving by then, main
        cannot refuse to start: it says so once, in its log and in Info's `homes_problem` (the short
        worker serves on, loading again what its room cannot keep)."""
        members = self.experts.members
        if self.homes_checked or len(members.pongs) < members.topology.workers:
            return
        self.homes_checked = True
        if problem := _unfit(members.topology, [members.pongs[w] for w in range(members.topology.workers)]):
            self.homes_problem = problem
            log.error("the grown cluster's homes do not fit: %s", problem)

    def serve(self, ready_file: str | None = None) -> None:
        """Serve clients (gRPC, and HTTP with server.http) until SIGINT/SIGTERM; after start()."""
        server, health_servicer, address = grpc_door(self, self.cfg, self.security.server)
        http = http_door(self, self.cfg, self.security.server)
        done = threading.Event()
        engine = threading.Thread(target=self.run_engine, args=(done.set,), name="odmoe-engine", daemon=True)
        engine.start()
        server.start()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        http_address = http.url if http else ""
        announce_ready(
            ready_file, role="main", address=address, http_address=http_address, connect_s=self.connect_s
        )
        if http:
            log.info("OpenAI-compatible API on %s/v1 (model %r)", http.url, self.model_name)
        log.info(
            "main serving on %s (%d workers, group size %d)",
            address,
            self.cfg.cluster.workers,
            self.cfg.cluster.group_size,
        )
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        done.wait()
        log.info("main shutting down")
        health_servicer.enter_graceful_shutdown()
        self.stopped.set()
        self.requests.close(ShuttingDown("main is shutting down"))
        if http:
            http.stop()
        server.stop(grace=2).wait()
        self.experts.close()
        if self.experts.shadow is not None:
            self.experts.shadow.close()
        if self.engine_failed is not None:
            raise SystemExit(1)


def remote_experts(cfg: OdmoeConfig, model_path: str, checkpoint, main, heartbeat, security) -> RemoteExperts:
    """Main's side of the workers (and, once MainNode.start has connected it, of the shadow)."""
    members = Membership(
        cfg.cluster.worker_addresses,
        cfg.topology.for_model(checkpoint.moe_layers, checkpoint.num_experts),
        checkpoint.moe_layers,
        heartbeat,
        cfg.failover.probe_interval_s,
        security.curve,
        homes_by_room=cfg.cluster.homes == "room",
    )
    experts = RemoteExperts(
        members,
        checkpoint.num_experts,
        main.kernel,
        reply_timeout_s=cfg.worker.reply_timeout_s,
        prefill=cfg.prefill,
        tracer=Tracer("main", cfg.trace_dir),
        substituter=Substituter.build(cfg.miss, model_path, main.model, checkpoint.num_experts),
        stragglers=straggler_watch(cfg),
        late=late_calls(cfg),
        probe_every=cfg.failover.straggler_probe_every,
        move_horizon=cfg.failover.straggler_move_horizon,
        no_worker_grace_s=cfg.failover.no_worker_grace_s,
    )
    experts.observe.add(FaultInjection(FaultTrigger(fault_of(cfg), "main")))
    return experts


def grpc_door(node: MainNode, cfg: OdmoeConfig, secrets) -> tuple[grpc.Server, health.HealthServicer, str]:
    """The gRPC door, bound (not started): Inference and standard health checking; its address.
    `secrets`: the TLS material and bearer token (None: security.enabled=false)."""
    # the token first (a stranger learns nothing), then every request parsed by TextCheck: bad
    # UTF-8 in a string field answers INVALID_ARGUMENT naming it, not gRPC's bare INTERNAL
    interceptors: list[grpc.ServerInterceptor] = [BearerToken(secrets)] if secrets else []
    interceptors.append(TextCheck())
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        options=server_options(cfg.server.client_ping_s, cfg.server.client_ping_timeout_s),
        interceptors=interceptors,
    )
    odmoe_pb2_grpc.add_InferenceServicer_to_server(node, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    host, port = cfg.cluster.host, cfg.cluster.main_port
    try:
        if secrets:
            bound = server.add_secure_port(f"{host}:{port}", secrets.grpc_credentials())
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        raise PortInUse(f"main cannot bind {host}:{port}: {exc}") from exc
    if bound == 0:
        raise PortInUse(f"main cannot bind {host}:{port} (in use?)")
    return server, health_servicer, f"{host}:{bound}"


def http_door(node: MainNode, cfg: OdmoeConfig, secrets):
    """The OpenAI-compatible HTTP API, serving (None without server.http)."""
    if not cfg.server.http:
        return None
    host, port = cfg.server.http_host or cfg.cluster.host, cfg.server.http_port
    try:
        return start_http(
            node, host, port, secrets, cfg.server.client_ping_s, cfg.server.client_ping_timeout_s
        )
    except OSError as exc:
        raise PortInUse(
            f"main cannot serve HTTP on {host}:{port} ({exc}): set server.http_port "
            "(0: any free port) or server.http=false"
        ) from exc


def _unfit(topology, pongs: list) -> str:
    """What stops the homes fitting the rooms every worker told in its Pong (`unfit_homes`; "": they
    fit)."""
    return unfit_homes(topology, [p.cache_room for p in pongs], [p.strict_share for p in pongs])


def _top(top) -> list:
    return [odmoe_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top]


def _sampling(msg) -> SamplingParams:
    def opt(name):
        return getattr(msg, name) if msg.HasField(name) else None

    return SamplingParams(
        do_sample=msg.do_sample,
        temperature=opt("temperature"),
        top_p=opt("top_p"),
        top_k=opt("top_k"),
        min_p=opt("min_p"),
        repetition_penalty=opt("repetition_penalty"),
        seed=opt("seed"),
    )
