"""The shadow node: a local copy of the model that runs ahead of main and publishes its routers'
choices as predictions (OD-MoE "scaled emulative prediction", paper §3.2).

Lifecycle: load the model at `shadow.precision`, bind a PULL socket (main's Begin/Align/End) and a
PUB socket (predictions), announce readiness, then serve requests one after another:
  1) Begin: prefill its own cache from the prompt (no predictions: prefill spreads every expert);
  2) each decode iteration n, `alignment.mode=wait` (the paper's): wait for main's alignment where
     main said it would send one (the wait is the late departure), take main's token and/or overwrite
     its newest K/V rows with main's, run the forward pass. `alignment.mode=speculative`: never wait
     for alignment; run on from its own token and let main's reports catch up (odmoe.speculation):
     a token that differs from what it fed rolls the cache back to that iteration, main's K/V rows
     overwrite its own in place; at most `alignment.max_ahead` iterations ahead of main.
     Either way a hook on each MoE layer's router publishes (request, n, layer, experts, hedges) the
     moment the router has run, so later layers' predictions reach workers while main is earlier;
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

from odmoe.alignment import make_plan
from odmoe.announce import announce
from odmoe.codec import CodecError
from odmoe.config import OdmoeConfig
from odmoe.device_slots import device_peak_bytes
from odmoe.dropped import DropLog
from odmoe.families import family_of
from odmoe.faults import FaultTrigger
from odmoe.hedging import GroupLimit, shadow_hedges
from odmoe.kv_rows import overwrite_newest_rows, overwrite_rows
from odmoe.main_model import experts_modules
from odmoe.messages import (
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
from odmoe.nodes.ready import announce_ready
from odmoe.placement import Topology
from odmoe.security import NodeSecurity, secure_server
from odmoe.shadow_model import (
    group_limit,
    load_shadow_model,
    mask_groups,
    model_bytes,
    router_modules,
    unmasked_choice_scores,
)
from odmoe.speculation import Speculation
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
        self.alignment = cfg.alignment
        self.first_wait = make_plan(cfg.alignment).next_after(0)  # main's plan says the same
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
        for layer, router in router_modules(self.model, self.num_experts):
            router.register_forward_hook(self._make_hook(layer, group_limit(router)))

    def _make_hook(self, layer: int, limit: GroupLimit | None):
        """The router hook that publishes layer `layer`'s prediction (`limit`: the router's expert
        groups, where it picks only from some: group hedges need them)."""

        def hook(module, _inputs, output):
            request, iteration = self.step
            if iteration < 1:
                return  # prefill: nothing to predict
            self.fault.at(request, iteration, layer)
            unmasked = unmasked_choice_scores(module, output[0][-1])  # the newest token's, [E]
            scores = mask_groups(unmasked, limit)  # what the router ranks by: its choice_scores
            probs, candidates = scores.topk(min(self.top_k + 1, self.num_experts))
            experts = output[2][-1].tolist()
            candidates, probs = candidates.tolist(), probs.tolist()
            margin = self.scfg.hedge_margin
            every = unmasked.tolist() if limit and margin > 0 else None  # group hedges rank groups by it
            hedges = shadow_hedges(candidates, probs, self.top_k, margin, every, limit)
            self.publish(layer, iteration, request, experts, candidates, probs, hedges)
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
        hedges: list[int] = (),
    ) -> None:
        experts = self._inject(experts)
        hedges = [h for h in hedges if h not in experts]
        message = Prediction(Step(request, iteration, layer), experts, candidates, probs, hedges)
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
            where=self.where,
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
            elif isinstance(message, EndRequest):  # after its request's last prediction, in order
                self.pub.send_multipart([b"main", *to_frames(ShadowEnded(message.request))])

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
        if self.alignment.mode == "speculative":
            return self.run_speculative(begin, cache, own_token)
        forward_s, next_wait = 0.0, self.first_wait
        for iteration in range(1, begin.max_new_tokens):
            waited_us = now_us()
            token, main_started_us, received_us = own_token, 0.0, waited_us
            if iteration == next_wait:
                align, tensors = self._await_align(request, iteration)
                received_us, main_started_us = now_us(), align.sent_at_us
                next_wait = align.next_align if align.next_align > iteration else 0
                if align.token >= 0:
                    token = align.token
                if align.kv:
                    self._check_rows(tensors, cache)
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
                device_peak_bytes=device_peak_bytes(self.scfg.device),
            )
            self.pub.send_multipart([b"main", *to_frames(started)])
            self.tracer.span("shadow", "waiting for alignment", waited_us, received_us, iteration=iteration)
            if late_us:
                self.tracer.span(
                    "shadow", "late departure", start_us - late_us, start_us, iteration=iteration
                )
            start = time.perf_counter()
            own_token = self._forward(token, cache)
            forward_s = time.perf_counter() - start

    def run_speculative(self, begin: BeginRequest, cache: DynamicCache, own_token: int) -> None:
        """Never wait for alignment: run from own tokens, roll back where main's token differs."""
        request = begin.request
        spec = Speculation(len(begin.prompt_ids), self.alignment.max_ahead)
        rows: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # main's K/V rows not yet placed
        forward_s = 0.0
        while spec.next_iteration < begin.max_new_tokens:
            waited_us = now_us()
            self._take_alignments(request, spec, cache, rows, block=False)
            while not spec.may_run():  # far enough ahead: wait for main to report progress
                self._take_alignments(request, spec, cache, rows, block=True)
            received_us = now_us()
            token = spec.token_for(own_token)
            iteration = spec.next_iteration
            self.step = (request, iteration)
            self._layer_since_us = now_us()
            started = ShadowIteration(
                request,
                iteration,
                late_departure_s=0.0,
                alignment_wait_s=(received_us - waited_us) / 1e6,
                previous_forward_s=forward_s,
                ahead=spec.ahead,
                rollbacks=spec.rollbacks,
                device_peak_bytes=device_peak_bytes(self.scfg.device),
            )
            self.pub.send_multipart([b"main", *to_frames(started)])
            if received_us - waited_us > 50:
                self.tracer.span("shadow", "ahead: waiting", waited_us, received_us, iteration=iteration)
            start = time.perf_counter()
            own_token = self._forward(token, cache)
            forward_s = time.perf_counter() - start
            spec.ran(token)
            self._place_rows(cache, rows)

    def _take_alignments(self, request: str, spec: Speculation, cache: DynamicCache, rows: list, block: bool):
        """Read main's reports (waiting for one when `block`): note its tokens, roll back on a
        mismatch, keep its K/V rows until the cache has their positions."""
        item = self._next_control(block)
        while item is not None:
            message, tensors = item
            if isinstance(message, BeginRequest | EndRequest):
                self.pending.insert(0, item)
                raise Interrupted
            if isinstance(message, Align) and message.request == request:
                if message.kv:
                    self._check_rows(tensors, cache)
                    start, end = spec.rows_span(message.iteration, tensors[0].shape[2])
                    if start < 0:
                        raise ValueError(f"an Align's {end - start} K/V rows do not fit its iteration")
                    rows.append((start, end, tensors[0], tensors[1]))
                back = spec.on_main(message.iteration, message.token)
                if back is not None:
                    cache.crop(spec.keep_length(back) - cache.get_seq_length())
                    spec.roll_back(back)
                    log.debug("request %s: main's token differs at iteration %d: rolled back", request, back)
            item = self._next_control(False)
        self._place_rows(cache, rows)

    @staticmethod
    def _place_rows(cache: DynamicCache, rows: list) -> None:
        """Overwrite the shadow's K/V rows with main's wherever the cache already has them."""
        length = cache.get_seq_length()
        for item in [r for r in rows if r[1] <= length]:
            overwrite_rows(cache, item[0], item[2], item[3])
            rows.remove(item)

    def _check_rows(self, tensors: list[torch.Tensor], cache: DynamicCache) -> None:
        if len(tensors) != 2 or any(t.dim() != 4 or t.shape[0] != len(cache.layers) for t in tensors):
            raise ValueError("an Align's K/V rows do not fit the cache")

    def _forward(self, token: int, cache: DynamicCache) -> int:
        """One decode step of the shadow's copy (its routers' hooks publish); its own next token."""
        logits = self.model(
            input_ids=torch.tensor([[token]], device=self.scfg.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits
        token = int(logits[0, -1].argmax())
        if self.scfg.inject_wrong_token > 0 and self.rng.random() < self.scfg.inject_wrong_token:
            token = (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size  # any other
        return token

    def run_random(self, begin: BeginRequest) -> None:
        """Ablation case 5: no model, a random guess per layer, paced by main's iterations."""
        for iteration in range(1, begin.max_new_tokens):
            self._await_align(begin.request, iteration)
            for layer in self.moe_layers:
                experts = self.rng.sample(range(self.num_experts), self.top_k)
                self.publish(layer, iteration, begin.request, experts, experts, [0.0] * len(experts))
