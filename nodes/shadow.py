"""The shadow node: a local copy of the model that runs ahead of main and publishes its routers'
choices as predictions (OD-MoE "scaled emulative prediction", paper §3.2).

Lifecycle: load the model at `shadow.precision`, bind a PULL socket (main's Begin/Align/End) and a
PUB socket (predictions), announce readiness, then serve requests one after another:
  1) Begin: prefill its own cache from the prompt (no predictions: prefill spreads every expert);
  2) each decode iteration n: wait for main's alignment when the schedule says so (the wait is the
     late departure), take main's token and/or overwrite its newest K/V rows with main's, run the
     forward pass; a hook on each MoE layer's router publishes (request, n, layer, experts) the moment
     the router has run, so later layers' predictions reach workers while main is still earlier;
  3) End (or a new Begin) stops it. A shadow that is wrong or late never changes main's output.

`shadow.mode=random` publishes uniformly random experts instead (ablation case 5) and loads no model.

Every control frame is untrusted: one that does not decode, a Begin whose prompt the model cannot
take, an Align whose K/V rows do not fit the cache - each is dropped (the request it belongs to is
abandoned) with a rate-limited log line, and the shadow serves the next Begin. With
`cluster.main_addresses` set it announces itself to main on start, so a restarted shadow is used
again. With security on (the default) both sockets are CURVE servers admitting only the cluster's
keys: no one else can send it control messages or read a prediction.
"""

from __future__ import annotations

import logging
import random
import time

import torch
import zmq
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from odmoe.alignment import AlignmentSchedule
from odmoe.announce import announce
from odmoe.codec import CodecError
from odmoe.config import OdmoeConfig
from odmoe.dropped import DropLog
from odmoe.families import family_of
from odmoe.faults import FaultTrigger
from odmoe.kv_rows import overwrite_newest_rows
from odmoe.main_model import experts_modules
from odmoe.messages import (
    Align,
    BeginRequest,
    EndRequest,
    Prediction,
    ShadowIteration,
    Step,
    from_frames,
    to_frames,
)
from odmoe.nodes.ready import announce_ready
from odmoe.placement import Topology
from odmoe.security import NodeSecurity, secure_server
from odmoe.shadow_model import choice_scores, load_shadow_model, model_bytes, router_modules
from odmoe.trace import Tracer, now_us

log = logging.getLogger("odmoe.shadow")


def topic(group: int) -> bytes:
    return f"g{group}".encode()


class Interrupted(Exception):
    """main ended this request, or began another, while the shadow was still on it."""


