"""A worker's experts: a host-memory store and a fixed set of device slots.

Contract: `ExpertStore` keeps every expert the worker serves in host memory (never on the
accelerator). `DeviceSlots` owns `slots` preallocated buffers on the compute device; `load` copies
one expert into a free slot (the just-in-time load the paper hides behind computation) and
`evict` frees it. There is deliberately no cache: an expert is evicted right after it computes.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from odmoe.checkpoint import Checkpoint, ExpertWeights

ExpertKey = tuple[int, int]  # (layer, expert)


class ExpertStore:
    def __init__(self, experts: dict[ExpertKey, ExpertWeights]):
        if not experts:
            raise ValueError("a worker's expert store is empty")
        self._experts = experts
        first = next(iter(experts.values()))
        self.gate_up_shape, self.down_shape, self.dtype = (
            first.gate_up.shape,
            first.down.shape,
            first.gate_up.dtype,
        )

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint, layers: list[int], dtype: torch.dtype) -> ExpertStore:
        experts = {}
        for layer in layers:
            for e in range(checkpoint.num_experts):
                w = checkpoint.expert(layer, e)
                experts[(layer, e)] = ExpertWeights(
                    w.gate_up.to(dtype).contiguous(), w.down.to(dtype).contiguous()
                )
        return cls(experts)

    def keys(self) -> list[ExpertKey]:
        return list(self._experts)

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._experts

    def __getitem__(self, key: ExpertKey) -> ExpertWeights:
        return self._experts[key]

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self._experts})

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._experts.values())


Tag = tuple[str, int]  # (request, iteration) a preloaded expert was predicted for


@dataclass(frozen=True)
class Link:
    """An emulated host->device link: a load takes at least latency + bytes / bandwidth.

    Where there is no accelerator, a CPU "device slot" fills at memory speed; this makes a load take
    as long as it would over the link being modelled (e.g. PCIe of an edge GPU box). Off when 0.
    """

    bandwidth_gbps: float = 0.0
    latency_ms: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.bandwidth_gbps > 0 or self.latency_ms > 0

    def seconds(self, nbytes: int) -> float:
        transfer = nbytes * 8 / (self.bandwidth_gbps * 1e9) if self.bandwidth_gbps > 0 else 0.0
        return self.latency_ms / 1e3 + transfer


@dataclass
class Slot:
    index: int
    gate_up: torch.Tensor
    down: torch.Tensor
    holds: ExpertKey | None = None
    tag: Tag | None = None
    load_s: float = 0.0  # how long filling it took
    nbytes: int = 0
    filling: Future | None = None  # set while a background load is in flight
    load_started_us: float = 0.0  # wall clock, for the timeline

    def wait_filled(self) -> float:
        """Block until the slot's load has finished; returns the seconds waited."""
        if self.filling is None:
            return 0.0
        start = time.perf_counter()
        self.filling.result()
        self.filling = None
        return time.perf_counter() - start


@dataclass
class LoadCounters:
    loads: int = 0
    bytes_loaded: int = 0
    load_s: float = 0.0
    peak_busy: int = 0


class DeviceSlots:
    """`reserve` picks a free slot (caller's thread); `fill` copies the expert in (any thread).
    `load` does both now; `load_async` fills on the background loader so compute can go on."""

    def __init__(self, store: ExpertStore, device: torch.device, slots: int = 2, link: Link = Link()):
        if slots < 1:
            raise ValueError(f"worker.slots must be at least 1, got {slots}")
        self.store, self.device, self.link = store, device, link
        self._slots = [
            Slot(
                i,
                torch.empty(store.gate_up_shape, dtype=store.dtype, device=device),
                torch.empty(store.down_shape, dtype=store.dtype, device=device),
            )
            for i in range(slots)
        ]
        self.counters = LoadCounters()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="odmoe-loader")

    def reserve(self, key: ExpertKey, tag: Tag | None = None) -> Slot:
        if key not in self.store:
            raise KeyError(f"expert {key} is not in this worker's store (layers {self.store.layers})")
        slot = next((s for s in self._slots if s.holds is None), None)
        if slot is None:
            raise RuntimeError(f"all {len(self._slots)} device slots are busy; cannot load {key}")
        slot.holds, slot.tag = key, tag
        c = self.counters
        c.peak_busy = max(c.peak_busy, self.busy)
        return slot

    def fill(self, slot: Slot) -> None:
        start = time.perf_counter()
        slot.load_started_us = time.time() * 1e6
        weights = self.store[slot.holds]
        slot.gate_up.copy_(weights.gate_up, non_blocking=True)
        slot.down.copy_(weights.down, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        if self.link.enabled:
            time.sleep(max(self.link.seconds(weights.nbytes) - (time.perf_counter() - start), 0.0))
        slot.load_s, slot.nbytes = time.perf_counter() - start, weights.nbytes
        c = self.counters
        c.loads += 1
        c.bytes_loaded += weights.nbytes
        c.load_s += slot.load_s

    def load(self, key: ExpertKey, tag: Tag | None = None) -> Slot:
        slot = self.reserve(key, tag)
        self.fill(slot)
        return slot

    def load_async(self, key: ExpertKey, tag: Tag | None = None) -> Slot:
        slot = self.reserve(key, tag)
        slot.filling = self._loader.submit(self.fill, slot)
        return slot

    def evict(self, slot: Slot) -> None:
        slot.wait_filled()  # a copy in flight cannot be abandoned: it still writes the buffers
        slot.holds, slot.tag = None, None

    def find(self, key: ExpertKey, tag: Tag) -> Slot | None:
        return next((s for s in self._slots if s.holds == key and s.tag == tag), None)

    def held(self) -> list[Slot]:
        return [s for s in self._slots if s.holds is not None]

    @property
    def free(self) -> int:
        return len(self._slots) - self.busy

    @property
    def busy(self) -> int:
        return sum(s.holds is not None for s in self._slots)

    @property
    def device_bytes(self) -> int:
        """What the slots take on the device (the paper's per-worker GPU memory)."""
        return sum(s.gate_up.nbytes + s.down.nbytes for s in self._slots)


class ResidentExperts:
    """Every expert stays on the device: nothing is ever loaded or evicted.

    Not OD-MoE: the benchmark baseline that keeps the same cluster and protocol but drops the cost
    of being cacheless (`worker.resident=true`). It answers DeviceSlots' calls, always with a hit.
    """

    def __init__(self, store: ExpertStore, device: torch.device):
        self.store, self.device, self.link = store, device, Link()
        self._weights = {
            key: ExpertWeights(store[key].gate_up.to(device), store[key].down.to(device))
            for key in store.keys()
        }
        self.counters = LoadCounters()

    def find(self, key: ExpertKey, tag: Tag) -> Slot | None:
        w = self._weights.get(key)
        return None if w is None else Slot(-1, w.gate_up, w.down, holds=key, tag=tag)

    def load(self, key: ExpertKey, tag: Tag | None = None) -> Slot:
        if key not in self._weights:
            raise KeyError(f"expert {key} is not in this worker's store (layers {self.store.layers})")
        return self.find(key, tag)

    load_async = load

    def evict(self, slot: Slot) -> None:
        pass

    def held(self) -> list[Slot]:
        return []

    @property
    def free(self) -> int:
        return 0  # nothing to preload into: every expert is already there

    @property
    def device_bytes(self) -> int:
        return sum(w.nbytes for w in self._weights.values())
