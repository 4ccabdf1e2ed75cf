"""The shadow node: a local copy of the model that runs ahead of main and publishes its routers'
choices as predictions (OD-MoE "scaled emulative prediction", paper §3.2).

Lifecycle: load the model at `shadow.precision` and build the predictor (the constructor); bind a
PULL socket (main's Begin/Align/End) and a PUB socket (predictions) (`start`); announce readiness,
then serve every request main runs (`serve`, several at once when main batches them,
`odmoe.main.engine`).

The node is the socket loop; what the shadow predicts, and how it aligns with main (wait for main's
tokens and K/V rows, or speculate and roll back), is odmoe.shadow.predictor's `ShadowPredictor`,
which takes each decoded control message and says what to publish through one callback, with no
socket of its own. The node reads main's messages, hands them over, steps the predictor whenever a
request may run, and publishes: a prediction on its layer's group topic (as main and the workers
place it), the ShadowIteration / ShadowEnded reports on main's. `shadow.mode=random` publishes
uniformly random experts instead (ablation case 5) and loads no model. The test and benchmark knobs
(the lab overlay's `emulation.inject_wrong*` and fault injection at a router, with `lab=on`) alter
the predictor's output in one place, `ShadowLab`.

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

import torch
import zmq
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM

from odmoe.config import OdmoeConfig, emulation_of, fault_of
from odmoe.main.alignment import make_plan
from odmoe.models.families import family_of
from odmoe.models.main_model import experts_modules
from odmoe.models.open_model import load_config
from odmoe.nodes.ready import announce_ready
from odmoe.placement import Topology
from odmoe.shadow.made_wrong import MadeWrong
from odmoe.shadow.predictor import PredictorSetup, ShadowPredictor
from odmoe.shadow.shadow_model import load_shadow_model, model_bytes, resolve_precision, router_modules
from odmoe.tools.faults import FaultTrigger
from odmoe.tools.trace import Tracer, now_us
from odmoe.transport.announce import announce
from odmoe.transport.beats import echo_for
from odmoe.transport.codec import CodecError
from odmoe.transport.dropped import DropLog
from odmoe.transport.messages import Align, BeginRequest, EndRequest, Prediction, from_frames, to_frames
from odmoe.transport.security import NodeSecurity, secure_server
from odmoe.worker.device_slots import device_peak_bytes

log = logging.getLogger("odmoe.shadow")
LINGER_MS = 1  # how long a batched step waits for main's next report while other rows lag


def topic(group: int) -> bytes:
    return f"g{group}".encode()


class ShadowLab:
    """The test and benchmark knobs (never product settings), applied to the predictor's output in
    one place (odmoe.shadow.predictor `Knobs`): fault injection at each router's choice
    (`fault.node=shadow`), then the predicted experts and the shadow's own next tokens made wrong
    (`emulation.inject_wrong*`, odmoe.shadow.made_wrong). Off, both leave everything as computed."""

    def __init__(self, made_wrong: MadeWrong, fault: FaultTrigger):
        self.made_wrong, self.fault = made_wrong, fault

    def choice(self, request: str, iteration: int, layer: int, experts: list[int]) -> list[int]:
        self.fault.at(request, iteration, layer)
        return self.made_wrong.experts(experts)

    def own_token(self, token: int) -> int:
        return self.made_wrong.token(token)


def load_model(cfg: OdmoeConfig, model_path: str):
    """The shadow's copy (None in random mode), its precision and its weights' bytes."""
    scfg = cfg.shadow
    if scfg.mode != "emulate":
        return None, "", 0
    start = time.perf_counter()
    # auto: int8_dynamic or int4 (CUDA: int8 or nf4), by what fits this node's memory
    precision = resolve_precision(model_path, scfg.precision, scfg.device, cfg.node.memory)
    model = load_shadow_model(model_path, precision, scfg.device)
    weight_bytes = model_bytes(model)
    log.info(
        "shadow: %s copy, %.2f MiB of weights (%.1fs)",
        precision,
        weight_bytes / 2**20,
        time.perf_counter() - start,
    )
    return model, precision, weight_bytes


def moe_layers(model, config, num_experts: int) -> list[int]:
    """The layers with routed experts: the loaded copy's routers, or (random mode) a skeleton's."""
    if model is not None:
        return sorted(layer for layer, _ in router_modules(model, num_experts))
    with init_empty_weights():
        skeleton = AutoModelForCausalLM.from_config(config)
    return sorted(layer for layer, _ in experts_modules(skeleton))


class ShadowNode:
    """The socket loop around a `ShadowPredictor`: binds, admits main's key, reads main's control
    messages, steps the predictor, publishes what it says."""

    def __init__(self, cfg: OdmoeConfig, model_path: str):
        self.cfg = cfg
        config = load_config(model_path)  # a wrapper's text model; a GGUF file's as odmoe reads it
        family = family_of(config)
        num_experts = int(getattr(config, family.num_experts_field))
        model, self.precision, self.weight_bytes = load_model(cfg, model_path)
        layers = moe_layers(model, config, num_experts)
        # the topic of a layer's predictions is its group, as main and the workers place it
        self.topology = Topology(cfg.cluster.workers, cfg.cluster.group_size).for_model(layers)
        setup = PredictorSetup(
            device=cfg.shadow.device,
            num_experts=num_experts,
            top_k=int(getattr(config, family.top_k_field)),
            vocab_size=int(config.vocab_size),
            max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
            moe_layers=tuple(layers),
            hedge_margin=cfg.shadow.hedge_margin,
            speculative=cfg.alignment.mode == "speculative",
            max_ahead=cfg.alignment.max_ahead,
            first_wait=make_plan(cfg.alignment).next_after(0),  # main's plan says the same
        )
        rng = random.Random(cfg.shadow.seed)  # random mode's experts, emulation.inject_wrong*
        lab = ShadowLab(
            MadeWrong(emulation_of(cfg), num_experts, setup.vocab_size, rng),
            FaultTrigger(fault_of(cfg), "shadow"),
        )
        self.tracer = Tracer("shadow", cfg.trace_dir)
        self.dropped = DropLog(log, "shadow")
        self.predictor = ShadowPredictor(
            model,
            setup,
            self._send,
            rng=rng,
            knobs=lab,
            tracer=self.tracer,
            clock=now_us,
            device_peak=lambda: device_peak_bytes(cfg.shadow.device),
            dropped=self.dropped,
        )
        sec = cfg.security
        self.security = NodeSecurity.load(sec.enabled, sec.key_dir, sec.node_name("shadow", 0))
        self.control: zmq.Socket | None = None  # bound by start()
        self.pub: zmq.Socket | None = None
        self.address = self.pub_address = ""
        self.zap = self.beat_echo = None

    def start(self) -> None:
        """Bind the control (PULL) and prediction (PUB) sockets, CURVE servers where security is on
        (control: main's key only; predictions: main's and the workers', odmoe.transport.security),
        and echo main's UDP beats on the control port's number."""
        ctx = zmq.Context.instance()
        self.zap = self.security.curve.authenticator(ctx) if self.security.curve else None
        self.control, self.pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
        for sock, socket in ((self.control, "shadow-control"), (self.pub, "shadow-predictions")):
            sock.setsockopt(zmq.LINGER, 0)
            secure_server(sock, self.security.curve, socket)
        host, port = self.cfg.cluster.host, self.cfg.cluster.shadow_port
        if port:
            self.control.bind(f"tcp://{host}:{port}")
            self.pub.bind(f"tcp://{host}:{port + 1}")
            pub_port = port + 1
        else:
            port = self.control.bind_to_random_port(f"tcp://{host}")
            pub_port = self.pub.bind_to_random_port(f"tcp://{host}")
        self.address, self.pub_address = f"tcp://{host}:{port}", f"tcp://{host}:{pub_port}"
        self.beat_echo = echo_for(self.address)  # main's beats: UDP, the control port's number

    def _send(self, message) -> None:
        """Publish what the predictor says: a prediction on its layer's group topic, the rest to main."""
        if isinstance(message, Prediction):
            to = topic(self.topology.group_of_layer(message.step.layer))
        else:  # ShadowIteration, ShadowEnded
            to = b"main"
        self.pub.send_multipart([to, *to_frames(message)])

    # -- the loop ----------------------------------------------------------------------------
    def serve(self, ready_file: str | None = None) -> None:
        if self.control is None:
            self.start()
        c = self.cfg.cluster
        announce_ready(
            ready_file,
            role="shadow",
            address=self.address,
            pub_address=self.pub_address,
            weight_bytes=self.weight_bytes,
        )
        announce(
            c.main_addresses,
            "shadow",
            self.address,
            pub_address=self.pub_address,
            where=c.where,
            credentials=self.security.client,
        )
        log.info(
            "shadow (%s) serving: control %s, predictions %s",
            self.cfg.shadow.mode,
            self.address,
            self.pub_address,
        )
        with torch.inference_mode():  # every cache is made, cropped and overwritten under it
            while True:
                self._take_control(block=not self.predictor.runnable())
                runnable = self._gather()
                if not runnable:
                    self.tracer.flush()
                    continue
                self.predictor.step(runnable)

    def _gather(self) -> list:
        """The requests that can run now. Batched, a step costs the same for one row as for all, and
        main reports every request's iteration at once at the end of its own: so while some rows
        still wait for main, wait a little (LINGER_MS, only while reports keep coming) for theirs."""
        runnable = self.predictor.runnable()
        if not runnable or not runnable[0].batched:
            return runnable
        while len(runnable) < self.predictor.unfinished() and self.control.poll(LINGER_MS):
            self._take_control(block=False)
            runnable = self.predictor.runnable()
        return runnable

    def _take_control(self, block: bool) -> None:
        """Read main's messages (waiting for one when `block`) and hand each to the predictor."""
        item = self._next_control(block)
        while item is not None:
            self.predictor.control(*item)
            item = self._next_control(False)

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
