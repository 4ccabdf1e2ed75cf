"""A worker's experts: a store (host memory and disk) and a fixed set of device slots.

Contract: `ExpertStore` knows where every expert the worker serves rests — decompressed or losslessly
compressed in host memory within `worker.host_memory`, or on disk (`worker.store`) — never on the
accelerator, and writes one into given tensors bit for bit (`load_into`). `DeviceSlots` owns
`slots` preallocated buffers on the compute device; `load` moves one expert into a free slot (the
just-in-time load the paper hides behind computation) and `evict` frees it. On a CUDA device the
experts rest in pinned host memory and a load is an asynchronous copy on the worker's own copy
stream, timed by CUDA events, which compute waits for on the GPU (odmoe.worker.device_slots); on a CPU
device a load is a plain copy, timed by the host clock.
With `cache` > 0 (`worker.cache`, odmoe.worker.expert_cache) there are that many buffers more, and a
slot can be kept after use as a cached expert (`keep`): not in `held()` (the just-in-time slots'
bookkeeping), found by `find` whatever the request, dropped by `evict` when the worker's policy
says so. Without it an expert is evicted right after it computes: no cache, as in the paper.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from odmoe.models.checkpoint import Checkpoint, ExpertWeights
from odmoe.worker.compressed_tensor import MemoryBytes, compress
from odmoe.worker.device_slots import CopyStream, Transfer, pin
from odmoe.worker.expert_pack import PACK_DIR, ExpertPack, PackError, pack_path
from odmoe.worker.expert_sources import (
    FORMS,
    CheckpointExpert,
    CompressedExpert,
    HostExpert,
    QuantizedHostExpert,
)

ExpertSource = HostExpert | CompressedExpert | CheckpointExpert | QuantizedHostExpert

ExpertKey = tuple[int, int]  # (layer, expert)


STORES = ("memory", "compressed", "disk")


class ExpertStore:
    """Every expert this worker serves, each where it rests (odmoe.worker.expert_sources): decompressed or
    compressed in host memory, or on disk. `load_into` moves one into a device slot's tensors and
    returns the bytes moved; compressed chunks decompress on the store's own small thread pool."""

    def __init__(self, experts: dict[ExpertKey, ExpertWeights | ExpertSource], threads: int = 2):
        if not experts:
            raise ValueError("a worker's expert store is empty")
        if threads < 1:
            raise ValueError(f"decompression threads must be at least 1, got {threads}")
        self._experts: dict[ExpertKey, ExpertSource] = {
            k: HostExpert(v) if isinstance(v, ExpertWeights) else v for k, v in experts.items()
        }
        self.gate_up_shape, self.down_shape, self.dtype = _shapes(next(iter(self._experts.values())))
        self.threads = threads
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="odmoe-decompress")
        self.pack_path: str | None = None  # set by `build` when a pack file serves some experts
        self.pack_missing: str | None = None  # set by `build`: where it looked for a pack and found none

    @classmethod
    def build(
        cls,
        checkpoint: Checkpoint,
        layers: list[int],
        dtype: torch.dtype,
        kind: str = "memory",
        host_memory: int = 0,
        pack_dir: str | None = None,
        threads: int = 2,
        pin_memory: bool = False,
        held: Collection[ExpertKey] | None = None,
        forget_read: bool = False,
    ) -> ExpertStore:
        """The store of `worker.store=kind`. Experts are taken in (layer, expert) order and kept in host
        memory in the kind's form while `host_memory` bytes last (0: no limit); the rest, and every
        expert of `disk`, are read on each load: from the pack file when `pack_dir` (default
        MODEL/odmoe-pack) holds one for this dtype and the kind compresses (compressed, disk), else
        from the checkpoint's safetensors. `memory` never reads the pack: it is the uncompressed path.
        `pin_memory` (a CUDA worker): experts held decompressed rest in page-locked memory, so a load
        is an asynchronous DMA. `held` (memory only): only these experts are kept in host memory, the
        others read from the checkpoint on each load (a worker's share: those it is home for; on a CPU
        worker with a cache, none: the cache holds them). `forget_read`: after each read from the
        checkpoint, the kernel is told to drop those pages from its cache (the reader keeps the bytes)."""
        _check_store(kind, checkpoint)
        keys = [(layer, e) for layer in layers for e in range(checkpoint.num_experts)]
        path = pack_path(Path(pack_dir) if pack_dir else checkpoint.path / PACK_DIR, dtype)
        pack = ExpertPack(path, checkpoint) if kind != "memory" and path.is_file() else None
        if pack is not None and (missing := [k for k in keys if k not in pack]):
            raise PackError(f"{path} lacks experts {missing[:4]}...; re-run odmoe-pack")
        room = host_memory if host_memory > 0 else float("inf")  # host bytes left to keep experts in
        lock = threading.Lock()
        probe = checkpoint.expert(*keys[0])
        raw_bytes = (probe.gate_up.numel() + probe.down.numel()) * dtype.itemsize  # one expert at `dtype`
        experts: dict[ExpertKey, ExpertSource] = {}
        for key in keys:
            source = None
            if held is None or key in held:
                source = _held_source(checkpoint, key, dtype, kind, pack, room, raw_bytes, pin_memory)
            if source is None and pack is not None:  # beyond the budget: read on each load
                packed = pack[key]
                source = CompressedExpert(packed.gate_up, packed.down, pack.bytes, True, f"expert {key}")
            elif source is None:
                source = CheckpointExpert(checkpoint, key, dtype, lock, raw_bytes, forget_read)
            room -= source.host_bytes
            experts[key] = source
        store = cls(experts, threads)
        store.pack_path = str(path) if pack is not None else None
        store.pack_missing = str(path) if pack is None and kind != "memory" else None
        return store

    def keys(self) -> list[ExpertKey]:
        return list(self._experts)

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._experts

    def __getitem__(self, key: ExpertKey) -> ExpertWeights:
        """The expert decompressed (a new copy unless it is held decompressed)."""
        return self._experts[key].weights_now(self.pool)

    def load_into(self, key: ExpertKey, gate_up: torch.Tensor, down: torch.Tensor) -> int:
        """Write expert `key`'s exact bits into the two slot tensors; returns the bytes moved."""
        return self._experts[key].load_into(gate_up, down, self.pool)

    def prefetch(self, key: ExpertKey) -> None:
        """An expert read from disk on each load: have the kernel start reading it now (a prediction
        says a load is coming); nothing for one held in memory."""
        source = self._experts.get(key)
        if isinstance(source, CheckpointExpert):
            source.prefetch()

    def form(self, key: ExpertKey) -> str:
        return self._experts[key].form

    @property
    def layers(self) -> list[int]:
        return sorted({layer for layer, _ in self._experts})

    @property
    def nbytes(self) -> int:
        """Bytes of expert weights held in host memory (decompressed or compressed)."""
        return sum(s.host_bytes for s in self._experts.values())

    def holdings(self) -> dict[str, dict[str, int]]:
        """Per form (decompressed / compressed / fp8 / disk): experts, bytes held in host memory,
        bytes stored."""
        out = {form: {"experts": 0, "host_bytes": 0, "stored_bytes": 0} for form in FORMS}
        for s in self._experts.values():
            row = out[s.form]
            row["experts"] += 1
            row["host_bytes"] += s.host_bytes
            row["stored_bytes"] += s.stored_bytes
        return out

    def describe(self) -> str:
        """One log line: what is held in each form."""
        parts = [
            f"{row['experts']} {form} ({row['stored_bytes'] / 2**20:.1f} MiB)"
            for form, row in self.holdings().items()
            if row["experts"]
        ]
        where = f", pack {self.pack_path}" if self.pack_path else ""
        if self.pack_missing:
            where = f", no pack file at {self.pack_missing} (odmoe-pack writes one)"
        return f"experts {', '.join(parts)}; {self.nbytes / 2**20:.1f} MiB in host memory{where}"


