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
    stall_s_per_layer: dict[int, float] = field(
        default_factory=dict
    )  # decode: on-demand load time on the path
    # Predictions as they stood when main needed them (late = missing): what the workers could use.
    timely_recall: RecallCounter = field(default_factory=RecallCounter)
    activated: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (iteration, layer) -> experts

    def add(self, result: ExpertResult) -> None:
        self.experts_loaded += 1
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
    ):
        if len(addresses) != topology.workers:
            raise ValueError(f"{len(addresses)} worker addresses for {topology.workers} workers")
        self.topology, self.num_experts, self.kernel = topology, num_experts, kernel
        # Spreading prefill over every worker needs every worker to hold every layer.
        self.spread_prefill = spread_prefill
        self.shadow = shadow
        self.timeout_ms = int(reply_timeout_s * 1000)
        self.ctx = zmq.Context.instance()
        self.addresses = addresses
        self.sockets = [self._connect(a) for a in addresses]
        self.poller = zmq.Poller()
        for s in self.sockets:
            self.poller.register(s, zmq.POLLIN)
        self.request, self.iteration = "", 0
        self.traffic = ExpertTraffic()

    def _connect(self, address: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    def begin(self, request: str, iteration: int) -> None:
        self.request, self.iteration = request, iteration

    def __call__(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        step = Step(self.request, self.iteration, layer)
        groups = split_by_expert(top_k_index, self.num_experts)
        experts = [rows.expert for rows in groups]
        decode = self.iteration >= 1
        if decode:
            prediction = self.shadow.prediction(step) if self.shadow is not None else None
            predicted = prediction.experts if prediction is not None else None
            self.traffic.timely_recall.add(self.iteration, layer, predicted, experts)
            self.traffic.activated[(self.iteration, layer)] = experts
            placement = self.topology.repair_placement(layer, predicted or [], experts)
        elif hidden.shape[0] > 1 and self.spread_prefill:
            placement = self.topology.prefill_placement(experts)
        else:
            placement = self.topology.decode_placement(layer, experts)
        start = time.perf_counter()
        for rows in groups:
            message = ComputeExpert(step=step, expert=rows.expert, kernel=self.kernel)
            self.sockets[placement[rows.expert]].send_multipart(
                to_frames(message, [hidden[rows.token_idx]]), copy=False
            )
        outputs = self._gather(step, placement)
        self.traffic.wait_s += time.perf_counter() - start
        if decode:  # whatever the group preloaded for this layer and did not use is now stale
            for worker in self.topology.workers_of_group(self.topology.group_of_layer(layer)):
                self.sockets[worker].send_multipart(to_frames(Release(step)))
        return combine(hidden, [(rows, outputs[rows.expert]) for rows in groups], top_k_weights, self.kernel)

    def _gather(self, step: Step, placement: dict[int, int]) -> dict[int, torch.Tensor]:
        outputs: dict[int, torch.Tensor] = {}
        deadline = time.monotonic() + self.timeout_ms / 1000
        while len(outputs) < len(placement):
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            ready = dict(self.poller.poll(max(remaining_ms, 0))) if remaining_ms > 0 else {}
            if not ready:
                waiting = sorted({placement[e] for e in placement if e not in outputs})
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
                self.traffic.add(result)
                if step.iteration >= 1:
                    self.traffic.preloaded += result.preloaded
                    self.traffic.reloads += not result.preloaded
                    stall = self.traffic.stall_s_per_layer
                    stall[step.layer] = stall.get(step.layer, 0.0) + (
                        0.0 if result.preloaded else result.load_s
                    )
                outputs[result.expert] = tensors[0]
        return outputs

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
        return [pongs[i] for i in range(len(self.sockets))]

    def shutdown_workers(self) -> None:
        for sock in self.sockets:
            sock.send_multipart(to_frames(Shutdown()))

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)
