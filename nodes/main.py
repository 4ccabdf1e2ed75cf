"""The main node: the gRPC front door and the one thread that runs the decode loop.

Lifecycle: load the model without its experts, connect to every worker and check each answers as
the worker it is supposed to be, start the gRPC server (Inference + standard health checking),
announce readiness, serve until SIGINT/SIGTERM.

Requests are validated on the gRPC thread that receives them (bad input fails at once with
INVALID_ARGUMENT) and then queued; a single engine thread serves them in arrival order, because the
workers' device slots and the ZeroMQ sockets are shared by every request.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from odmoe.alignment import AlignmentSchedule
from odmoe.checkpoint import Checkpoint
from odmoe.config import OdmoeConfig
from odmoe.engine import DoneEvent, GenerateRequest, InvalidRequest, MainEngine
from odmoe.main_model import build_main_model, resolve_dtype
from odmoe.nodes.ready import announce_ready
from odmoe.remote_experts import RemoteExperts, WorkerFailed, WorkerUnavailable
from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.shadow_link import ShadowLink
from odmoe.trace import Tracer

log = logging.getLogger("odmoe.main")
_END = object()


class PortInUse(RuntimeError):
    pass


class MainNode(odmoe_pb2_grpc.InferenceServicer):
    def __init__(self, cfg: OdmoeConfig, model_path: str):
        self.cfg, self.model_path = cfg, model_path
        self.checkpoint = Checkpoint(model_path)
        main = build_main_model(self.checkpoint, resolve_dtype(cfg.model.dtype, self.checkpoint))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        shadow = None
        if cfg.shadow.enabled and cfg.cluster.shadow_address:
            shadow = ShadowLink(
                cfg.cluster.shadow_address, cfg.cluster.shadow_pub_address, self.checkpoint.moe_layers
            )
        self.experts = RemoteExperts(
            cfg.cluster.worker_addresses,
            cfg.topology,
            self.checkpoint.num_experts,
            main.kernel,
            reply_timeout_s=cfg.worker.reply_timeout_s,
            spread_prefill=not cfg.worker.only_own_layers,
            shadow=shadow,
            prefill=cfg.prefill,
            tracer=Tracer("main", cfg.trace_dir),
        )
        self.pongs = self.experts.ping_all(cfg.worker.ready_timeout_s, self.checkpoint.moe_layers)
        schedule = AlignmentSchedule(
            cfg.alignment.token_period, cfg.alignment.kv_period, cfg.alignment.prefill_kv
        )
        self.engine = MainEngine(
            main, tokenizer, self.experts, schedule, pace_shadow=cfg.shadow.mode == "random"
        )
        self.jobs: queue.Queue = queue.Queue()
        self.stopped = threading.Event()

    # -- the engine thread -------------------------------------------------------------------
    def run_engine(self) -> None:
        while not self.stopped.is_set():
            job = self.jobs.get()
            if job is _END:
                return
            request, replies, cancelled = job
            try:
                for event in self.engine.generate(request):
                    replies.put(event)
                    if cancelled.is_set():
                        break
            except Exception as exc:  # reported to that client; the engine serves the next request
                log.exception("request %s failed", request.request_id)
                replies.put(exc)
            replies.put(_END)

    # -- gRPC handlers -----------------------------------------------------------------------
    def Generate(self, request, context):
        req = GenerateRequest(
            prompt=request.prompt,
            token_ids=tuple(request.token_ids),
            max_new_tokens=request.max_new_tokens,
            return_logits=request.return_logits,
            **({"request_id": request.request_id} if request.request_id else {}),
        )
        try:
            self.engine.prompt_ids(req)
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        replies: queue.Queue = queue.Queue()
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        self.jobs.put((req, replies, cancelled))
        while (event := replies.get()) is not _END:
            if isinstance(event, WorkerUnavailable):
                context.abort(grpc.StatusCode.UNAVAILABLE, str(event))
            if isinstance(event, WorkerFailed):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(event))
            if isinstance(event, InvalidRequest):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(event))
            if isinstance(event, Exception):
                context.abort(grpc.StatusCode.INTERNAL, f"{type(event).__name__}: {event}")
            if isinstance(event, DoneEvent):
                logits = b"" if event.final_logits is None else event.final_logits.float().numpy().tobytes()
                done = odmoe_pb2.Done(stats_json=json.dumps(event.stats), final_logits=logits)
                yield odmoe_pb2.GenerateReply(done=done)
            else:
                yield odmoe_pb2.GenerateReply(
                    token=odmoe_pb2.TokenPiece(token_id=event.token_id, text=event.text)
                )

    def Info(self, request, context):
        info = {
            "moe_layers": self.checkpoint.moe_layers,
            "kernel": self.engine.main.kernel,
            "workers": [
                {"index": p.worker, "layers": p.layers, "store_bytes": p.store_bytes} for p in self.pongs
            ],
        }
        return odmoe_pb2.InfoReply(
            model_path=self.model_path,
            family=self.checkpoint.family.model_type,
            workers=self.cfg.cluster.workers,
            group_size=self.cfg.cluster.group_size,
            info_json=json.dumps(info),
        )

    # -- lifecycle ---------------------------------------------------------------------------
    def serve(self, ready_file: str | None = None) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        odmoe_pb2_grpc.add_InferenceServicer_to_server(self, server)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        host, port = self.cfg.cluster.host, self.cfg.cluster.main_port
        try:
            bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:
            raise PortInUse(f"main cannot bind {host}:{port}: {exc}") from exc
        if bound == 0:
            raise PortInUse(f"main cannot bind {host}:{port} (in use?)")
        engine = threading.Thread(target=self.run_engine, name="odmoe-engine", daemon=True)
        engine.start()
        server.start()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        address = f"{host}:{bound}"
        announce_ready(ready_file, role="main", address=address)
        log.info(
            "main serving on %s (%d workers, group size %d)",
            address,
            self.cfg.cluster.workers,
            self.cfg.cluster.group_size,
        )
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        done.wait()
        log.info("main shutting down")
        health_servicer.enter_graceful_shutdown()
        self.stopped.set()
        self.jobs.put(_END)
        server.stop(grace=2).wait()
        self.experts.close()
        if self.experts.shadow is not None:
            self.experts.shadow.close()