def _shapes(source: ExpertSource) -> tuple[torch.Size, torch.Size, torch.dtype]:
    if isinstance(source, HostExpert):
        w = source.weights
        return w.gate_up.shape, w.down.shape, w.gate_up.dtype
    if isinstance(source, CompressedExpert):
        return torch.Size(source.gate_up.shape), torch.Size(source.down.shape), source.gate_up.dtype
    if isinstance(source, QuantizedHostExpert):
        return (*source.expert.shapes, source.dtype)
    w = source.weights_now()
    return w.gate_up.shape, w.down.shape, w.gate_up.dtype


def _check_store(kind: str, checkpoint: Checkpoint) -> None:
    if kind not in STORES:
        raise ValueError(f"worker.store={kind!r} is not one of {', '.join(STORES)}")
    if kind == "compressed" and checkpoint.quantized_experts:
        raise ValueError(
            "worker.store=compressed codes bf16/fp16/fp32 experts; this checkpoint's experts are "
            f"{checkpoint.quantized_experts.upper()} (kept as stored by worker.store=memory): use memory "
            "or disk"
        )


def _held_source(
    checkpoint, key, dtype, kind, pack, room: float, raw_bytes: int, pin_memory: bool = False
) -> ExpertSource | None:
    """Expert `key` kept in host memory in `kind`'s form, or None: `disk`, or not within `room` bytes."""
    if kind == "memory" and checkpoint.quantized_experts:  # kept as stored, dequantized on each load
        held = QuantizedHostExpert(checkpoint.quantized_expert(*key), dtype)
        return held if held.host_bytes <= room else None
    if kind == "memory" and raw_bytes <= room:
        w = checkpoint.expert(*key)
        gate_up, down = w.gate_up.to(dtype).contiguous(), w.down.to(dtype).contiguous()
        if pin_memory:
            gate_up, down = pin(gate_up), pin(down)
        return HostExpert(ExpertWeights(gate_up, down))
    if kind == "compressed" and pack is not None and pack[key].nbytes <= room:
        data, packed = pack.read_expert(key)
        expert = CompressedExpert(packed.gate_up, packed.down, MemoryBytes(data), False, f"expert {key}")
        expert.verify()  # read once from disk: check every chunk now, not at its first load
        return expert
    if kind == "compressed" and pack is None and room > 0:
        expert = _compress_expert(checkpoint, key, dtype)
        return expert if expert.host_bytes <= room else None
    return None


