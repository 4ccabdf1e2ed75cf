"""The worker node: serves expert computations over ZeroMQ.

Lifecycle: read this worker's experts from the checkpoint into host memory, bind a ROUTER socket,
announce readiness, then answer messages one at a time until told to shut down. For each compute
request it loads the expert into a device slot, runs the family's expert MLP on the rows main sent,
replies, and evicts: no expert stays on the device between requests (paper §3.1, no cache).

A failure inside one request (an expert it does not hold, a bad message) is answered with an error
result instead of killing the process, so main can report it with the worker named.
"""

from __future__ import annotations

import logging
import time

import torch
import zmq
from odmoe.nodes.ready import announce_ready

from odmoe.checkpoint import Checkpoint
from odmoe.codec import CodecError
from odmoe.config import OdmoeConfig
from odmoe.expert_math import expert_forward
from odmoe.expert_store import DeviceSlots, ExpertStore
from odmoe.main_model import resolve_dtype
from odmoe.memory import peak_rss_bytes
from odmoe.messages import ComputeExpert, ExpertResult, Ping, Pong, Shutdown, from_frames, to_frames

log = logging.getLogger("odmoe.worker")


def compute_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class WorkerNode:
    def __init__(self, cfg: OdmoeConfig, model_path: str):
        self.index = cfg.worker.index
        checkpoint = Checkpoint(model_path)
        self.hidden_act = checkpoint.config.hidden_act
        dtype = resolve_dtype(cfg.model.dtype, checkpoint)
        layers = checkpoint.moe_layers
        if cfg.worker.only_own_layers:
            layers = cfg.topology.layers_of_worker(self.index, layers)
        start = time.perf_counter()
        self.store = ExpertStore.from_checkpoint(checkpoint, layers, dtype)
        log.info(
            "worker %d: %d layers, %.1f MiB of experts in host memory (%.1fs)",
            self.index,
            len(layers),
            self.store.nbytes / 2**20,
            time.perf_counter() - start,
        )
        self.slots = DeviceSlots(self.store, compute_device(cfg.worker.device), cfg.worker.slots)
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = cfg.cluster.worker_port
        if port:
            self.sock.bind(f"tcp://{cfg.cluster.host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{cfg.cluster.host}")
        self.address = f"tcp://{cfg.cluster.host}:{port}"

    def serve(self, ready_file: str | None = None) -> None:
        announce_ready(ready_file, role="worker", index=self.index, address=self.address)
        log.info("worker %d serving on %s", self.index, self.address)
        try:
            while True:
                peer, *frames = self.sock.recv_multipart(copy=False)
                try:
                    message, tensors = from_frames(frames)
                except CodecError as exc:
                    log.warning("worker %d dropped a malformed message: %s", self.index, exc)
                    continue
                if isinstance(message, Shutdown):
                    log.info("worker %d shutting down", self.index)
                    return
                self.sock.send_multipart([peer, *self.handle(message, tensors)], copy=False)
        finally:
            self.sock.close(0)

    def handle(self, message, tensors: list[torch.Tensor]) -> list:
        if isinstance(message, Ping):
            return to_frames(Pong(self.index, self.store.layers, self.store.nbytes, peak_rss_bytes()))
        if isinstance(message, ComputeExpert):
            return self.compute(message, tensors[0])
        raise CodecError(f"worker cannot handle {message.kind}")

    def compute(self, request: ComputeExpert, hidden: torch.Tensor) -> list:
        key = (request.step.layer, request.expert)
        bytes_before, load_before = self.slots.counters.bytes_loaded, self.slots.counters.load_s
        try:
            slot = self.slots.load(key)
        except (KeyError, RuntimeError) as exc:
            return to_frames(self._result(request, 0.0, 0.0, 0, error=str(exc)), [hidden[:0]])
        try:
            start = time.perf_counter()
            x = hidden.to(self.slots.device)
            with torch.inference_mode():
                y = expert_forward(x, slot.gate_up, slot.down, self.hidden_act, request.kernel).cpu()
            compute_s = time.perf_counter() - start
        finally:
            self.slots.evict(slot)
        c = self.slots.counters
        result = self._result(request, c.load_s - load_before, compute_s, c.bytes_loaded - bytes_before)
        return to_frames(result, [y])

    def _result(self, request: ComputeExpert, load_s: float, compute_s: float, nbytes: int, error: str = ""):
        return ExpertResult(
            step=request.step,
            expert=request.expert,
            worker=self.index,
            load_s=load_s,
            compute_s=compute_s,
            bytes_loaded=nbytes,
            peak_rss=peak_rss_bytes(),
            error=error,
        )