class ShadowNode:
    def __init__(self, cfg: OdmoeConfig, model_path: str):
        self.cfg, self.scfg = cfg, cfg.shadow
        self.topology = Topology(cfg.cluster.workers, cfg.cluster.group_size)
        self.schedule = AlignmentSchedule(
            cfg.alignment.token_period, cfg.alignment.kv_period, cfg.alignment.prefill_kv
        )
        config = AutoConfig.from_pretrained(model_path)
        self.vocab_size = int(config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.family = family_of(config)
        self.num_experts = int(getattr(config, self.family.num_experts_field))
        self.top_k = int(getattr(config, self.family.top_k_field))
        self.model = None
        if self.scfg.mode == "emulate":
            start = time.perf_counter()
            self.model = load_shadow_model(model_path, self.scfg.precision, self.scfg.device)
            self.weight_bytes = model_bytes(self.model)
            log.info(
                "shadow: %s copy, %.2f MiB of weights (%.1fs)",
                self.scfg.precision,
                self.weight_bytes / 2**20,
                time.perf_counter() - start,
            )
            self._hook_routers()
        else:
            self.weight_bytes = 0
        self.moe_layers = sorted(self._router_layers(config))
        self.ctx = zmq.Context.instance()
        sec = cfg.security
        self.security = NodeSecurity.load(sec.enabled, sec.key_dir, sec.node_name("shadow", 0))
        self.zap = self.security.curve.authenticator(self.ctx) if self.security.curve else None
        self.control = self.ctx.socket(zmq.PULL)
        self.pub = self.ctx.socket(zmq.PUB)
        for sock in (self.control, self.pub):
            sock.setsockopt(zmq.LINGER, 0)
            secure_server(sock, self.security.curve)  # predictions reach the cluster's own nodes only
        host, port = cfg.cluster.host, cfg.cluster.shadow_port
        if port:
            self.control.bind(f"tcp://{host}:{port}")
            self.pub.bind(f"tcp://{host}:{port + 1}")
            pub_port = port + 1
        else:
            port = self.control.bind_to_random_port(f"tcp://{host}")
            pub_port = self.pub.bind_to_random_port(f"tcp://{host}")
        self.address, self.pub_address = f"tcp://{host}:{port}", f"tcp://{host}:{pub_port}"
        self.rng = random.Random(self.scfg.seed)
        self.step = ("", 0)  # (request, iteration) the router hooks label predictions with
        self.tracer = Tracer("shadow", cfg.trace_dir)
        self._layer_since_us = 0.0  # when the current layer's computation began (timeline only)
        self.pending: list = []  # control messages read ahead while waiting
        self.main_addresses = cfg.cluster.main_addresses
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
        for layer, router in router_modules(self.model, self.num_experts):
            router.register_forward_hook(self._make_hook(layer))

    def _make_hook(self, layer: int):
        def hook(module, _inputs, output):
            request, iteration = self.step
            if iteration < 1:
                return  # prefill: nothing to predict
            self.fault.at(request, iteration, layer)
            scores = choice_scores(module, output[0][-1])  # the newest token's, [E]
            probs, candidates = scores.topk(min(self.top_k + 1, self.num_experts))
            experts = output[2][-1].tolist()
            self.publish(layer, iteration, request, experts, candidates.tolist(), probs.tolist())
            if self.tracer.enabled:
                now = now_us()
                self.tracer.span(
                    "shadow", f"L{layer}", self._layer_since_us, now, iteration=iteration, experts=experts
                )
                self._layer_since_us = now

        return hook

    def publish(
        self,
        layer: int,
        iteration: int,
        request: str,
        experts: list[int],
        candidates: list[int],
        probs: list[float],
    ) -> None:
        experts = self._inject(experts)
        message = Prediction(Step(request, iteration, layer), experts, candidates, probs)
        frames = to_frames(message)
        self.pub.send_multipart([topic(self.topology.group_of_layer(layer)), *frames])

    def _inject(self, experts: list[int]) -> list[int]:
        """Fault injection: replace each predicted expert, with probability inject_wrong, by a wrong one."""
        if self.scfg.inject_wrong <= 0:
            return experts
        out = list(experts)
        for i in range(len(out)):
            if self.rng.random() < self.scfg.inject_wrong:
                wrong = [e for e in range(self.num_experts) if e not in experts and e not in out]
                if wrong:
                    out[i] = self.rng.choice(wrong)
        return out

    # -- control -----------------------------------------------------------------------------
    def _next_control(self, block: bool):
        """The next control message (Begin / Align / End); frames that are not one are dropped."""
        if self.pending:
            return self.pending.pop(0)
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

    def _await_align(self, request: str, iteration: int) -> tuple[Align, list[torch.Tensor]]:
        while True:
            message, tensors = self._next_control(block=True)
            if isinstance(message, Align) and message.request == request:
                if message.iteration == iteration:
                    return message, tensors
                if message.iteration > iteration:  # main is ahead of us: keep it for later
                    self.pending.insert(0, (message, tensors))
                    raise Interrupted
                continue
            if isinstance(message, BeginRequest | EndRequest):
                self.pending.insert(0, (message, tensors))
                raise Interrupted

    def _check_interrupt(self, request: str) -> None:
        item = self._next_control(block=False)
        if item is None:
            return
        if isinstance(item[0], BeginRequest | EndRequest):
            self.pending.insert(0, item)
            raise Interrupted
        self.pending.append(item)  # an Align for a later iteration

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
            credentials=self.security.client,
        )
        log.info(
            "shadow (%s) serving: control %s, predictions %s", self.scfg.mode, self.address, self.pub_address
        )
        while True:
            message, _ = self._next_control(block=True)
            if isinstance(message, BeginRequest):
                try:
                    self._check_begin(message)
                    self.run_request(message)
                except Interrupted:
                    pass
                except Exception as exc:  # a bad Begin or Align: abandon that request, keep serving
                    self.dropped.drop(
                        f"request {message.request!r:.40} abandoned: {type(exc).__name__}: {exc}"
                    )
                self.step = ("", 0)
                self.tracer.flush()

    def _check_begin(self, begin: BeginRequest) -> None:
        ids = begin.prompt_ids
        if not ids or any(not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"prompt ids must be a non-empty list in [0, {self.vocab_size})")
        if begin.max_new_tokens < 1 or (
            self.max_positions and len(ids) + begin.max_new_tokens > self.max_positions
        ):
            raise ValueError(f"max_new_tokens={begin.max_new_tokens} does not fit the context")

    @torch.inference_mode()
    def run_request(self, begin: BeginRequest) -> None:
        request = begin.request
        if self.model is None:
            return self.run_random(begin)
        cache = DynamicCache(config=self.model.config)
        self.step = (request, 0)
        ids = torch.tensor([begin.prompt_ids], device=self.scfg.device)
        logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        own_token = int(logits[0, -1].argmax())
        forward_s = 0.0
        for iteration in range(1, begin.max_new_tokens):
            waited_us = now_us()
            token, main_started_us, received_us = own_token, 0.0, waited_us
            if self.schedule.waits(iteration):
                align, tensors = self._await_align(request, iteration)
                received_us, main_started_us = now_us(), align.sent_at_us
                if self.schedule.align_token(iteration) and align.token >= 0:
                    token = align.token
                if self.schedule.align_kv(iteration) and align.kv:
                    if len(tensors) != 2 or any(
                        t.dim() != 4 or t.shape[0] != len(cache.layers) for t in tensors
                    ):
                        raise ValueError("an Align's K/V rows do not fit the cache")
                    overwrite_newest_rows(cache, tensors[0], tensors[1])
            else:
                self._check_interrupt(request)
            self.step = (request, iteration)
            self._layer_since_us = start_us = now_us()
            # Late departure: how long after main began this iteration the shadow begins it.
            late_us = max(start_us - main_started_us, 0.0) if main_started_us else 0.0
            started = ShadowIteration(
                request,
                iteration,
                late_departure_s=late_us / 1e6,
                alignment_wait_s=(received_us - waited_us) / 1e6,
                previous_forward_s=forward_s,
            )
            self.pub.send_multipart([b"main", *to_frames(started)])
            self.tracer.span("shadow", "waiting for alignment", waited_us, received_us, iteration=iteration)
            if late_us:
                self.tracer.span(
                    "shadow", "late departure", start_us - late_us, start_us, iteration=iteration
                )
            start = time.perf_counter()
            logits = self.model(
                input_ids=torch.tensor([[token]], device=self.scfg.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits
            own_token = int(logits[0, -1].argmax())
            forward_s = time.perf_counter() - start

    def run_random(self, begin: BeginRequest) -> None:
        """Ablation case 5: no model, a random guess per layer, paced by main's iterations."""
        for iteration in range(1, begin.max_new_tokens):
            self._await_align(begin.request, iteration)
            for layer in self.moe_layers:
                experts = self.rng.sample(range(self.num_experts), self.top_k)
                self.publish(layer, iteration, begin.request, experts, experts, [0.0] * len(experts))
