"""Each node's memory need for a checkpoint and a cluster shape, made before a tensor is read.

Contract (pure: sizes and memory figures in, verdicts out; `CheckpointSizes.of` reads the
safetensors headers and nothing else):
- `CheckpointSizes`: what the checkpoint holds, in bytes, at the dtypes the nodes hold it in: one
  expert at the workers' dtype, main's non-expert tensors, and the shadow's weights at each precision.
- `worker_shares(...)`: how many experts each worker is home for (odmoe.placement's homes, dealt by
  the rooms that the workers' memory leaves: `expert_room`), or, with cacheless workers, stores.
- `plan_cluster(...)` gives one `NodeNeed` per node: what it needs, what it has (its memory figure,
  odmoe.node_memory), and, for a node that does not fit, the one line that says so and what to
  change. A node checks its own line at start and refuses with it (`NodeNeed.refusal`); main checks
  the workers' once it has their memory figures; `odmoe-launch role=plan` prints them all.

What a node holds (the design: docs/memory.md):
- main: its non-expert tensors (attention, norms, routers, shared experts, embeddings, lm_head).
- a worker, with a cache (the default): the experts it is home for, each held once in memory (on a
  CPU the cache *is* where they rest), plus `worker.slots` buffers for just-in-time loads; an expert
  it is not home for is read from disk when asked (a lost peer's, until it has room to keep it).
  Cacheless (the paper's): every expert of the layers it stores. `worker.store=disk`: only the slots
  and what its memory leaves room to keep; the rest is read from disk on each load.
- the shadow: its quantized copy, built one layer at a time.
Every node also pays `PROCESS_BYTES` (the interpreter with torch, transformers, ZeroMQ and gRPC
imported: 432-458 MiB resident measured for the demo's nodes) and keeps a margin for activations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from odmoe.placement import Topology, home_counts


class MemoryPlanError(RuntimeError):
    """A node's share cannot fit its memory: raised at start, before anything is loaded, with the one
    line that names the node, what it needs, what it has and what to change."""


GiB = 1 << 30
MiB = 1 << 20
PROCESS_BYTES = 480 * MiB  # a node's fixed cost: the demo's nodes measured 432-458 MiB resident
# kept free on every node for activations, messages in flight and the allocator's slack (the same on
# every box: they scale with the model's width and the prompt, not with the node's memory)
MARGIN_BYTES = 256 * MiB


@dataclass(frozen=True)
class CheckpointSizes:
    expert_bytes: int  # one expert at the workers' dtype
    experts: int  # routed experts per MoE layer
    moe_layers: tuple[int, ...]
    non_expert_bytes: int  # main's tensors at main's dtype
    disk_bytes: int  # the safetensors files' tensors as stored
    shadow_bytes: dict[str, int] = field(default_factory=dict)  # the shadow's weights per precision

    @property
    def all_experts_bytes(self) -> int:
        return self.expert_bytes * self.experts * len(self.moe_layers)

    @classmethod
    def of(cls, checkpoint, dtype, shadow_bytes: dict[str, int] | None = None) -> CheckpointSizes:
        """From a `Checkpoint`'s headers: nothing but the files' headers is read."""
        from odmoe.models.families import is_expert_key

        disk = non_expert = 0
        for key in checkpoint.weight_map:
            info = checkpoint.tensor_info(key)
            disk += info.nbytes
            if not is_expert_key(key):
                floating = info.dtype.is_floating_point and info.dtype.itemsize >= 2
                # held at `dtype` whatever the file stores (a GGUF tensor's blocks are dequantized)
                non_expert += math.prod(info.shape) * dtype.itemsize if floating else info.nbytes
        from odmoe.models.load_dtypes import expert_dtype

        return cls(
            expert_bytes=checkpoint.expert_bytes(expert_dtype(checkpoint.config, dtype)),
            experts=checkpoint.num_experts,
            moe_layers=tuple(checkpoint.moe_layers),
            non_expert_bytes=non_expert,
            disk_bytes=disk,
            shadow_bytes=dict(shadow_bytes or {}),
        )


@dataclass(frozen=True)
class WorkerSetup:
    """The worker settings a plan depends on (odmoe.config's worker and cluster sections)."""

    workers: int
    group_size: int
    store: str = "memory"  # memory | compressed | disk
    cache: bool = True  # worker.cache other than 0: homes, and on a CPU the cache is the store
    slots: int = 2
    only_own_layers: bool = False
    replicas: int = 1
    host_memory: int = 0  # worker.host_memory (0: no bound)

    def topology(self, sizes: CheckpointSizes) -> Topology:
        replicas = self.replicas if self.only_own_layers else 0
        return Topology(self.workers, self.group_size, replicas, self.cache).for_model(
            list(sizes.moe_layers), sizes.experts
        )


@dataclass(frozen=True)
class NodeNeed:
    node: str  # main, shadow, worker<i>
    need: int  # bytes it will hold at its peak
    have: int | None  # its memory figure (None: not known)
    source: str  # where `have` came from
    holds: str  # what the need is made of, in words
    advice: str = ""  # what to change where it does not fit

    @property
    def fits(self) -> bool:
        return self.have is None or self.need <= self.have

    def refusal(self) -> str:
        """The one line a node that cannot fit refuses with ("" where it fits)."""
        if self.fits:
            return ""
        return (
            f"{self.node} needs {_gib(self.need)} ({self.holds}) but has {_gib(self.have or 0)} "
            f"({self.source}): {self.advice}"
        )


def expert_room(memory: int, expert_bytes: int, slots: int, cap: int, host_memory: int = 0) -> int:
    """Experts a worker with `memory` bytes may keep (its cache's room, what homes are dealt by):
    what is left after the process, the slots and the margin, at most `cap` and `host_memory`."""
    left = memory - PROCESS_BYTES - slots * expert_bytes - MARGIN_BYTES
    if host_memory:
        left = min(left, host_memory)
    return max(0, min(cap, left // expert_bytes))


def worker_shares(
    sizes: CheckpointSizes, setup: WorkerSetup, rooms: list[int] | None = None, live: list[int] | None = None
) -> list[int]:
    """Experts each worker holds in memory as the cluster deals them: with a cache, those it is home
    for (by `rooms`, or evenly); cacheless, every expert of the layers it stores."""
    topology = setup.topology(sizes)
    if not setup.cache:
        layers = list(sizes.moe_layers)
        return [len(topology.stored_layers(w, layers)) * sizes.experts for w in range(setup.workers)]
    counts = home_counts(topology.with_rooms(rooms) if rooms else topology, live)
    return [counts[w] for w in range(setup.workers)]


def plan_workers(
    sizes: CheckpointSizes, setup: WorkerSetup, memories: list[tuple[int | None, str]]
) -> list[NodeNeed]:
    """Each worker's need with its memory figure (bytes or None, source), homes dealt by the rooms."""
    eb, slots = sizes.expert_bytes, setup.slots * sizes.expert_bytes
    cap = sizes.experts * len(sizes.moe_layers)
    known = [m for m, _ in memories if m is not None]
    rooms = [expert_room(m, eb, setup.slots, cap, setup.host_memory) for m in known]
    shares = worker_shares(sizes, setup, rooms if len(known) == len(memories) else None)
    out = []
    for w, ((memory, source), share) in enumerate(zip(memories, shares, strict=True)):
        if setup.store == "disk":
            need = PROCESS_BYTES + slots + MARGIN_BYTES
            holds = (
                f"{setup.slots} slots {_mib(slots)}; its {share} experts read from disk as they are needed"
            )
        else:
            held = share * eb if setup.store == "memory" else int(share * eb * 0.7)
            need = PROCESS_BYTES + held + slots + MARGIN_BYTES
            what = "home for" if setup.cache else "storing"
            holds = f"{what} {share} experts, {_mib(held)}{'' if setup.store == 'memory' else ' compressed'}"
            holds += f", + {setup.slots} slots {_mib(slots)}, + the process {_mib(PROCESS_BYTES)}"
            holds += f" and {_mib(MARGIN_BYTES)} spare"
        out.append(
            NodeNeed(f"worker{w}", need, memory, source, holds, _worker_advice(sizes, setup, memories, need))
        )
    return out


def _worker_advice(sizes: CheckpointSizes, setup: WorkerSetup, memories, need: int) -> str:
    disk = "or worker.store=disk (experts read from disk as they are needed)"
    known = [m for m, _ in memories if m is not None]
    total = sizes.experts * len(sizes.moe_layers)
    room = expert_room(min(known), sizes.expert_bytes, setup.slots, total) if known else 0
    if not setup.cache or room == 0:
        return f"give the workers more memory, {disk}"
    workers = -(-total // room)
    workers = -(-workers // setup.group_size) * setup.group_size  # whole groups
    if workers <= setup.workers:
        return f"give the workers more memory, {disk}"
    share = -(-total // workers)  # dealt evenly; the room each has is what makes `workers` enough
    return f"cluster.workers={workers} (each then home for about {share} experts, room for {room}), {disk}"


def plan_main(sizes: CheckpointSizes, memory: int | None, source: str, kv_cache: int = 0) -> NodeNeed:
    need = PROCESS_BYTES + sizes.non_expert_bytes + kv_cache + MARGIN_BYTES
    holds = f"non-expert tensors {_mib(sizes.non_expert_bytes)}"
    if kv_cache:
        holds += f", K/V cache up to {_mib(kv_cache)} (server.kv_cache_memory)"
    holds += f", + the process {_mib(PROCESS_BYTES)} and {_mib(MARGIN_BYTES)} spare"
    advice = "run main on a box with more memory (it holds everything but the routed experts)"
    if not kv_cache:
        advice += "; the K/V cache comes on top: bound it with server.kv_cache_memory"
    return NodeNeed("main", need, memory, source, holds, advice)


def plan_shadow(
    sizes: CheckpointSizes, precision: str, memory: int | None, source: str, layer_bytes: int = 0
) -> NodeNeed:
    """The shadow at `precision` (already resolved from auto): its weights, one layer at full
    precision while it loads (`layer_bytes`), the process."""
    weights = sizes.shadow_bytes.get(precision, 0)
    need = PROCESS_BYTES + weights + layer_bytes + MARGIN_BYTES
    holds = f"{precision} weights {_mib(weights)}, + one layer while loading {_mib(layer_bytes)}"
    holds += f", + the process {_mib(PROCESS_BYTES)} and {_mib(MARGIN_BYTES)} spare"
    smaller = [p for p, b in sorted(sizes.shadow_bytes.items(), key=lambda kv: kv[1]) if b < weights]
    lower = f"a lower shadow.precision ({', '.join(smaller[:2])}), " if smaller else ""
    advice = f"{lower}a box with more memory for the shadow, or shadow.enabled=false"
    advice += " (experts loaded after routing: slower, as exact)"
    return NodeNeed("shadow", need, memory, source, holds, advice)


def unfit_homes(
    topology: Topology, rooms: list[int], strict: list[bool], live: list[int] | None = None
) -> str:
    """Main's check once every worker has told its room: "" when each worker that must hold all it is
    home for (`strict`) can, else the line that says which cannot and what to change."""
    homes = home_counts(topology.with_rooms(rooms) if topology.homes else topology, live)
    counts = [homes[w] for w in range(topology.workers)]
    short = [w for w in range(topology.workers) if strict[w] and counts[w] > rooms[w]]
    if not short:
        return ""
    held, total = sum(min(c, r) for c, r in zip(counts, rooms, strict=True)), sum(counts)
    names = ", ".join(f"worker{w} is home for {counts[w]} with room for {rooms[w]}" for w in short)
    return (
        f"the workers' memory holds {held} of the model's {total} experts ({names}): add workers, give "
        "them more memory, or worker.store=disk (experts read from disk as they are needed)"
    )


def format_plan(needs: list[NodeNeed]) -> str:
    """The table `odmoe-launch role=plan` prints."""
    rows = [("node", "needs", "has", "fits", "holds")]
    for n in needs:
        has = f"{_gib(n.have)} ({n.source})" if n.have is not None else "unknown"
        rows.append((n.node, _gib(n.need), has, "yes" if n.fits else "NO", n.holds))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4] for r in rows]
    lines += [n.refusal() for n in needs if not n.fits]
    return "\n".join(lines)


def worker_memories(
    workers: int, own: tuple[int | None, str], named: dict[str, str], parse: Callable[[str], int]
) -> list[tuple[int | None, str]]:
    """Each worker's memory figure for a plan: `cluster.node_memory`'s entry for it where given,
    else `own` (this node's, taken as every peer's)."""
    return [
        (parse(named[f"worker{w}"]), "cluster.node_memory") if f"worker{w}" in named else own
        for w in range(workers)
    ]


def _gib(n: int | None) -> str:
    return f"{(n or 0) / GiB:.2f} GiB"


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n < 10 * GiB else _gib(n)
