"""Main's side of the data plane: send a layer's expert rows to workers, gather, combine.

Contract: `RemoteExperts.__call__(layer, hidden[T, H], top_k_index[T, k], top_k_weights[T, k])`
returns exactly what transformers' experts module would have returned, computed by the workers.
It is attached to the main model (main_model.MainModel.attach) and called once per MoE layer of
every forward pass; `begin(request, iteration)` labels the calls that follow.

Failure policy: a worker that does not answer within `reply_timeout_s`, or answers with an error,
raises `WorkerUnavailable` naming it. Nothing is retried here yet; a later failover step can
re-place the expert on another worker because every request is self-contained (rows + names).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import zmq

from odmoe.config import PrefillConfig
from odmoe.expert_math import combine, split_by_expert
from odmoe.messages import (
    ComputeExpert,
    ExpertResult,
    Ping,
    Pong,
    Release,
    Shutdown,
    Step,
    from_frames,
    to_frames,
)
from odmoe.placement import Topology
from odmoe.recall import RecallCounter
from odmoe.shadow_link import ShadowLink
from odmoe.trace import Tracer, now_us


class WorkerUnavailable(RuntimeError):
    """A worker did not answer in time (dead, unreachable or overloaded)."""


class WorkerFailed(RuntimeError):
    """A worker answered but could not compute what it was asked (e.g. it lacks that expert)."""


@dataclass
class ExpertTraffic:
    """What the workers did for one request (summed over layers and iterations)."""

    experts_loaded: int = 0
    bytes_loaded: int = 0
    load_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0  # main blocked on workers (transfer + load + compute as seen by main)
    worker_peak_rss: dict[int, int] = field(default_factory=dict)
    preloaded: int = 0  # decode experts the shadow's prediction had already loaded
    reloads: int = 0  # decode experts loaded only after main asked (misses)
    # decode: per layer, summed over iterations, the longest any worker made main wait for a load
    stall_s_per_layer: dict[int, float] = field(default_factory=dict)
    # Predictions as they stood when main needed them (late = missing): what the workers could use.
    timely_recall: RecallCounter = field(default_factory=RecallCounter)
    activated: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (iteration, layer) -> experts

    # decode iterations only: what the pipeline model needs (main's own time = decode time - wait)
    decode: dict = field(
        default_factory=lambda: {
            "wait_s": 0.0,
            "layers": 0,
            "experts": 0,
            "compute_s": 0.0,
            "loads": 0,
            "load_s": 0.0,
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
        self.experts_loaded += result.part == 0
        self.bytes_loaded += result.bytes_loaded
        self.load_s += result.load_s
        self.compute_s += result.compute_s
        self.worker_peak_rss[result.worker] = max(self.worker_peak_rss.get(result.worker, 0), result.peak_rss)


class RemoteExperts:
    def __init__(
        self,
        addresses: list[str],
        topology: Topology,
        num_experts: int,
        kernel: str,
        reply_timeout_s: float = 60.0,
        spread_prefill: bool = True,
        shadow: ShadowLink | None = None,
        prefill: PrefillConfig | None = None,
        tracer: Tracer | None = None,
    ):
        if len(addresses) != topology.workers:
            raise ValueError(f"{len(addresses)} worker addresses for {topology.workers} workers")
        self.topology, self.num_experts, self.kernel = topology, num_experts, kernel
        # Spreading prefill over every worker needs every worker to hold every layer.
        self.spread_prefill = spread_prefill
        self.shadow = shadow
        self.emulated_links: dict[int, list[float]] = {}  # worker -> [Gbit/s, ms], from its pong
        self.prefill = prefill or PrefillConfig()
        self.timeout_ms = int(reply_timeout_s * 1000)
        self.ctx = zmq.Context.instance()
        self.addresses = addresses
        self.sockets = [self._connect(a) for a in addresses]
        self.poller = zmq.Poller()
        for s in self.sockets:
            self.poller.register(s, zmq.POLLIN)
        self.request, self.iteration = "", 0
        self.traffic = ExpertTraffic()
        self.device_bytes: dict[int, int] = {}  # worker -> bytes its experts take on its device
        self.tracer = tracer or Tracer("main")
        self._main_since_us = 0.0  # when main last got its rows back (its own work runs from there)

    def _connect(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    def begin(self, request: str, iteration: int) -> None:
        now = now_us()
        if self.tracer.enabled and request == self.request and self._main_since_us:
            self.tracer.span(
                "main", "lm_head, next token", self._main_since_us, now, iteration=self.iteration
            )
        self.request, self.iteration = request, iteration
        self._main_since_us = now

    def __call__(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        step = Step(self.request, self.iteration, layer)
        entered_us = 0.0
        if self.tracer.enabled:
            entered_us = now_us()
            self.tracer.span("main", f"L{layer}", self._main_since_us, entered_us, iteration=self.iteration)
        groups = split_by_expert(top_k_index, self.num_experts, self.kernel)
        experts = [rows.expert for rows in groups]
        decode = self.iteration >= 1
        if decode:
            prediction = self.shadow.prediction(step) if self.shadow is not None else None
            predicted = prediction.experts if prediction is not None else None
            self.traffic.timely_recall.add(self.iteration, layer, predicted, experts)
            self.traffic.activated[(self.iteration, layer)] = experts
            placement = self.topology.repair_placement(layer, predicted or [], experts)
        elif hidden.shape[0] > 1 and self.spread_prefill:
            counts = {rows.expert: len(rows.token_idx) for rows in groups}
            placement = self.topology.prefill_placement(counts, self.prefill.placement)
        else:
            placement = self.topology.decode_placement(layer, experts)
        start = time.perf_counter()
        expected = 0
        for rows in groups:
            expected += self._send_rows(step, rows.expert, hidden[rows.token_idx], placement[rows.expert])
        outputs = self._gather(step, placement, expected)
        waited = time.perf_counter() - start
        self.traffic.wait_s += waited
        if self.tracer.enabled:
            self._main_since_us = now_us()
            self.tracer.span(
                "main", f"wait L{layer}", entered_us, self._main_since_us, iteration=self.iteration
            )
        if decode:
            self.traffic.decode["wait_s"] += waited
            self.traffic.decode["layers"] += 1
            # whatever the group preloaded for this layer and did not use is now stale
            for worker in self.topology.workers_of_group(self.topology.group_of_layer(layer)):
                self.sockets[worker].send_multipart(to_frames(Release(step)))
        else:
            self.traffic.note_prefill_layer(layer, waited, len(groups))
        return combine(hidden, [(rows, outputs[rows.expert]) for rows in groups], top_k_weights, self.kernel)

    def _send_rows(self, step: Step, expert: int, x: torch.Tensor, worker: int) -> int:
        """Send one expert's rows, in prefill mini-batches when configured; returns replies to expect."""
        size = self.prefill.mini_batch if step.iteration == 0 and self.prefill.mini_batch > 0 else x.shape[0]
        chunks = torch.split(x, max(size, 1))
        per_part = self.prefill.compute_per_mini_batch and len(chunks) > 1
        for part, chunk in enumerate(chunks):
            message = ComputeExpert(
                step=step, expert=expert, kernel=self.kernel, part=part, parts=len(chunks), per_part=per_part
            )
            self.sockets[worker].send_multipart(to_frames(message, [chunk]), copy=False)
        self.tracer.message("main", "compute", step, expert, sent=True)
        return len(chunks) if per_part else 1

    def _gather(self, step: Step, placement: dict[int, int], expected: int) -> dict[int, torch.Tensor]:
        parts: dict[int, dict[int, torch.Tensor]] = {}
        received = 0
        layer_stall = 0.0  # workers load in parallel: the slowest wait is what main waited for
        deadline = time.monotonic() + self.timeout_ms / 1000
        while received < expected:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            ready = dict(self.poller.poll(max(remaining_ms, 0))) if remaining_ms > 0 else {}
            if not ready:
                waiting = sorted({placement[e] for e in placement if e not in parts})
                raise WorkerUnavailable(
                    f"no answer from worker(s) {waiting} ({', '.join(self.addresses[w] for w in waiting)}) "
                    f"for layer {step.layer} within {self.timeout_ms / 1000:.0f}s"
                )
            for sock in ready:
                result, tensors = from_frames(sock.recv_multipart(copy=False))
                if not isinstance(result, ExpertResult) or result.step != step:
                    continue  # a late answer to an earlier, abandoned step
                if result.error:
                    raise WorkerFailed(f"worker {result.worker} failed on layer {step.layer}: {result.error}")
                self.tracer.message("main", "result", step, result.expert, sent=False)
                self.traffic.add(result)
                if step.iteration >= 1:
                    self.traffic.preloaded += result.preloaded
                    self.traffic.reloads += not result.preloaded
                    layer_stall = max(layer_stall, result.waited_s)
                parts.setdefault(result.expert, {})[result.part] = tensors[0]
                received += 1
        if step.iteration >= 1:
            stall = self.traffic.stall_s_per_layer
            stall[step.layer] = stall.get(step.layer, 0.0) + layer_stall
        return {e: torch.cat([p[i] for i in sorted(p)]) if len(p) > 1 else p[0] for e, p in parts.items()}

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

    def ping_all(self, timeout_s: float, layers: list[int]) -> list[Pong]:
        """Check every worker is up, is the worker its address says, and holds what it will be asked.

        Raises WorkerUnavailable naming the workers that stay silent or are misconfigured.
        """
        shadow_pub = self.shadow.pub_address if self.shadow is not None else ""
        for sock in self.sockets:
            sock.send_multipart(to_frames(Ping(shadow_pub=shadow_pub)))
        pongs: dict[int, Pong] = {}
        deadline = time.monotonic() + timeout_s
        while len(pongs) < len(self.sockets):
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            ready = dict(self.poller.poll(remaining_ms)) if remaining_ms > 0 else {}
            if not ready:
                silent = [i for i in range(len(self.sockets)) if i not in pongs]
                raise WorkerUnavailable(f"worker(s) {silent} did not answer a ping within {timeout_s:.0f}s")
            for sock in ready:
                message, _ = from_frames(sock.recv_multipart(copy=False))
                if isinstance(message, Pong):
                    pongs[self.sockets.index(sock)] = message
        for i, pong in sorted(pongs.items()):
            if pong.worker != i:
                raise WorkerUnavailable(
                    f"{self.addresses[i]} answers as worker {pong.worker}, expected worker {i}"
                )
            needed = layers if self.spread_prefill else self.topology.layers_of_worker(i, layers)
            if missing := sorted(set(needed) - set(pong.layers)):
                raise WorkerUnavailable(f"worker {i} does not hold layers {missing}")
        self.emulated_links = {i: p.link for i, p in pongs.items() if p.link}
        self.device_bytes = {i: p.device_bytes for i, p in pongs.items()}
        return [pongs[i] for i in range(len(self.sockets))]

    def shutdown_workers(self) -> None:
        for sock in self.sockets:
            sock.send_multipart(to_frames(Shutdown()))

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)
