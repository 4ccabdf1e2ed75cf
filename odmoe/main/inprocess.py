"""Workers inside main's own process: the real data path with no sockets (tests, tools).

Contract: `InProcessWorkers(checkpoint, topology, dtype)` stands where main's `Membership` stands:
`send(worker, frames)` decodes a ComputeExpert / ComputeExperts exactly as a worker node receives it
and queues the answer a worker node would send (the experts computed by `expert_math.expert_forward`
from an `ExpertStore`, each request's segment apart), `wait()` hands the answers back. So
`RemoteExperts`, the engine's batching, the codec and the expert math run as they do in a cluster,
in one process, in milliseconds: what `engine_in_process` builds, checked against transformers.
What it leaves out is what has its own tests with real processes: sockets, loads and preloads,
failures, the shadow.
"""

from __future__ import annotations

import torch

from odmoe.main.engine import Batching, MainEngine
from odmoe.main.remote_experts import RemoteExperts
from odmoe.models.checkpoint import Checkpoint
from odmoe.models.expert_math import expert_forward, expert_mlp
from odmoe.models.load_dtypes import expert_dtype
from odmoe.models.main_model import build_main_model
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.placement import Topology
from odmoe.transport.messages import (
    ComputeExpert,
    ComputeExperts,
    ExpertResult,
    ExpertsResult,
    from_frames,
    to_frames,
)
from odmoe.worker.expert_store import ExpertStore


class InProcessWorkers:
    def __init__(self, checkpoint: Checkpoint, topology: Topology, dtype: torch.dtype):
        self.topology = topology
        experts = expert_dtype(checkpoint.config, dtype)
        self.store = ExpertStore.build(checkpoint, checkpoint.moe_layers, experts)
        self.mlp = expert_mlp(checkpoint.config, checkpoint.family.expert_layout)
        self.live = frozenset(range(topology.workers))
        self.pongs: dict = {}
        self.events: list = []
        self.inbox: list[tuple[int, list]] = []
        self.batches: dict[tuple, dict[int, tuple[torch.Tensor, list[int]]]] = {}
        self.messages = 0  # compute messages received
        self.decode_messages = 0  # of which ComputeExperts: one per worker and decode layer, batched

    def send(self, worker: int, frames: list, copy: bool = True) -> bool:
        message, tensors = from_frames([bytes(f) for f in frames])
        if isinstance(message, ComputeExperts):
            self.messages += 1
            self.decode_messages += 1
            self.inbox.append((worker, self._many(worker, message, tensors)))
        elif isinstance(message, ComputeExpert):
            self.messages += 1
            answer = self._one(worker, message, tensors[0])
            if answer is not None:
                self.inbox.append((worker, answer))
        return True  # Release, EndRequest: nothing to do without slots

    def _weights(self, layer: int, expert: int):
        """The expert as a worker's device slot holds it: a copy (aligned as torch allocates: a
        stored expert may sit at any offset of the checkpoint's buffer, see codec.ALIGN)."""
        w = self.store[(layer, expert)]
        return w.gate_up.clone(), w.down.clone()

    def _many(self, worker: int, m: ComputeExperts, tensors: list[torch.Tensor]) -> list:
        outputs = []
        for expert, segments, rows in zip(m.experts, m.segments, tensors, strict=True):
            gate_up, down = self._weights(m.step.layer, expert)
            shape = tuple(m.grouped_shape) or None
            parts = torch.split(rows, segments)
            ys = [expert_forward(x, gate_up, down, self.mlp, m.kernel, shape) for x in parts]
            outputs.append(torch.cat(ys))
        n = len(m.experts)
        zeros = [0.0] * n
        result = ExpertsResult(m.step, worker, m.experts, zeros, zeros, [0] * n, [True] * n, zeros, 0)
        return to_frames(result, outputs)

    def _one(self, worker: int, m: ComputeExpert, rows: torch.Tensor) -> list | None:
        positions = m.positions
        if m.parts > 1 and not m.per_part:
            parts = self.batches.setdefault((m.step, m.expert), {})
            parts[m.part] = (rows, m.positions)
            if len(parts) < m.parts:
                return None
            rows, positions = ComputeExpert.joined(parts)
            del self.batches[(m.step, m.expert)]
        gate_up, down = self._weights(m.step.layer, m.expert)
        shape = tuple(m.grouped_shape) or None
        y = expert_forward(rows, gate_up, down, self.mlp, m.kernel, shape, positions or None)
        result = ExpertResult(m.step, m.expert, worker, 0.0, 0.0, 0, 0, part=m.part if m.per_part else 0)
        return to_frames(result, [y])

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
