"""What one worker holds in memory: its share of the experts, decided before anything is read.

Contract (pure: the worker's settings, its memory figure and the placement in, a `ShareLayout` out;
the worker node applies it):
- `cache_is_store`: a CPU worker with a cache (`worker.cache` not 0) whose experts are kept as their
  dtype (store memory or disk, the checkpoint not FP8/MXFP4): its "device" is the same RAM, so the
  cache's buffers are where its experts rest and the store holds none of them in memory (an expert is
  read from disk straight into a cache buffer, never held twice). Elsewhere (a CUDA worker, a
  compressed or quantized store, cacheless workers) the store holds its experts in host memory as
  before, a CUDA worker's only those it is home for.
- `room`: experts its cache may keep (`worker.cache`: auto from the node's memory figure on a CPU, as
  odmoe.memory_plan.expert_room says; a size; all), which main deals homes by.
- `home`: the experts it is home for, as odmoe.placement deals them by the rooms known at start (its
  own, and `cluster.node_memory`'s for its peers, else its own taken as theirs), in the order main
  visits layers: what it reads at start, up to its room.
- `need`: its line of the memory plan; a worker with `worker.store=memory` and automatic room whose
  home experts do not fit refuses at start with `need.refusal()` rather than being killed later.
"""

from __future__ import annotations

from dataclasses import dataclass

from odmoe.memory_plan import CheckpointSizes, NodeNeed, WorkerSetup, expert_room, plan_workers
from odmoe.placement import Topology

ExpertKey = tuple[int, int]


@dataclass(frozen=True)
class ShareLayout:
    cache_is_store: bool
    held: frozenset[ExpertKey] | None  # what the store keeps in host memory (None: every expert it stores)
    room: int
    home: tuple[ExpertKey, ...]
    need: NodeNeed
    strict: bool  # its home experts must all fit (store=memory with the cache sized from its memory)


def plan_share(
    index: int,
    setup: WorkerSetup,
    sizes: CheckpointSizes,
    topology: Topology,
    stored: list[ExpertKey],
    memories: list[tuple[int | None, str]],
    cache_spec: str,
    device_type: str,
    quantized: bool,
    resident: bool,
    cache_room: int,
) -> ShareLayout:
    """This worker's layout (the module's contract). `topology` is the cluster's, over the model;
    `memories` every worker's memory figure as far as this worker knows them (its own at `index`);
    `cache_room` the room `worker.cache` gives when it is not automatic on a CPU (a size, all, or auto
    on a device, sized by free device memory)."""
    auto = str(cache_spec).strip().lower() == "auto"
    by_memory = auto and device_type == "cpu"  # else the room is what `worker.cache` says, on every peer

    def room_of(memory: int | None) -> int:
        if by_memory and memory is not None:
            return expert_room(memory, sizes.expert_bytes, setup.slots, len(stored), setup.host_memory)
        return cache_room

    room = room_of(memories[index][0])
    rooms = [room_of(m) for m, _ in memories] if setup.cache else None
    placed = topology.with_rooms(rooms) if rooms and topology.homes else topology
    home = tuple(k for k in stored if placed.home(*k) == index) if setup.cache else ()
    cache_is_store = (
        device_type == "cpu"
        and setup.cache
        and setup.store in ("memory", "disk")
        and not quantized
        and not resident
    )
    if cache_is_store or setup.store == "disk":
        held: frozenset[ExpertKey] | None = frozenset()
    elif setup.cache and device_type != "cpu" and setup.store == "memory" and not resident:
        held = frozenset(home)  # a device worker: host memory holds what it is home for
    else:
        held = None
    need = plan_workers(sizes, setup, memories)[index]
    strict = setup.store == "memory" and (not setup.cache or (auto and device_type == "cpu"))
    return ShareLayout(cache_is_store, held, room, home, need, strict and not resident)