def _compress_expert(checkpoint: Checkpoint, key: ExpertKey, dtype: torch.dtype) -> CompressedExpert:
    """No pack file: compress this expert now, in memory (what odmoe-pack would have written)."""
    w = checkpoint.expert(*key)
    gate_up, a = compress(w.gate_up.to(dtype))
    down, b = compress(w.down.to(dtype), base=len(a))
    return CompressedExpert(gate_up, down, MemoryBytes(a + b), False, f"expert {key}")


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
    cached: bool = False  # kept after use (worker.cache): no request's, found by any
    load_started_us: float = 0.0  # wall clock, for the timeline
    transfer: Transfer | None = None  # CUDA: the copy's events; load_s is known once it is settled

    def wait_filled(self) -> float:
        """Block until the slot's load has finished; returns the seconds waited."""
        if self.filling is None:
            return 0.0
        start = time.perf_counter()
        try:
            self.filling.result()  # re-raises what the load raised (e.g. a corrupt chunk)
        finally:
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
    `load` does both now; `load_async` fills on the background loader so compute can go on.

    CUDA: `fill` only enqueues the copy on the copy stream and returns; before computing, the caller
    makes its stream wait for the copy (`await_on_device`), and after the result is back on the host
    it calls `settle` to learn the load's duration by CUDA events (`slot.load_s`). On a CPU device
    `fill` has copied when it returns and those two calls do nothing."""

    def __init__(
        self,
        store: ExpertStore,
        device: torch.device,
        slots: int = 2,
        link: Link = Link(),
        cache: int = 0,
        allocate: int | None = None,
    ):
        if slots < 1:
            raise ValueError(f"worker.slots must be at least 1, got {slots}")
        self.store, self.device, self.link = store, device, link
        self.cache_capacity, self.jit_slots = cache, slots
        # the cache's buffers allocated now (default: all); the rest as kept experts need them (`keep`)
        ready = cache if allocate is None else min(allocate, cache)
        self._slots = [self._buffer(i) for i in range(slots + ready)]
        self.counters = LoadCounters()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="odmoe-loader")
        self.copier = CopyStream(device) if device.type == "cuda" else None
        self._unsettled: list[Transfer] = []  # CUDA: copies of evicted slots, counted when done

    def _buffer(self, index: int) -> Slot:
        store, device = self.store, self.device
        gate_up = torch.empty(store.gate_up_shape, dtype=store.dtype, device=device)
        return Slot(index, gate_up, torch.empty(store.down_shape, dtype=store.dtype, device=device))

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
        if self.copier is not None:
            self._fill_cuda(slot)
            return
        start = time.perf_counter()
        slot.load_started_us = time.time() * 1e6
        moved = self.store.load_into(slot.holds, slot.gate_up, slot.down)  # stored bytes: compressed or not
        if self.link.enabled:
            # The link carries what was moved; decompression overlaps the transfer (chunk by chunk), so
            # a load takes the longer of the two.
            time.sleep(max(self.link.seconds(moved) - (time.perf_counter() - start), 0.0))
        slot.load_s, slot.nbytes = time.perf_counter() - start, moved
        c = self.counters
        c.loads += 1
        c.bytes_loaded += moved
        c.load_s += slot.load_s

    def _fill_cuda(self, slot: Slot) -> None:
        """Enqueue the expert's copy on the copy stream (pinned source: the host does not wait)."""
        slot.load_started_us = time.time() * 1e6
        start = time.perf_counter()
        with torch.cuda.stream(self.copier.stream):
            self.copier.start()
            moved = self.store.load_into(slot.holds, slot.gate_up, slot.down)
            slot.transfer = self.copier.finish()
        slot.load_s, slot.nbytes = 0.0, moved
        if self.link.enabled:  # emulating a slower link than this bus: the load takes at least that long
            slot.transfer.end.synchronize()
            time.sleep(max(self.link.seconds(moved) - (time.perf_counter() - start), 0.0))
        self.counters.loads += 1
        self.counters.bytes_loaded += moved

    def await_on_device(self, slot: Slot):
        """CUDA: the current stream waits (on the GPU) for the slot's copy; returns a probe for
        `device_wait_s`. None on a CPU device or once nothing is in flight."""
        if slot.transfer is None:
            return None
        return slot.transfer.await_on(torch.cuda.current_stream(self.device))

    def device_wait_s(self, slot: Slot, probe) -> float:
        """How long the compute stream waited for the copy (0 on a CPU device)."""
        return 0.0 if probe is None or slot.transfer is None else slot.transfer.waited_s(probe)

    def settle(self, slot: Slot) -> None:
        """CUDA: wait for the slot's copy and set `slot.load_s` to its duration by CUDA events."""
        transfer, slot.transfer = slot.transfer, None
        if transfer is not None:
            slot.load_s = transfer.seconds()
            self.counters.load_s += slot.load_s

    def _reap(self) -> None:
        """Count the copies of slots evicted unused, once they are done (never blocks; caller's thread)."""
        pending = []
        for t in self._unsettled:
            if t.end.query():
                self.counters.load_s += t.seconds()
            else:
                pending.append(t)
        self._unsettled = pending

    def load(self, key: ExpertKey, tag: Tag | None = None) -> Slot:
        slot = self.reserve(key, tag)
        try:
            self.fill(slot)
        except Exception:
            slot.holds, slot.tag = None, None  # a failed load must not keep its slot
            raise
        return slot

    def load_async(self, key: ExpertKey, tag: Tag | None = None) -> Slot:
        slot = self.reserve(key, tag)
        slot.filling = self._loader.submit(self.fill, slot)
        return slot

    def evict(self, slot: Slot) -> None:
        try:
            slot.wait_filled()  # a copy in flight cannot be abandoned: it still writes the buffers
        except Exception:
            pass  # a failed load leaves nothing to keep; a compute that needed it reported the error
        finally:
            if slot.transfer is not None:  # an unused preload: its copy still counts once it is done
                self._unsettled.append(slot.transfer)
                slot.transfer = None
                self._reap()
            slot.holds, slot.tag, slot.cached = None, None, False

    def keep(self, slot: Slot) -> None:
        """After use: the slot stays filled as a cached expert (its copy settled first)."""
        slot.wait_filled()
        self.settle(slot)
        slot.tag, slot.cached = None, True
        if len(self._slots) - len(self.cached()) < self.jit_slots:  # the cache grew past its buffers
            self._slots.append(self._buffer(len(self._slots)))

    def find(self, key: ExpertKey, tag: Tag) -> Slot | None:
        """The slot loaded for `tag` holding `key`, else the cached copy of `key`, else None."""
        found = None
        for s in self._slots:
            if s.holds == key:
                if not s.cached and s.tag == tag:
                    return s
                if s.cached:
                    found = s
        return found

    def held(self) -> list[Slot]:
        """Slots holding an expert for some use (loading, preloaded, computing): not the cache."""
        return [s for s in self._slots if s.holds is not None and not s.cached]

    def cached(self) -> list[Slot]:
        return [s for s in self._slots if s.cached]

    @property
    def free(self) -> int:
        return len(self._slots) - self.busy

    @property
    def busy(self) -> int:
        return sum(s.holds is not None for s in self._slots)

    @property
    def free_for_cache(self) -> bool:
        """Whether one more expert may be kept without dropping one."""
        return len(self.cached()) < self.cache_capacity

    @property
    def device_bytes(self) -> int:
        """What the slots take on the device (the paper's per-worker GPU memory)."""
        return sum(s.gate_up.nbytes + s.down.nbytes for s in self._slots)


class ResidentExperts:
    """Every expert stays on the device: nothing is ever loaded or evicted.

    Not OD-MoE: the benchmark baseline that keeps the same cluster and protocol but drops the cost
    of being cacheless (`emulation.resident=true`). It answers DeviceSlots' calls, always with a hit.
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

    def await_on_device(self, slot: Slot):
        return None

    def device_wait_s(self, slot: Slot, probe) -> float:
        return 0.0

    def settle(self, slot: Slot) -> None:
        pass

    def held(self) -> list[Slot]:
        return []

    def cached(self) -> list[Slot]:
        return []

    cache_capacity = 0
    free_for_cache = False

    @property
    def free(self) -> int:
        return 0  # nothing to preload into: every expert is already there

    @property
    def device_bytes(self) -> int:
        return sum(w.nbytes for w in self._weights.values())
