"""The worker node: loads experts just in time and computes them over ZeroMQ.

Lifecycle: read this worker's experts from the checkpoint into host memory, bind a ROUTER socket
(main's requests), announce readiness, then serve until told to shut down. Main's first ping names
the shadow's prediction address; the worker then also subscribes to its own group's predictions.

Per decode layer (paper §3.1): a prediction for a layer of this worker's group is dealt to the
group's workers by the shared round-robin rule; this worker preloads its share into a free device
slot, earliest (iteration, layer) first. What to preload when, and which loads to give back, is
decided by odmoe.worker.preload_schedule (pure); this node applies those decisions. A compute request then
finds the expert already loaded (a hit) or loads it on demand (a miss: the stall the shadow exists
to avoid). After computing, the expert is evicted: no cache (the paper's). With `worker.cache` the
worker keeps the experts it is home for (odmoe.placement) on its device after use, up to the
cache's bound, and when one more is to be kept than fits, its policy drops one (odmoe.worker.expert_cache:
by the shadow's pending predictions, or LRU); a cached expert is computed without a load, whatever
request asks. Preloads the request did not use are dropped when main releases the layer: its last
call to this worker in a decode layer carries `release` (handled once the answer is sent, off
main's critical path), and a worker of the group that got no call gets a Release
message. The result is the same either way; only time differs.

A failure inside one request (an expert it does not hold, rows of the wrong shape) is answered
with an error result instead of killing the process, so main can report it with the worker named.
Every incoming frame is untrusted: one that does not decode, or whose handling fails, is dropped
with a rate-limited log line and the worker goes on serving (`DropLog`).

Failover: main tells every live worker who is live (`LiveWorkers`); the worker deals predictions
over those workers by main's own rule, and subscribes to the prediction topics of every group
whose layers it stores (it may serve them when their own group is lost). With
`cluster.main_addresses` set it announces itself to main on start, so a worker restarted on
another port is taken back. Main's UDP beats are echoed on this worker's port number, by a thread
of its own (odmoe/transport/beats.py): busy in torch, it still answers; frozen or cut off, it does not.

Security (odmoe/transport/security.py, on by default): the ROUTER is a CURVE server admitting only
main's key (a ZAP authenticator thread; another worker's or the shadow's key is refused too), and
the prediction SUB talks only to the key "shadow"; a peer without the key never completes a
handshake, so none of its frames reach here.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch
import zmq

from odmoe.config import OdmoeConfig
from odmoe.lossy.substitution import profile_path, use_rates
from odmoe.memory_plan import CheckpointSizes, MemoryPlanError, WorkerSetup, worker_memories
from odmoe.models.checkpoint import Checkpoint
from odmoe.models.expert_math import KERNELS, expert_forward, expert_mlp
from odmoe.models.load_dtypes import expert_dtype
from odmoe.models.main_model import resolve_dtype
from odmoe.models.open_model import open_checkpoint
from odmoe.node_memory import node_memory
from odmoe.nodes.ready import announce_ready
from odmoe.placement import LayerUnavailable
from odmoe.tools.faults import FaultTrigger
from odmoe.tools.memory import parse_bytes, peak_rss_bytes
from odmoe.tools.trace import Tracer, now_us
from odmoe.transport.announce import announce
from odmoe.transport.beats import echo_for
from odmoe.transport.codec import CodecError
from odmoe.transport.dropped import DropLog
from odmoe.transport.messages import (
    ComputeExpert,
    ComputeExperts,
    EndRequest,
    ExpertResult,
    ExpertsResult,
    LiveWorkers,
    Ping,
    Pong,
    Prediction,
    Release,
    from_frames,
    to_frames,
)
from odmoe.transport.security import NodeSecurity, secure_client, secure_server
from odmoe.worker.device_slots import device_peak_bytes
from odmoe.worker.expert_cache import CacheBook, cache_capacity, expected_distance
from odmoe.worker.expert_store import DeviceSlots, ExpertStore, Link, LoadCounters, ResidentExperts, Slot
from odmoe.worker.preload_schedule import PreloadSchedule
from odmoe.worker.share import ShareLayout, plan_share
from odmoe.worker.stacked_segments import StackedSegments

log = logging.getLogger("odmoe.worker")
MAX_OPEN_BATCHES = 64  # prefill batches still missing parts; beyond this the oldest is dropped
MAX_GROUPED_ROWS = 1 << 20  # a grouped_shape beyond this is refused (it sizes an allocation)
MAX_GROUPS = 1023  # PyTorch's grouped_mm takes fewer than 1024 groups
# Reading its share at start, the kernel is asked for this many experts ahead (posix_fadvise WILLNEED):
# 466 against 172 MiB/s read with none, on this project's virtio disk (4 ahead beat 16: 355 MiB/s)
WARM_AHEAD = 4


def _free_device_bytes(device: torch.device) -> int:
    """What a cache of `worker.cache=auto` may take: free GPU memory, or available host memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def compute_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class WorkerNode:
    def __init__(self, cfg: OdmoeConfig, model_path: str):
        self.index = cfg.worker.index
        checkpoint = open_checkpoint(model_path)
        self.topology = cfg.topology.for_model(checkpoint.moe_layers, checkpoint.num_experts)
        self.mlp = expert_mlp(checkpoint.config, checkpoint.family.expert_layout)  # what an expert computes
        # The experts' dtype as from_pretrained would load them (not always model.dtype: load_dtypes).
        dtype = expert_dtype(checkpoint.config, resolve_dtype(cfg.model.dtype, checkpoint))
        layers = checkpoint.moe_layers
        self.layer_rank = {layer: i for i, layer in enumerate(layers)}  # main's order of decode layers
        moe_layers = len(layers)
        layers = self.topology.stored_layers(self.index, layers)
        if not layers:
            raise ValueError(
                f"worker {self.index} would hold no experts: with worker.only_own_layers its group stores "
                f"only its own layers, and the model has {moe_layers} MoE layer(s) for "
                f"{self.topology.groups} groups; use at most {moe_layers} group(s) (cluster.workers / "
                "cluster.group_size) or worker.only_own_layers=false"
            )
        start = time.perf_counter()
        w = cfg.worker
        device = compute_device(cfg.worker.device)
        self.resident = cfg.emulation.resident
        self.memory = node_memory(cfg.node.memory)  # what this node may use: told to main in its Pong
        self.layout = self._share(cfg, checkpoint, dtype, layers, device)
        log.info("worker %d: memory %s; %s", self.index, self.memory.describe(), self.layout.need.holds)
        if self.layout.strict and not self.layout.need.fits:
            raise MemoryPlanError(self.layout.need.refusal())
        cache_is_store = self.layout.cache_is_store
        self.store = ExpertStore.build(
            checkpoint,
            layers,
            dtype,
            w.store,
            parse_bytes(w.host_memory),
            w.pack_dir,
            w.decompress_threads,
            pin_memory=device.type == "cuda" and not self.resident,  # async host-to-device copies
            held=self.layout.held,
            forget_read=cache_is_store and w.store == "memory",  # read once into the cache: drop the pages
        )
        log.info(
            "worker %d: %d layers, store=%s: %s (%.1fs)",
            self.index,
            len(layers),
            w.store,
            self.store.describe(),
            time.perf_counter() - start,
        )
        link = Link(cfg.emulation.link.bandwidth_gbps, cfg.emulation.link.latency_ms)
        self.on_host = device.type == "cpu"  # computes where the rows arrive
        self.live: list[int] | None = None  # None until main says: every worker
        capacity = 0 if self.resident else self.layout.room
        ready = min(capacity, len(self.layout.home))
        self.cache = CacheBook(capacity, w.cache_policy, prior=self._cache_prior(w, model_path, capacity))
        self.slots = (
            ResidentExperts(self.store, device)
            if self.resident
            else DeviceSlots(self.store, device, cfg.worker.slots, link, cache=capacity, allocate=ready)
        )
        self.share_read = (0, 0.0)  # (bytes, seconds) of its share read at start (the ready file's)
        if cache_is_store:
            self.share_read = self._warm(self.layout.home[:capacity])
        if capacity:
            log.info(
                "worker %d: cache of %d experts (%s, policy %s)",
                self.index,
                capacity,
                w.cache,
                w.cache_policy,
            )
        if self.resident:
            log.info("worker %d: every expert resident on %s (a baseline, not OD-MoE)", self.index, device)
        elif link.enabled:
            log.info(
                "worker %d: emulated link %.2f Gbit/s + %.3f ms per load",
                self.index,
                link.bandwidth_gbps,
                link.latency_ms,
            )
        self.ctx = zmq.Context.instance()
        sec = cfg.security
        self.security = NodeSecurity.load(sec.enabled, sec.key_dir, sec.node_name("worker", self.index))
        self.zap = self.security.curve.authenticator(self.ctx) if self.security.curve else None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_server(self.sock, self.security.curve, "worker")  # main's key only
        port = cfg.cluster.worker_port
        if port:
            self.sock.bind(f"tcp://{cfg.cluster.host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{cfg.cluster.host}")
        self.address = f"tcp://{cfg.cluster.host}:{port}"
        self.beat_echo = echo_for(self.address)  # main's beats: UDP, this port number (a thread)
        self.main_addresses = cfg.cluster.main_addresses
        self.where = cfg.cluster.where
        self.predictions: zmq.Socket | None = None
        self.shadow_pub = ""
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        # what to preload, in what order, and what to give back; this node applies its decisions
        self.schedule = PreloadSchedule(self.store, for_cache=self.cache.enabled)
        self._computing: set[tuple[int, int]] = set()  # cached experts a message is about to compute
        self._home_memo: tuple = (None, 0, 0)  # (live, cache version) -> home, home cached
        # prefill batches being assembled, by (peer, step, expert): parts by part number
        self.batches: OrderedDict[tuple, dict[int, torch.Tensor]] = OrderedDict()
        self.hidden_size = self.mlp.hidden_size(self.store.gate_up_shape)
        self.tracer = Tracer(f"worker{self.index}", cfg.trace_dir)
        self.stacked = StackedSegments()  # a decode exchange's requests of one expert in one call
        self.fault = FaultTrigger(cfg.fault, f"worker{self.index}")
        self.dropped = DropLog(log, f"worker {self.index}")
        self.received = time.perf_counter()  # when the message being handled arrived

    def _cache_prior(self, w, model_path: str, capacity: int) -> dict:
        """odmoe-profile's use rate per expert for the cache's eviction, when there is one to use."""
        if not capacity or w.cache_policy != "prediction" or w.cache_profile == "off":
            return {}
        path = profile_path(model_path, w.cache_profile)
        rates = use_rates(path)
        if rates:
            log.info("worker %d: the cache starts from %s's use rates", self.index, path)
        elif w.cache_profile:  # named, so expected to be there
            log.warning(
                "worker %d: worker.cache_profile=%s: no profile there; online counts only", self.index, path
            )
        return rates

    def _share(
        self, cfg: OdmoeConfig, checkpoint: Checkpoint, dtype, layers: list[int], device
    ) -> ShareLayout:
        """What this worker holds in memory (odmoe.worker.share), from its memory figure and its
        peers' as far as it knows them, before anything is read. Its cache's room (what main deals
        homes by: odmoe.placement) is `worker.cache` in experts: on a CPU, auto is what its memory
        leaves; elsewhere a size, all, or free device memory less a margin."""
        w, c, own = cfg.worker, cfg.cluster, self.memory
        sizes = CheckpointSizes.of(checkpoint, dtype)
        stored = [(layer, e) for layer in layers for e in range(checkpoint.num_experts)]
        setup = WorkerSetup(
            c.workers,
            c.group_size,
            w.store,
            self.topology.homes,
            w.slots,
            w.only_own_layers,
            w.replicas,
            parse_bytes(w.host_memory),
        )
        memories = worker_memories(c.workers, (own.bytes, own.source), c.node_memory, parse_bytes)
        room = cache_capacity(w.cache, sizes.expert_bytes, len(stored), lambda: _free_device_bytes(device))
        return plan_share(
            self.index,
            setup,
            sizes,
            self.topology,
            stored,
            memories,
            w.cache,
            device.type,
            bool(checkpoint.quantized_experts),
            self.resident,
            room,
        )

    def _warm(self, keys: tuple[tuple[int, int], ...]) -> tuple[int, float]:
        """Read the experts this worker is home for into its cache before serving (a CPU worker's
        cache is where they rest), logging progress on a long read; returns (bytes, seconds)."""
        total = len(keys) * self._expert_bytes()
        start = last = time.perf_counter()
        done = 0
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
                log.info(
                    "worker %d: read %.0f of %.0f MiB of its share (%.0f %%, %.0f MiB/s)",
                    self.index,
                    done / 2**20,
                    total / 2**20,
                    100 * done / max(total, 1),
                    done / 2**20 / (now - start),
                )
        self.slots.counters = LoadCounters()  # reading its share is not a load any request made
        elapsed = time.perf_counter() - start
        if keys:
            log.info(
                "worker %d: its share read: %d experts, %.0f MiB in %.1fs (%.0f MiB/s)",
                self.index,
                len(keys),
                done / 2**20,
                elapsed,
                done / 2**20 / max(elapsed, 1e-9),
            )
        return done, elapsed

    def _expert_bytes(self) -> int:
        elements = self.store.gate_up_shape.numel() + self.store.down_shape.numel()
        return elements * self.store.dtype.itemsize

    def _cache_report(self) -> list[int]:
        """CacheBook.report with the experts this worker is home for now, and of them cached (counted
        again only when the live workers or the cache's contents changed)."""
        if not self.cache.enabled:
            return []
        t = self.topology
        memo = (tuple(self.live or ()), t.rooms, t.slow, t.slow_rooms, self.cache.version)
        if self._home_memo[0] != memo:
            home = sum(self._serves(k) for k in self.store.keys())
            cached = sum(self._serves(k) for k in self.cache.cached)
            self._home_memo = (memo, home, cached)
        return self.cache.report(*self._home_memo[1:])

    def _serves(self, key: tuple[int, int]) -> bool:
        """Whether this worker is `key`'s home now (only its home keeps an expert cached)."""
        return self.topology.home(key[0], key[1], self.live) == self.index

    def _distance(self, key: tuple[int, int]) -> float:
        """Layers until `key` is expected to be needed (odmoe.worker.expert_cache.expected_distance)."""
        s, rate = self.schedule, self.cache.use_rate(key)
        return expected_distance(
            key, s.past, s.upcoming, s.predicted_through, self.layer_rank, rate, self._serves(key)
        )

    def _subscribe(self, address: str) -> None:
        """Follow the shadow's predictions at `address` (again, when the shadow moved)."""
        if address == self.shadow_pub or not address or self.resident:
            return
        if self.predictions is not None:
            self.poller.unregister(self.predictions)
            self.predictions.close(0)
        self.shadow_pub = address
        self.predictions = self.ctx.socket(zmq.SUB)
        self.predictions.setsockopt(zmq.LINGER, 0)
        secure_client(self.predictions, self.security.curve, "shadow")
        for group in self.topology.prediction_topics(self.index):
            self.predictions.setsockopt(zmq.SUBSCRIBE, f"g{group}".encode())
        self.predictions.connect(address)
        self.poller.register(self.predictions, zmq.POLLIN)

    def serve(self, ready_file: str | None = None) -> None:
        announce_ready(
            ready_file,
            role="worker",
            index=self.index,
            address=self.address,
            read_bytes=self.share_read[0],
            read_s=self.share_read[1],
        )
        announce(
            self.main_addresses,
            "worker",
            self.address,
            index=self.index,
            where=self.where,
            credentials=self.security.client,
        )
        log.info("worker %d serving on %s", self.index, self.address)
        try:
            while True:
                can_preload = self.schedule.can_preload(self.slots)
                ready = dict(self.poller.poll(0 if can_preload else 1000))
                if self.sock in ready:  # main's requests first: they are on the critical path
                    self._serve_request()
                elif self.predictions is not None and self.predictions in ready:
                    self._guarded(self._take_prediction)
                elif can_preload:
                    self._guarded(self._preload_next)
                elif not ready:
                    self.tracer.flush()  # idle: a good moment to write the timeline out
        finally:
            self.tracer.flush()
            if self.beat_echo is not None:
                self.beat_echo.close()
            self.sock.close(0)
            if self.predictions is not None:
                self.predictions.close(0)

    def _guarded(self, handler, *args):
        """Run one message's handler; whatever it raises drops that message, never the worker."""
        try:
            return handler(*args)
        except Exception as exc:
            self.dropped.drop(f"{type(exc).__name__}: {exc}")
            return None

    def _serve_request(self) -> None:
        peer, *frames = self.sock.recv_multipart(copy=False)
        self.received = time.perf_counter()  # a result's handled_s counts from here
        try:
            message, tensors = from_frames(frames)
        except CodecError as exc:
            self.dropped.drop(exc)
            return
        reply = self._guarded(self.handle, message, tensors, peer.bytes)
        if reply is not None:  # a mini-batch that only completes a batch gets no answer of its own
            self.sock.send_multipart([peer, *reply], copy=False)
        if isinstance(message, ComputeExpert | ComputeExperts) and message.release:  # main's last call here
            step = message.step
            self._guarded(self._finish, step.request, (step.iteration, step.layer))

    def handle(self, message, tensors: list[torch.Tensor], peer: bytes = b"") -> list | None:
        if isinstance(message, Release):
            self._finish(message.step.request, (message.step.iteration, message.step.layer))
            return None
        if isinstance(message, EndRequest):
            if message.request == self.schedule.request:  # cancelled or over: nothing it preloaded is wanted
                self._give_back(self.schedule.switch_request("", self.slots))
            return None
        if isinstance(message, LiveWorkers):
            self.live = sorted(w for w in message.live if 0 <= w < self.topology.workers)
            if self.topology.homes and len(message.rooms) == self.topology.workers:
                self.topology = self.topology.with_rooms(message.rooms)  # homes as main deals them
            # the stragglers main steers away from: predictions dealt as main will place them
            self.topology = self.topology.with_slow(message.slow, message.probe_every, message.slow_rooms)
            self._subscribe(message.shadow_pub)
            return None
        if isinstance(message, Ping):
            self._subscribe(message.shadow_pub)
            link = self.slots.link
            emulated = [link.bandwidth_gbps, link.latency_ms] if link.enabled else []
            pong = Pong(
                self.index,
                self.store.layers,
                self.store.nbytes,
                peak_rss_bytes(),
                emulated,
                self.slots.device_bytes,
                self.where,
                device_peak_bytes(self.slots.device),
                self.cache.capacity,
                self.memory.bytes,
                self.memory.source,
                self.layout.strict and self.topology.homes,
            )
            return to_frames(pong)
        if isinstance(message, ComputeExpert):
            self.fault.at(message.step.request, message.step.iteration, message.step.layer, message.part)
            return self.compute(message, tensors[0], peer)
        if isinstance(message, ComputeExperts):
            self.fault.at(message.step.request, message.step.iteration, message.step.layer)
            return self.compute_many(message, tensors)
        raise CodecError(f"worker cannot handle {message.kind}")

    # -- predictions and preloading ----------------------------------------------------------
    def _take_prediction(self) -> None:
        _topic, *frames = self.predictions.recv_multipart(copy=False)
        prediction, _ = from_frames(frames)
        if isinstance(prediction, Prediction):
            self.queue_preloads(prediction)

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
        self._give_back(self.schedule.predicted(step.request, position, share, self.slots))
        for expert in share[0] if share else ():  # read from disk: the kernel starts now, layers ahead
            if (step.layer, expert) not in self.cache.cached:
                self.store.prefetch((step.layer, expert))

    def _preload_next(self) -> None:
        """The schedule's next preload, into a free slot (or the hedge slot it gives back)."""
        load = self.schedule.next_preload(self.slots)
        if load is None:
            return
        if load.evict is not None:
            self._give_back([load.evict])
        slot = self.slots.load_async(load.key, tag=load.tag)
        if load.hedge:
            self.schedule.hedge_loaded(slot.index)

    def _finish(self, request: str, position: tuple[int, int]) -> None:
        """main is done with this layer: drop preloads for it and anything earlier."""
        self._give_back(self.schedule.finish(request, position, self.slots))

    def _serving(self, step, expert: int) -> None:
        """main asks for (step, expert): earlier layers are over, and this expert needs no preload."""
        position = (step.iteration, step.layer)
        evicted, visit = self.schedule.serving(step.request, position, expert, self.slots)
        self._give_back(evicted)
        if visit:
            self.cache.visit(step.layer)

    def _make_room(self) -> None:
        """A compute must load and every slot is busy: give back a hedge, else the latest-needed preload."""
        index = self.schedule.make_room(self.slots)
        if index is not None:
            self._give_back([index])

    def _give_back(self, indices: list[int]) -> None:
        """Evict the slots the schedule gave back (by index), in its order."""
        if indices:
            held = {s.index: s for s in self.slots.held()}
            for index in indices:
                self._evict(held[index])

    def _after_use(self, slot: Slot) -> None:
        """A computed expert: kept in the cache when this worker is its home and the policy finds it
        worth more than what it would displace; evicted otherwise (always, without a cache)."""
        key = slot.holds
        if slot.cached:
            return  # it stays
        cached = {s.holds: s for s in self.slots.cached()}
        if not self.cache.enabled or key is None or key in cached or not self._serves(key):
            self._evict(slot, used=True)
            return
        if not self.slots.free_for_cache:
            candidates = [k for k in cached if k not in self._computing]
            victim = self.cache.victim([*candidates, key], self._distance) if candidates else key
            if victim == key:
                self._evict(slot, used=True)
                return
            self.slots.evict(cached[victim])
            self.cache.drop(victim)
        self._account(slot, used=True)
        self.slots.keep(slot)
        self.cache.admit(key)

    def _evict(self, slot: Slot, used: bool = False) -> None:
        self._account(slot, used)
        self.slots.evict(slot)

    def _account(self, slot: Slot, used: bool) -> None:
        """A slot's load leaves the just-in-time slots (evicted, or kept as cached): its timeline span
        and, for a hedge, whether it was used."""
        try:
            slot.wait_filled()  # its bytes are known once its load is over
        except Exception:
            pass  # a failed load: the compute that needed it reported the error
        if self.tracer.enabled and slot.holds is not None and slot.load_started_us:
            slot.wait_filled()
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

    # -- computing ---------------------------------------------------------------------------
    def compute(self, request: ComputeExpert, hidden: torch.Tensor, peer: bytes = b"") -> list | None:
        """Rows in one message, or prefill mini-batches: the expert loads when the first part arrives
        (overlapping the rest of the transfer) and, bit-exact by default, computes once all are in."""
        step = request.step
        if problem := self._check(request, hidden):
            return to_frames(self._result(request, 0.0, 0.0, 0, error=problem), [hidden[:0]])
        key, tag = (step.layer, request.expert), (step.request, step.iteration)
        if step.iteration >= 1:  # a prefill call belongs to one request, not to main's decode stream
            self._serving(step, request.expert)
        self.tracer.message("compute", "compute", step, request.expert, sent=False)
        slot = self.slots.find(key, tag)
        preloaded = slot is not None and request.part == 0
        hit = slot is not None and slot.cached
        arrived = time.perf_counter()
        if slot is None:
            try:
                self._make_room()
                # The first of several mini-batches loads in the background while the rest arrive.
                load = self.slots.load_async if request.parts > 1 else self.slots.load
                slot = load(key, tag=tag)
            except (KeyError, RuntimeError, ValueError) as exc:  # ValueError: a corrupt stored chunk
                return to_frames(self._result(request, 0.0, 0.0, 0, error=str(exc)), [hidden[:0]])
        last, positions = True, request.positions
        if request.parts > 1 and not request.per_part:
            assembled = self._assemble((peer, step, request.expert), request, hidden)
            if assembled is None:
                return None
            hidden, positions = assembled
        else:
            last = request.part == request.parts - 1
        try:
            slot.wait_filled()
        except Exception as exc:  # the background load failed (e.g. a corrupt chunk): say so to main
            self.slots.evict(slot)
            return to_frames(self._result(request, 0.0, 0.0, 0, error=f"loading failed: {exc}"), [hidden[:0]])
        waited_s = time.perf_counter() - arrived  # this message waited on the expert's load
        try:
            start, start_us = time.perf_counter(), now_us()
            with torch.inference_mode():
                probe = self.slots.await_on_device(slot)  # CUDA: compute waits for the copy on the GPU
                y = expert_forward(
                    self._on_device(hidden),
                    slot.gate_up,
                    slot.down,
                    self.mlp,
                    request.kernel,
                    tuple(request.grouped_shape) or None,
                    positions or None,
                )
                y = y if self.on_host else y.cpu()
            device_wait_s = self.slots.device_wait_s(slot, probe)
            self.slots.settle(slot)  # CUDA: the load's duration by CUDA events
            compute_s = time.perf_counter() - start - device_wait_s
            waited_s += device_wait_s
            if self.tracer.enabled:
                self.tracer.span(
                    "compute",
                    f"compute L{step.layer} e{request.expert}",
                    start_us,
                    start_us + compute_s * 1e6,
                    iteration=step.iteration,
                    rows=hidden.shape[0],
                    preloaded=preloaded,
                    waited_ms=waited_s * 1e3,
                )
            first = request.part == 0 or not request.per_part
            # count a load once, and none for a cached expert
            load_s, nbytes = (slot.load_s, slot.nbytes) if first and not hit else (0.0, 0)
            saved = slot.nbytes if first and hit else 0
            if first and self.cache.enabled:
                self.cache.used(key, hit, saved, decode=step.iteration >= 1)
        finally:
            if last:
                self._after_use(slot)
        result = self._result(
            request, load_s, compute_s, nbytes, preloaded=preloaded, waited_s=waited_s, cached=saved
        )
        self.tracer.message("compute", "result", step, request.expert, sent=True)
        return to_frames(result, [y])

    def compute_many(self, request: ComputeExperts, tensors: list[torch.Tensor]) -> list:
        """One decode layer's experts for every running request, in one message: each expert loaded
        once (preloaded, or now) and evicted after use, each request's segment of its rows computed
        on its own (the shape it has alone: bit-exact), the outputs in one answer."""
        step = request.step
        if problem := self._check_many(request, tensors):
            return to_frames(self._many_result(request, error=problem), [])
        for expert in request.experts:
            self._serving(step, expert)
        tag, n = (step.request, step.iteration), len(request.experts)
        slots = [self.slots.find((step.layer, e), tag) for e in request.experts]
        preloaded = [s is not None for s in slots]
        hits = [s is not None and s.cached for s in slots]
        # cached experts of this message stay until computed, whatever the others' admissions drop
        self._computing = {(step.layer, e) for e, hit in zip(request.experts, hits, strict=True) if hit}
        # Misses load in the background (free slots permitting) while something else computes: the
        # preloaded experts, else the first miss, loaded here first (a lone miss gains nothing from a
        # hand-off to the loader thread, which costs a wake-up). Whatever finds no free slot now
        # loads when its turn comes, after the ones before it are computed and evicted.
        misses = [i for i in range(n) if not preloaded[i]]
        try:
            if misses and len(misses) == n:
                self._make_room()
                slots[misses[0]] = self.slots.load((step.layer, request.experts[misses[0]]), tag=tag)
            for i in misses:
                if slots[i] is None and self.slots.free:
                    slots[i] = self.slots.load_async((step.layer, request.experts[i]), tag=tag)
        except Exception as exc:  # a store without the expert, a corrupt chunk: say so to main
            for slot, was_there in zip(slots, preloaded, strict=True):
                if slot is not None and not was_there:
                    self.slots.evict(slot)
            return to_frames(self._many_result(request, error=f"loading failed: {exc}"), [])
        # preloaded first, then the ones loading, then the ones still to load
        order = sorted(range(n), key=lambda i: (not preloaded[i], slots[i] is None))
        outputs: list[torch.Tensor | None] = [None] * n
        try:
            return self._compute_in_order(request, tensors, order, slots, preloaded, hits, outputs)
        finally:
            self._computing = set()

    def _compute_in_order(self, request, tensors, order, slots, preloaded, hits, outputs) -> list:
        step, tag, n = request.step, (request.step.request, request.step.iteration), len(request.experts)
        load_s, compute_s, nbytes, waited, saved = [0.0] * n, [0.0] * n, [0] * n, [0.0] * n, [0] * n
        for turn, i in enumerate(order):
            arrived = time.perf_counter()
            try:
                if slots[i] is None:
                    self._make_room()
                    slots[i] = self.slots.load((step.layer, request.experts[i]), tag=tag)
                slots[i].wait_filled()
            except Exception as exc:  # a store without the expert, a corrupt chunk: say so to main
                for j in order[turn:]:  # those before were computed and have left already
                    if slots[j] is not None and not slots[j].cached:
                        self.slots.evict(slots[j])
                return to_frames(self._many_result(request, error=f"loading failed: {exc}"), [])
            waited[i] = time.perf_counter() - arrived
            try:
                outputs[i], compute_s[i], device_wait = self._compute_segments(
                    request, i, slots[i], tensors[i], preloaded[i], waited[i]
                )
                waited[i] += device_wait
                if hits[i]:
                    saved[i] = slots[i].nbytes
                else:
                    load_s[i], nbytes[i] = slots[i].load_s, slots[i].nbytes
                if self.cache.enabled:
                    self.cache.used((step.layer, request.experts[i]), hits[i], saved[i])
            finally:
                self._computing.discard((step.layer, request.experts[i]))
                self._after_use(slots[i])
        result = self._many_result(request, load_s, compute_s, nbytes, preloaded, waited, cached=saved)
        return to_frames(result, outputs)

    def _compute_segments(
        self, request: ComputeExperts, i: int, slot: Slot, rows: torch.Tensor, preloaded: bool, waited: float
    ) -> tuple[torch.Tensor, float, float]:
        """Expert `request.experts[i]` on each request's segment of `rows` as its own call computes it
        (StackedSegments: in one call where that is proven bit-exact, else apart): output, compute s,
        and how long the compute waited on the device for the load (CUDA)."""
        step = request.step
        start, start_us = time.perf_counter(), now_us()
        with torch.inference_mode():
            probe = self.slots.await_on_device(slot)
            grouped = tuple(request.grouped_shape) or None
            segments = request.segments[i]
            y = self.stacked.forward(
                self._on_device(rows), segments, slot.gate_up, slot.down, self.mlp, request.kernel, grouped
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
                rows=rows.shape[0],
                requests=len(segments),
                preloaded=preloaded,
                waited_ms=(waited + device_wait_s) * 1e3,
            )
        return y, compute_s, device_wait_s

    def _check_many(self, request: ComputeExperts, tensors: list[torch.Tensor]) -> str:
        """What is wrong with a ComputeExperts, or "" (an untrusted peer may send anything)."""
        n = len(request.experts)
        if not n or len(tensors) != n or len(request.segments) != n or len(set(request.experts)) != n:
            return f"{n} experts, {len(request.segments)} segment lists, {len(tensors)} tensors"
        for expert, segments, rows in zip(request.experts, request.segments, tensors, strict=True):
            one = ComputeExpert(request.step, expert, request.kernel, grouped_shape=request.grouped_shape)
            if problem := self._check(one, rows):
                return problem
            if not segments or any(s < 1 for s in segments) or sum(segments) != rows.shape[0]:
                return (
                    f"segments {segments!r:.40} do not add up to the {rows.shape[0]} rows of expert {expert}"
                )
        return ""

    def _many_result(
        self,
        request: ComputeExperts,
        load_s=(),
        compute_s=(),
        nbytes=(),
        preloaded=(),
        waited=(),
        error="",
        cached=(),
    ):
        n = 0 if error else len(request.experts)
        return ExpertsResult(
            step=request.step,
            worker=self.index,
            experts=list(request.experts),
            load_s=list(load_s) or [0.0] * n,
            compute_s=list(compute_s) or [0.0] * n,
            bytes_loaded=list(nbytes) or [0] * n,
            preloaded=list(preloaded) or [False] * n,
            waited_s=list(waited) or [0.0] * n,
            peak_rss=peak_rss_bytes(),
            error=error,
            hedges=self.schedule.hedges_of(request.step.request),
            device_peak_bytes=device_peak_bytes(self.slots.device),
            handled_s=time.perf_counter() - self.received,
            cached=list(cached) or [0] * n,
            cache=self._cache_report(),
        )

    def _on_device(self, rows: torch.Tensor) -> torch.Tensor:
        # on the host, skip even a no-op .to(): each torch call costs a woken process tens of µs
        return rows if self.on_host else rows.to(self.slots.device)

    def _check(self, request: ComputeExpert, hidden: torch.Tensor) -> str:
        """What is wrong with a compute request, or "" (an untrusted peer may send anything)."""
        if request.kernel not in KERNELS:
            return f"unknown experts kernel {request.kernel!r:.40}"
        if not 0 <= request.part < request.parts:
            return f"part {request.part} of {request.parts}"
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            return f"rows of shape {list(hidden.shape)}, expected [n, {self.hidden_size}]"
        if hidden.dtype != self.store.dtype:
            return f"rows of {hidden.dtype}, the experts are {self.store.dtype}"
        shape = request.grouped_shape
        if shape and (
            len(shape) != 2 or not (1 <= shape[0] <= MAX_GROUPED_ROWS and 1 <= shape[1] <= MAX_GROUPS)
        ):
            return f"grouped_shape {shape!r:.40} is not [rows <= {MAX_GROUPED_ROWS}, experts <= {MAX_GROUPS}]"
        if request.positions:
            return request.positions_problem(hidden.shape[0])
        return ""

    def _assemble(
        self, key: tuple, request: ComputeExpert, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]] | None:
        """Collect one expert's prefill mini-batches; the whole batch (rows, their positions) once
        every part is in."""
        parts = self.batches.setdefault(key, {})
        parts[request.part] = (hidden, request.positions)
        if len(parts) < request.parts:
            while len(self.batches) > MAX_OPEN_BATCHES:  # parts that will never complete (a lost main)
                self.batches.popitem(last=False)
            return None
        del self.batches[key]
        return ComputeExpert.joined(parts)

    def _result(
        self,
        request: ComputeExpert,
        load_s: float,
        compute_s: float,
        nbytes: int,
        error: str = "",
        preloaded: bool = False,
        waited_s: float = 0.0,
        cached: int = 0,
    ):
        return ExpertResult(
            step=request.step,
            expert=request.expert,
            worker=self.index,
            load_s=load_s,
            compute_s=compute_s,
            bytes_loaded=nbytes,
            peak_rss=peak_rss_bytes(),
            error=error,
            preloaded=preloaded,
            waited_s=waited_s,
            part=request.part if request.per_part else 0,
            hedges=self.schedule.hedges_of(request.step.request),
            device_peak_bytes=device_peak_bytes(self.slots.device),
            handled_s=time.perf_counter() - self.received,
            cached=cached,
            cache=self._cache_report(),
        )
