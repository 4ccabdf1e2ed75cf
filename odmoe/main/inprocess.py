"""Workers inside main's own process: the real data path with no sockets (tests, tools).

Contract: `InProcessWorkers(checkpoint, topology, dtype)` stands where main's `Membership` stands:
`send(worker, frames)` decodes a message exactly as a worker node receives it and hands it to that
worker's `ExpertExecutor` (odmoe.worker.executor: the worker node's own expert code, cacheless, with
its device slots on the CPU), queueing the answer a worker node would send; `wait()` hands the
answers back. So `RemoteExperts`, the engine's batching, the codec and the workers' checks, loads and
expert math run as they do in a cluster, in one process, in milliseconds: what `engine_in_process`
builds, checked against transformers. What it leaves out is what has its own tests with real
processes: sockets, the shadow's predictions and preloads, failures.
"""

from __future__ import annotations

import time

import torch

from odmoe.main.engine import Batching, MainEngine
from odmoe.main.remote_experts import RemoteExperts
from odmoe.models.checkpoint import Checkpoint
from odmoe.models.expert_math import expert_mlp
from odmoe.models.load_dtypes import expert_dtype
from odmoe.models.main_model import build_main_model
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.placement import Topology
from odmoe.tools.trace import Tracer
from odmoe.transport.messages import (
    ComputeExperts,
    EndRequest,
    LiveWorkers,
    Release,
    from_frames,
)
from odmoe.worker.executor import ExpertExecutor, SlotKeeper
from odmoe.worker.expert_cache import CacheBook
from odmoe.worker.expert_store import DeviceSlots, ExpertStore


class InProcessWorkers:
    def __init__(self, checkpoint: Checkpoint, topology: Topology, dtype: torch.dtype):
        self.topology = topology
        # one store for all: each worker's slots copy its experts out of it, as a worker's do
        store = ExpertStore.build(checkpoint, checkpoint.moe_layers, expert_dtype(checkpoint.config, dtype))
        mlp = expert_mlp(checkpoint.config, checkpoint.family.expert_layout)
        layer_rank = {layer: i for i, layer in enumerate(checkpoint.moe_layers)}
        self.executors = [
            ExpertExecutor(
                SlotKeeper(
                    w,
                    topology,
                    store,
                    DeviceSlots(store, torch.device("cpu")),
                    CacheBook(0),  # cacheless (the paper's)
                    layer_rank,
                    Tracer(f"worker{w}"),
                ),
                mlp,
            )
            for w in range(topology.workers)
        ]
        self.live = frozenset(range(topology.workers))
        self.pongs: dict = {}
        self.events: list = []
        self.inbox: list[tuple[int, list]] = []
        self.messages = 0  # compute messages received
        self.decode_messages = 0  # of which decode's: one per worker and decode layer, batched

    def send(self, worker: int, frames: list, copy: bool = True) -> bool:
        executor = self.executors[worker]
        executor.received = time.perf_counter()
        message, tensors = from_frames([bytes(f) for f in frames])
        if isinstance(message, ComputeExperts):
            self.messages += 1
            self.decode_messages += message.step.iteration >= 1
        if isinstance(message, ComputeExperts | Release | EndRequest | LiveWorkers):
            answer = executor.answer(message, tensors)
            if answer is not None:  # a mini-batch that only completes a batch gets no answer
                self.inbox.append((worker, answer))
            if isinstance(message, ComputeExperts) and message.release:
                executor.release(message.step)
        return True

    def wait(self, timeout_ms: int):
        received, self.inbox = self.inbox, []
        return received, []

    def mark_lost(self, worker: int, reason: str) -> None:
        raise RuntimeError(f"in-process worker {worker} cannot be lost ({reason})")

    def close(self) -> None:
        pass


def engine_in_process(
    path: str,
    dtype: torch.dtype = torch.float32,
    workers: int = 2,
    group_size: int = 2,
    device: str = "cpu",
    **batching,
) -> tuple[MainEngine, InProcessWorkers]:
    """Main's engine over in-process workers: no shadow, no sockets, the real decode loop. `device`
    is main's (the workers compute on the CPU: the answers reach main as bytes, as over a socket)."""

    checkpoint = open_checkpoint(path)
    main = build_main_model(checkpoint, dtype, device)
    topology = Topology(workers, group_size).for_model(checkpoint.moe_layers)
    members = InProcessWorkers(checkpoint, topology, dtype)
    experts = RemoteExperts(members, checkpoint.num_experts, main.kernel)
    engine = MainEngine(main, load_tokenizer(path), experts, batching=Batching(**batching))
    return engine, members
