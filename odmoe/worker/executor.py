"""A worker's experts without its sockets: what it holds, what it preloads, keeps, evicts, computes.

Contract: `ExpertExecutor` takes a decoded message and its tensors and gives back the frames to send
(`answer`; `compute` for the one compute message, `ComputeExperts`), or None where nothing is sent
(a prefill mini-batch that only completes a batch, a `Release`). It never opens a socket, never
imports zmq and never reads a config; its constructor builds nothing but bookkeeping.
The worker node (`odmoe.nodes.worker`) binds, receives, decodes, hands each message here and sends
what comes back; `odmoe.main.inprocess` runs one executor per worker inside main's process, so the
fast tier computes the experts with this same code.

What it holds, all made by its caller: the `ExpertStore` (host memory, compressed or disk), the
device slots (`DeviceSlots`, or `ResidentExperts` for the resident baseline), the `CacheBook`
(odmoe.worker.expert_cache; capacity 0: cacheless, the paper's) and, made here, the
`PreloadSchedule` (odmoe.worker.preload_schedule). `SlotKeeper` applies the schedule's and the
cache's decisions to the slots (what to preload, give back, keep after use); `ExpertExecutor` checks
and computes the requests (paper §3.1: a hit computes from the slot the prediction filled, a miss
loads on demand) and writes their results.

Every request is untrusted: one that does not fit (an unknown kernel, rows of the wrong shape, an
expert this worker does not store) is answered with an error result, never raised; a background
load that fails frees its slot and is answered the same way. Each request's segment of a
`ComputeExperts` is computed as its request alone computes it (odmoe.worker.stacked_segments):
the outputs are bit-identical to the single-request answers, and to `expert_forward` on the
checkpoint's weights.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import replace

import torch

from odmoe.models.expert_math import KERNELS, ExpertMLP
from odmoe.placement import LayerUnavailable, Topology
from odmoe.tools.memory import PeakEvery
from odmoe.tools.trace import Tracer, now_us
from odmoe.transport.codec import CodecError
from odmoe.transport.messages import (
    ComputeExperts,
    EndRequest,
    ExpertsResult,
    LiveWorkers,
    Prediction,
    Release,
    Step,
    joined_parts,
    positions_problem,
    to_frames,
)
from odmoe.worker.device_slots import device_peak_bytes
from odmoe.worker.expert_cache import CacheBook, expected_distance
from odmoe.worker.expert_store import DeviceSlots, ExpertStore, LoadCounters, ResidentExperts, Slot
from odmoe.worker.preload_schedule import PreloadSchedule
from odmoe.worker.stacked_segments import StackedSegments

log = logging.getLogger("odmoe.worker")
MAX_OPEN_BATCHES = 64  # prefill batches still missing parts; beyond this the oldest is dropped
MAX_GROUPED_ROWS = 1 << 20  # a grouped_shape beyond this is refused (it sizes an allocation)
MAX_GROUPS = 1023  # PyTorch's grouped_mm takes fewer than 1024 groups
_PEAK = PeakEvery()  # this process's peak memory, as every answer reports it (read 10 times a second)
# Reading its share at start, the kernel is asked for this many experts ahead (posix_fadvise WILLNEED):
# 466 against 172 MiB/s read with none, on this project's virtio disk (4 ahead beat 16: 355 MiB/s)
WARM_AHEAD = 4

ExpertKey = tuple[int, int]  # (layer, expert)


def request_problem(
    request: ComputeExperts, tensors: list[torch.Tensor], hidden_size: int, dtype: torch.dtype
) -> str:
    """What is wrong with a ComputeExperts, or "" (an untrusted peer may send anything)."""
    n = len(request.experts)
    if not n or len(tensors) != n or len(request.segments) != n or len(set(request.experts)) != n:
        return f"{n} experts, {len(request.segments)} segment lists, {len(tensors)} tensors"
    if request.kernel not in KERNELS:
        return f"unknown experts kernel {request.kernel!r:.40}"
    if not 0 <= request.part < request.parts or (request.parts > 1 and n > 1):
        return f"part {request.part} of {request.parts} for {n} experts"
    shape = request.grouped_shape
    if shape and (len(shape) != 2 or not (1 <= shape[0] <= MAX_GROUPED_ROWS and 1 <= shape[1] <= MAX_GROUPS)):
        return f"grouped_shape {shape!r:.40} is not [rows <= {MAX_GROUPED_ROWS}, experts <= {MAX_GROUPS}]"
    if request.positions and len(request.positions) != n:
        return f"{len(request.positions)} position lists for {n} experts"
    for i, (expert, segments, rows) in enumerate(
        zip(request.experts, request.segments, tensors, strict=True)
    ):
        if rows.dim() != 2 or rows.shape[1] != hidden_size:
            return f"rows of shape {list(rows.shape)}, expected [n, {hidden_size}]"
        if rows.dtype != dtype:
            return f"rows of {rows.dtype}, the experts are {dtype}"
        if not segments or any(s < 1 for s in segments) or sum(segments) != rows.shape[0]:
            return f"segments {segments!r:.40} do not add up to the {rows.shape[0]} rows of expert {expert}"
        if request.positions and (len(segments) > 1 or request.positions[i]):
            if len(segments) > 1:
                return "row positions with several segments"
            if problem := positions_problem(request.kernel, shape, request.positions[i], rows.shape[0]):
                return problem
    return ""


class SlotKeeper:
    """What is on this worker's device: applies the preload schedule's decisions (preload, give back)
    and the cache's (keep a computed expert, drop one to make room) to the slots, in their order.

    It knows the placement (`topology`, `live`) to take its share of a prediction and to tell which
    experts it is home for (only its home keeps an expert cached)."""

    def __init__(
        self,
        index: int,
        topology: Topology,
        store: ExpertStore,
        slots: DeviceSlots | ResidentExperts,
        cache: CacheBook,
        layer_rank: dict[int, int],
        tracer: Tracer,
    ):
        self.index, self.topology, self.store, self.slots, self.cache = index, topology, store, slots, cache
        self.layer_rank = layer_rank  # main's order of decode layers
        self.tracer = tracer
        self.live: list[int] | None = None  # None until main says: every worker
        # what to preload, in what order, and what to give back; this applies its decisions
        self.schedule = PreloadSchedule(store, for_cache=cache.enabled)
        self.computing: set[ExpertKey] = set()  # cached experts a message is about to compute
        self._home_memo: tuple = (None, 0, 0)  # (live, cache version) -> home, home cached

    def set_live(self, message: LiveWorkers) -> None:
        """Main's view of who is live, the homes' rooms and the stragglers it steers away from:
        predictions are dealt as main will place them."""
        self.live = sorted(w for w in message.live if 0 <= w < self.topology.workers)
        if self.topology.homes and len(message.rooms) == self.topology.workers:
            self.topology = self.topology.with_rooms(message.rooms)  # homes as main deals them
        self.topology = self.topology.with_slow(message.slow, message.probe_every, message.slow_rooms)

    def warm(self, keys: tuple[ExpertKey, ...]) -> tuple[int, float]:
        """Read the experts this worker is home for into its cache before serving (a CPU worker's
        cache is where they rest), logging progress on a long read; returns (bytes, seconds)."""
        store = self.store
        total = len(keys) * (store.gate_up_shape.numel() + store.down_shape.numel()) * store.dtype.itemsize
        done = 0
        start = last = time.perf_counter()
        for key in keys[:WARM_AHEAD]:
            self.store.prefetch(key)
        for i, key in enumerate(keys):
            if i + WARM_AHEAD < len(keys):  # the kernel reads the next ones while this one is copied
                self.store.prefetch(keys[i + WARM_AHEAD])
            slot = self.slots.load(key)
            self.slots.keep(slot)
            self.cache.admit(key)
            done += slot.nbytes
            now = time.perf_counter()
            if now - last >= 2.0:
                last = now
                mib, share = done / 2**20, 100 * done / max(total, 1)
                log.info(
                    "worker %d: read %.0f of %.0f MiB of its share (%.0f %%, %.0f MiB/s)",
                    self.index,
                    mib,
                    total / 2**20,
                    share,
                    mib / (now - start),
                )
        self.slots.counters = LoadCounters()  # reading its share is not a load any request made
        elapsed = time.perf_counter() - start
        if keys:
            mib = done / 2**20
            log.info(
                "worker %d: its share read: %d experts, %.0f MiB in %.1fs (%.0f MiB/s)",
                self.index,
                len(keys),
                mib,
                elapsed,
                mib / max(elapsed, 1e-9),
            )
        return done, elapsed

    def cache_report(self) -> list[int]:
        """CacheBook.report with the experts this worker is home for now, and of them cached (counted
        again only when the live workers or the cache's contents changed)."""
        if not self.cache.enabled:
            return []
        t = self.topology
        memo = (tuple(self.live or ()), t.rooms, t.slow, t.slow_rooms, self.cache.version)
        if self._home_memo[0] != memo:
            home = sum(self.serves(k) for k in self.store.keys())
            cached = sum(self.serves(k) for k in self.cache.cached)
            self._home_memo = (memo, home, cached)
        return self.cache.report(*self._home_memo[1:])

    def serves(self, key: ExpertKey) -> bool:
        """Whether this worker is `key`'s home now (only its home keeps an expert cached)."""
        return self.topology.home(key[0], key[1], self.live) == self.index

    def _distance(self, key: ExpertKey) -> float:
        """Layers until `key` is expected to be needed (odmoe.worker.expert_cache.expected_distance)."""
        s, rate = self.schedule, self.cache.use_rate(key)
        return expected_distance(
            key, s.past, s.upcoming, s.predicted_through, self.layer_rank, rate, self.serves(key)
        )

    # -- predictions and preloading ----------------------------------------------------------
    def queue_preloads(self, prediction: Prediction) -> None:
        """Queue this worker's share of a layer's predicted (and hedged) experts (the schedule's
        `predicted`: unless main got there first; a prediction for a step already predicted
        supersedes the earlier one)."""
        step = prediction.step
        self.tracer.instant(
            "load", f"prediction L{step.layer}", iteration=step.iteration, experts=prediction.experts
        )
        try:
            placement = self.topology.decode_placement(
                step.layer, prediction.experts, self.live, step.iteration
            )
            hedged = self.topology.hedge_placement(
                step.layer, prediction.experts, prediction.hedges, self.live, step.iteration
            )
            share: tuple[set[int], set[int]] | None = (
                {e for e, w in placement.items() if w == self.index},
                {e for e, w in hedged.items() if w == self.index},
            )
        except LayerUnavailable:
            share = None
        position = (step.iteration, step.layer)
        self.give_back(self.schedule.predicted(step.request, position, share, self.slots))
        for expert in share[0] if share else ():  # read from disk: the kernel starts now, layers ahead
            if (step.layer, expert) not in self.cache.cached:
                self.store.prefetch((step.layer, expert))

    def preload_next(self) -> None:
        """The schedule's next preload, into a free slot (or the hedge slot it gives back)."""
        load = self.schedule.next_preload(self.slots)
        if load is None:
            return
        if load.evict is not None:
            self.give_back([load.evict])
        slot = self.slots.load_async(load.key, tag=load.tag)
        if load.hedge:
            self.schedule.hedge_loaded(slot.index)

    def finish(self, request: str, position: tuple[int, int]) -> None:
        """main is done with this layer: drop preloads for it and anything earlier."""
        self.give_back(self.schedule.finish(request, position, self.slots))

    def end_request(self, request: str) -> None:
        """A request cancelled or over: nothing it preloaded is wanted."""
        if request == self.schedule.request:
            self.give_back(self.schedule.switch_request("", self.slots))

    def serving(self, step: Step, expert: int) -> None:
        """main asks for (step, expert): earlier layers are over, and this expert needs no preload."""
        position = (step.iteration, step.layer)
        evicted, visit = self.schedule.serving(step.request, position, expert, self.slots)
        self.give_back(evicted)
        if visit:
            self.cache.visit(step.layer)

    def make_room(self) -> None:
        """A compute must load and every slot is busy: give back a hedge, else the latest-needed preload."""
        index = self.schedule.make_room(self.slots)
        if index is not None:
            self.give_back([index])

    def give_back(self, indices: list[int]) -> None:
        """Evict the slots the schedule gave back (by index), in its order."""
        if indices:
            held = {s.index: s for s in self.slots.held()}
            for index in indices:
                self.evict(held[index])

    # -- after a compute ---------------------------------------------------------------------
    def after_use(self, slot: Slot) -> None:
        """A computed expert: kept in the cache when this worker is its home and the policy finds it
        worth more than what it would displace; evicted otherwise (always, without a cache)."""
        key = slot.holds
        if slot.cached:
            return  # it stays
        cached = {s.holds: s for s in self.slots.cached()}
        if not self.cache.enabled or key is None or key in cached or not self.serves(key):
            self.evict(slot, used=True)
            return
        if not self.slots.free_for_cache:
            candidates = [k for k in cached if k not in self.computing]
            victim = self.cache.victim([*candidates, key], self._distance) if candidates else key
            if victim == key:
                self.evict(slot, used=True)
                return
            self.slots.evict(cached[victim])
            self.cache.drop(victim)
        self._account(slot, used=True)
        self.slots.keep(slot)
        self.cache.admit(key)

    def evict(self, slot: Slot, used: bool = False) -> None:
        self._account(slot, used)
        self.slots.evict(slot)

    def _account(self, slot: Slot, used: bool) -> None:
        """A slot's load leaves the just-in-time slots (evicted, or kept as cached): its timeline span
        and, for a hedge, whether it was used."""
        with contextlib.suppress(Exception):  # a failed load: the compute that needed it reported it
            slot.wait_filled()  # its bytes are known once its load is over
        if self.tracer.enabled and slot.holds is not None and slot.load_started_us:
            layer, expert = slot.holds
            self.tracer.span(
                "load",
                f"load L{layer} e{expert}",
                slot.load_started_us,
                slot.load_started_us + slot.load_s * 1e6,
                iteration=slot.tag[1] if slot.tag else None,
                used=used,
            )
        self.schedule.left(slot.index, used, slot.nbytes)


class ExpertExecutor:
    """A worker's expert work, message in, answer out: checks a request, finds or loads its experts
    (through `keeper`), computes them and writes the result. `received` is when the message being
    handled arrived (its result's `handled_s` counts from there); whoever receives sets it."""

    def __init__(self, keeper: SlotKeeper, mlp: ExpertMLP):
        self.keeper = keeper
        # the keeper's own, read on every request
        self.index, self.store, self.slots = keeper.index, keeper.store, keeper.slots
        self.cache, self.schedule, self.tracer = keeper.cache, keeper.schedule, keeper.tracer
        self.mlp = mlp  # what an expert computes
        self.hidden_size = mlp.hidden_size(self.store.gate_up_shape)
        self.on_host = self.slots.device.type == "cpu"  # computes where the rows arrive
        self.stacked = StackedSegments()  # a decode exchange's requests of one expert in one call
        # prefill batches being assembled, by (peer, step, expert): parts by part number
        self.batches: OrderedDict[tuple, dict[int, tuple[torch.Tensor, list[int]]]] = OrderedDict()
        self.received = time.perf_counter()

    # -- what the node drives between requests -------------------------------------------------
    def queue_preloads(self, prediction: Prediction) -> None:
        """The shadow's prediction for a layer: this worker's share is queued for preloading."""
        self.keeper.queue_preloads(prediction)

    def can_preload(self) -> bool:
        """Whether a preload is queued and a slot can take it (the node polls without waiting then)."""
        return self.schedule.can_preload(self.slots)

    def preload_next(self) -> None:
        self.keeper.preload_next()

    def release(self, step: Step) -> None:
        """Main's last call here in a decode layer was answered: drop that layer's unused preloads."""
        self.keeper.finish(step.request, (step.iteration, step.layer))

    def answer(self, message, tensors: list[torch.Tensor], peer: bytes = b"") -> list | None:
        """The frames that answer one message from main, or None (nothing to send). A kind a worker
        does not take from main raises CodecError (the node drops it)."""
        if isinstance(message, ComputeExperts):
            return self.compute(message, tensors, peer)
        if isinstance(message, Release):
            self.release(message.step)
        elif isinstance(message, EndRequest):
            self.keeper.end_request(message.request)
        elif isinstance(message, LiveWorkers):
            self.keeper.set_live(message)
        else:
            raise CodecError(f"worker cannot handle {message.kind}")
        return None

    # -- the one compute path: a decode layer's experts, or one expert of a prefill ------------
    def compute(self, request: ComputeExperts, tensors: list[torch.Tensor], peer: bytes = b"") -> list | None:
        """Each expert of `request` loaded once (preloaded, cached, or now) and evicted after use
        unless the cache keeps it, each segment of its rows computed on its own (the shape it has
        alone: bit-exact), the outputs in one answer. Prefill mini-batches (`parts`) wait for the
        whole batch first; None while a batch is incomplete."""
        step = request.step
        if problem := request_problem(request, tensors, self.hidden_size, self.store.dtype):
            return self._failed(request, problem)
        for expert in request.experts:
            if step.iteration >= 1:  # a prefill call belongs to one request, not to main's decode stream
                self.keeper.serving(step, expert)
            self.tracer.message("compute", "compute", step, expert, sent=False)
        if request.parts > 1:
            return self._compute_part(request, tensors[0], peer)
        tag = (step.request, step.iteration)
        slots = [self.slots.find((step.layer, e), tag) for e in request.experts]
        return self._compute_found(request, tensors, slots, [s is not None for s in slots])

    def _compute_part(self, request: ComputeExperts, rows: torch.Tensor, peer: bytes) -> list | None:
        """One prefill mini-batch of one expert: the expert starts loading when the first part
        arrives (overlapping the rest of the transfer) and, bit-exact by default, is computed once
        every part is in; with `per_part` (opt-in) each part is computed as it comes."""
        step, expert = request.step, request.experts[0]
        key, tag = (step.layer, expert), (step.request, step.iteration)
        slot = self.slots.find(key, tag)
        preloaded = slot is not None and request.part == 0
        if slot is None:
            try:
                self.keeper.make_room()
                slot = self.slots.load_async(key, tag=tag)
            except (KeyError, RuntimeError, ValueError) as exc:  # ValueError: a corrupt stored chunk
                return self._failed(request, str(exc))
        if request.per_part:  # the load counted with the first part, the slot settled after the last
            first, last = request.part == 0, request.part == request.parts - 1
            return self._compute_found(request, [rows], [slot], [preloaded], first, last)
        batch = self._assemble((peer, step, expert), request, rows)
        if batch is None:
            return None
        rows, positions = batch
        whole = replace(request, segments=[[rows.shape[0]]], part=0, parts=1, positions=[positions])
        return self._compute_found(whole, [rows], [slot], [False])

    def _assemble(
        self, key: tuple, request: ComputeExperts, rows: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]] | None:
        """Collect one expert's prefill mini-batches; the whole batch (rows, their positions) once
        every part is in."""
        parts = self.batches.setdefault(key, {})
        parts[request.part] = (rows, request.positions[0] if request.positions else [])
        if len(parts) < request.parts:
            while len(self.batches) > MAX_OPEN_BATCHES:  # parts that will never complete (a lost main)
                self.batches.popitem(last=False)
            return None
        del self.batches[key]
        return joined_parts(parts)

    def _compute_found(
        self,
        request: ComputeExperts,
        tensors: list[torch.Tensor],
        slots: list[Slot | None],
        preloaded: list[bool],
        first: bool = True,
        last: bool = True,
    ) -> list:
        """`request`'s experts, `slots` what was found for them (None: to load). `first`: this call
        counts their loads; `last`: their slots are settled after it (a per-part mini-batch's)."""
        step, n = request.step, len(request.experts)
        tag = (step.request, step.iteration)
        hits = [s is not None and s.cached for s in slots]
        # cached experts of this message stay until computed, whatever the others' admissions drop
        self.keeper.computing = {(step.layer, e) for e, hit in zip(request.experts, hits, strict=True) if hit}
        # Misses load in the background (free slots permitting) while something else computes: the
        # preloaded experts, else the first miss, loaded here first (a lone miss gains nothing from a
        # hand-off to the loader thread, which costs a wake-up). Whatever finds no free slot now
        # loads when its turn comes, after the ones before it are computed and evicted.
        misses = [i for i in range(n) if slots[i] is None]
        try:
            if misses and len(misses) == n:
                self.keeper.make_room()
                slots[misses[0]] = self.slots.load((step.layer, request.experts[misses[0]]), tag=tag)
            for i in misses:
                if slots[i] is None and self.slots.free:
                    slots[i] = self.slots.load_async((step.layer, request.experts[i]), tag=tag)
        except Exception as exc:  # a store without the expert, a corrupt chunk: say so to main
            for i in misses:
                if slots[i] is not None:
                    self.slots.evict(slots[i])
            self.keeper.computing = set()
            return self._failed(request, f"loading failed: {exc}")
        # preloaded first, then the ones loading, then the ones still to load
        order = sorted(range(n), key=lambda i: (not preloaded[i], slots[i] is None))
        try:
            return self._compute_in_order(request, tensors, order, slots, preloaded, hits, first, last)
        finally:
            self.keeper.computing = set()

    def _compute_in_order(self, request, tensors, order, slots, preloaded, hits, first, last) -> list:
        step, tag, n = request.step, (request.step.request, request.step.iteration), len(request.experts)
        outputs: list[torch.Tensor | None] = [None] * n
        load_s, compute_s, nbytes, waited, saved = [0.0] * n, [0.0] * n, [0] * n, [0.0] * n, [0] * n
        for turn, i in enumerate(order):
            arrived = time.perf_counter()
            try:
                if slots[i] is None:
                    self.keeper.make_room()
                    slots[i] = self.slots.load((step.layer, request.experts[i]), tag=tag)
                slots[i].wait_filled()
            except Exception as exc:  # a store without the expert, a corrupt chunk: say so to main
                for j in order[turn:]:  # those before were computed and have left already
                    if slots[j] is not None and not slots[j].cached:
                        self.slots.evict(slots[j])
                return self._failed(request, f"loading failed: {exc}")
            waited[i] = time.perf_counter() - arrived
            try:
                outputs[i], compute_s[i], device_wait = self._compute_segments(
                    request, i, slots[i], tensors[i], preloaded[i], waited[i]
                )
                waited[i] += device_wait
                if first:  # count a load once, and none for a cached expert
                    if hits[i]:
                        saved[i] = slots[i].nbytes
                    else:
                        load_s[i], nbytes[i] = slots[i].load_s, slots[i].nbytes
                    if self.cache.enabled:
                        key = (step.layer, request.experts[i])
                        self.cache.used(key, hits[i], saved[i], decode=step.iteration >= 1)
            finally:
                self.keeper.computing.discard((step.layer, request.experts[i]))
                if last:
                    self.keeper.after_use(slots[i])
        result = self._result(request, (load_s, compute_s, nbytes, preloaded, waited, saved))
        for expert in request.experts:
            self.tracer.message("compute", "result", step, expert, sent=True)
        return to_frames(result, outputs)

    def _compute_segments(
        self, request: ComputeExperts, i: int, slot: Slot, rows: torch.Tensor, preloaded: bool, waited: float
    ) -> tuple[torch.Tensor, float, float]:
        """Expert `request.experts[i]` on each request's segment of `rows` as its own call computes it
        (StackedSegments: in one call where that is proven bit-exact, else apart): output, compute s,
        and how long the compute waited on the device for the load (CUDA); the slot settled (the
        load's duration by CUDA events), its span traced."""
        step, segments = request.step, request.segments[i]
        start, start_us = time.perf_counter(), now_us()
        with torch.inference_mode():
            probe = self.slots.await_on_device(slot)  # CUDA: compute waits for the copy on the GPU
            grouped = tuple(request.grouped_shape) or None
            positions = request.positions[i] if request.positions else None
            y = self.stacked.forward(
                self._on_device(rows),
                segments,
                slot.gate_up,
                slot.down,
                self.mlp,
                request.kernel,
                grouped,
                positions or None,
            )
            y = y if self.on_host else y.cpu()
        device_wait_s = self.slots.device_wait_s(slot, probe)
        self.slots.settle(slot)
        compute_s = time.perf_counter() - start - device_wait_s
        if self.tracer.enabled:
            self.tracer.span(
                "compute",
                f"compute L{step.layer} e{request.experts[i]}",
                start_us,
                start_us + compute_s * 1e6,
                iteration=step.iteration,
                waited_ms=(waited + device_wait_s) * 1e3,
                rows=rows.shape[0],
                requests=len(segments),
                preloaded=preloaded,
            )
        return y, compute_s, device_wait_s

    def _on_device(self, rows: torch.Tensor) -> torch.Tensor:
        # on the host, skip even a no-op .to(): each torch call costs a woken process tens of µs
        return rows if self.on_host else rows.to(self.slots.device)

    # -- results -----------------------------------------------------------------------------
    def _failed(self, request: ComputeExperts, error: str) -> list:
        """An error answer (no rows): main raises WorkerFailed with `error`."""
        return to_frames(self._result(request, error=error), [])

    def _result(
        self, request: ComputeExperts, columns: tuple | None = None, error: str = ""
    ) -> ExpertsResult:
        """The answer: `columns` holds each expert's load_s, compute_s, bytes loaded, preloaded,
        waited_s and cached bytes (None: an error answer, no experts)."""
        load_s, compute_s, nbytes, preloaded, waited, cached = columns or ([], [], [], [], [], [])
        return ExpertsResult(
            step=request.step,
            worker=self.index,
            experts=list(request.experts),
            load_s=load_s,
            compute_s=compute_s,
            bytes_loaded=nbytes,
            preloaded=preloaded,
            waited_s=waited,
            peak_rss=_PEAK(),
            error=error,
            hedges=self.schedule.hedges_of(request.step.request),
            device_peak_bytes=device_peak_bytes(self.slots.device),
            handled_s=time.perf_counter() - self.received,
            cached=cached,
            cache=self.keeper.cache_report(),
            part=request.part if request.per_part else 0,
        )
