"""The worker node: loads experts just in time and computes them over ZeroMQ.

Lifecycle: read this worker's experts from the checkpoint into host memory, bind a ROUTER socket
(main's requests), announce readiness, then serve until told to shut down. Main's first ping names
the shadow's prediction address; the worker then also subscribes to its own group's predictions.

The node is the socket loop; what it does with experts (store, slots, cache, preload schedule,
compute) is odmoe.worker.executor's `ExpertExecutor`, which takes each decoded message and gives back
the frames to send, with no socket of its own.

Per decode layer (paper §3.1): a prediction for a layer of this worker's group is dealt to the
group's workers by the shared round-robin rule; this worker preloads its share into a free device
slot, earliest (iteration, layer) first. What to preload when, and which loads to give back, is
decided by odmoe.worker.preload_schedule (pure); the executor applies those decisions. A compute request then
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

import torch
import zmq

from odmoe.config import OdmoeConfig, WorkerConfig, emulation_of, fault_of
from odmoe.lossy.substitution import profile_path, use_rates
from odmoe.memory_plan import CheckpointSizes, MemoryPlanError, WorkerSetup, worker_memories
from odmoe.models.checkpoint import Checkpoint
from odmoe.models.expert_math import expert_mlp
from odmoe.models.load_dtypes import expert_dtype
from odmoe.models.main_model import resolve_dtype
from odmoe.models.open_model import open_checkpoint
from odmoe.node_memory import NodeMemory, node_memory
from odmoe.nodes.ready import announce_ready
from odmoe.placement import Topology, prediction_topics
from odmoe.tools.faults import FaultTrigger
from odmoe.tools.memory import parse_bytes, peak_rss_bytes
from odmoe.tools.trace import Tracer
from odmoe.transport.announce import announce
from odmoe.transport.beats import echo_for
from odmoe.transport.codec import CodecError
from odmoe.transport.dropped import DropLog
from odmoe.transport.messages import (
    ComputeExperts,
    LiveWorkers,
    Ping,
    Pong,
    Prediction,
    from_frames,
    to_frames,
)
from odmoe.transport.security import NodeSecurity, secure_client, secure_server
from odmoe.worker.device_slots import device_peak_bytes
from odmoe.worker.executor import ExpertExecutor, SlotKeeper
from odmoe.worker.expert_cache import CacheBook, cache_capacity
from odmoe.worker.expert_store import DeviceSlots, ExpertStore, Link, ResidentExperts
from odmoe.worker.share import ShareLayout, plan_share

log = logging.getLogger("odmoe.worker")


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


def _cache_prior(w: WorkerConfig, index: int, model_path: str, capacity: int) -> dict:
    """odmoe-profile's use rate per expert for the cache's eviction, when there is one to use."""
    if not capacity or w.cache_policy != "prediction" or w.cache_profile == "off":
        return {}
    path = profile_path(model_path, w.cache_profile)
    rates = use_rates(path)
    if rates:
        log.info("worker %d: the cache starts from %s's use rates", index, path)
    elif w.cache_profile:  # named, so expected to be there
        log.warning("worker %d: worker.cache_profile=%s: no profile there; online counts only", index, path)
    return rates


def _share(
    cfg: OdmoeConfig,
    topology: Topology,
    memory: NodeMemory,
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    layers: list[int],
    device: torch.device,
) -> ShareLayout:
    """What this worker holds in memory (odmoe.worker.share), from its memory figure and its
    peers' as far as it knows them, before anything is read. Its cache's room (what main deals
    homes by: odmoe.placement) is `worker.cache` in experts: on a CPU, auto is what its memory
    leaves; elsewhere a size, all, or free device memory less a margin."""
    w, c = cfg.worker, cfg.cluster
    sizes = CheckpointSizes.of(checkpoint, dtype)
    stored = [(layer, e) for layer in layers for e in range(checkpoint.num_experts)]
    setup = WorkerSetup(
        c.workers,
        c.group_size,
        w.store,
        topology.homes,
        w.slots,
        w.only_own_layers,
        w.replicas,
        parse_bytes(w.host_memory),
    )
    memories = worker_memories(c.workers, (memory.bytes, memory.source), c.node_memory, parse_bytes)
    room = cache_capacity(w.cache, sizes.expert_bytes, len(stored), lambda: _free_device_bytes(device))
    resident = emulation_of(cfg).resident
    quantized = bool(checkpoint.quantized_experts)
    return plan_share(
        w.index, setup, sizes, topology, stored, memories, w.cache, device.type, quantized, resident, room
    )


def _stored_layers(index: int, topology: Topology, layers: list[int]) -> list[int]:
    """The MoE layers this worker stores (its group's, or every layer: worker.only_own_layers)."""
    stored = topology.stored_layers(index, layers)
    if not stored:
        raise ValueError(
            f"worker {index} would hold no experts: with worker.only_own_layers its group stores "
            f"only its own layers, and the model has {len(layers)} MoE layer(s) for "
            f"{topology.groups} groups; use at most {len(layers)} group(s) (cluster.workers / "
            "cluster.group_size) or worker.only_own_layers=false"
        )
    return stored


def _store(
    w: WorkerConfig,
    checkpoint: Checkpoint,
    layers: list[int],
    dtype: torch.dtype,
    layout: ShareLayout,
    pin: bool,
) -> ExpertStore:
    """The experts of `layers` as `worker.store` keeps them (`pin`: page-locked, for asynchronous
    host-to-device copies), logged with the time the read took."""
    start = time.perf_counter()
    store = ExpertStore.build(
        checkpoint,
        layers,
        dtype,
        w.store,
        parse_bytes(w.host_memory),
        w.pack_dir,
        w.decompress_threads,
        pin_memory=pin,
        held=layout.held,
        forget_read=layout.cache_is_store and w.store == "memory",  # read once into the cache: drop the pages
    )
    elapsed = time.perf_counter() - start
    log.info(
        "worker %d: %d layers, store=%s: %s (%.1fs)", w.index, len(layers), w.store, store.describe(), elapsed
    )
    return store


def _slots(cfg: OdmoeConfig, store: ExpertStore, device: torch.device, capacity: int, ready: int):
    """Where experts are computed: `worker.slots` device slots plus the cache's buffers (`ready` of
    them allocated now), or every expert resident (the baseline)."""
    emulation = emulation_of(cfg)  # the lab overlay's (lab=on); all off in the product's schema
    if emulation.resident:
        log.info("worker %d: every expert resident on %s (a baseline, not OD-MoE)", cfg.worker.index, device)
        return ResidentExperts(store, device)
    link = Link(emulation.link.bandwidth_gbps, emulation.link.latency_ms)
    if link.enabled:
        log.info(
            "worker %d: emulated link %.2f Gbit/s + %.3f ms per load",
            cfg.worker.index,
            link.bandwidth_gbps,
            link.latency_ms,
        )
    return DeviceSlots(store, device, cfg.worker.slots, link, cache=capacity, allocate=ready)


def build_executor(
    cfg: OdmoeConfig, model_path: str, memory: NodeMemory
) -> tuple[ExpertExecutor, ShareLayout, tuple[int, float]]:
    """This worker's experts as its settings and memory say: the store read, the device slots and
    the cache made, its share read into the cache where the cache is the store. Returns the executor,
    the share's layout and (bytes, seconds) of the share read at start."""
    w, index = cfg.worker, cfg.worker.index
    checkpoint = open_checkpoint(model_path)
    topology = cfg.topology.for_model(checkpoint.moe_layers, checkpoint.num_experts)
    # The experts' dtype as from_pretrained would load them (not always model.dtype: load_dtypes).
    dtype = expert_dtype(checkpoint.config, resolve_dtype(cfg.model.dtype, checkpoint))
    layers = _stored_layers(index, topology, checkpoint.moe_layers)
    device, resident = compute_device(w.device), emulation_of(cfg).resident
    layout = _share(cfg, topology, memory, checkpoint, dtype, layers, device)
    log.info("worker %d: memory %s; %s", index, memory.describe(), layout.need.holds)
    if layout.strict and not layout.need.fits:
        raise MemoryPlanError(layout.need.refusal())
    store = _store(w, checkpoint, layers, dtype, layout, pin=device.type == "cuda" and not resident)
    capacity = 0 if resident else layout.room
    cache = CacheBook(capacity, w.cache_policy, prior=_cache_prior(w, index, model_path, capacity))
    slots = _slots(cfg, store, device, capacity, ready=min(capacity, len(layout.home)))
    layer_rank = {layer: i for i, layer in enumerate(checkpoint.moe_layers)}  # main's order of decode layers
    tracer = Tracer(f"worker{index}", cfg.trace_dir)
    keeper = SlotKeeper(index, topology, store, slots, cache, layer_rank, tracer)
    share_read = keeper.warm(layout.home[:capacity]) if layout.cache_is_store else (0, 0.0)
    if capacity:
        log.info("worker %d: cache of %d experts (%s, policy %s)", index, capacity, w.cache, w.cache_policy)
    mlp = expert_mlp(checkpoint.config, checkpoint.family.expert_layout)  # what an expert computes
    return ExpertExecutor(keeper, mlp), layout, share_read


class WorkerNode:
    """The socket loop around an `ExpertExecutor`: binds, admits main's key, follows the shadow's
    predictions, decodes each message, hands it to the executor, sends the answer."""

    def __init__(self, cfg: OdmoeConfig, model_path: str):
        self.memory = node_memory(cfg.node.memory)  # what this node may use: told to main in its Pong
        self.executor, self.layout, self.share_read = build_executor(cfg, model_path, self.memory)
        self.cluster = cfg.cluster
        index = cfg.worker.index
        sec = cfg.security
        self.security = NodeSecurity.load(sec.enabled, sec.key_dir, sec.node_name("worker", index))
        self.sock: zmq.Socket | None = None  # main's requests: bound by start()
        self.address = ""
        self.predictions: zmq.Socket | None = None
        self.shadow_pub = ""
        self.poller = zmq.Poller()
        self.fault = FaultTrigger(fault_of(cfg), f"worker{index}")
        self.dropped = DropLog(log, f"worker {index}")

    def start(self) -> None:
        """Bind main's socket (main's key only, where security is on) and answer main's UDP beats on
        its port: what the constructor, which only builds, leaves to the node's start."""
        c = self.cluster
        ctx = zmq.Context.instance()
        self.zap = self.security.curve.authenticator(ctx) if self.security.curve else None
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_server(self.sock, self.security.curve, "worker")
        port = c.worker_port
        if port:
            self.sock.bind(f"tcp://{c.host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{c.host}")
        self.address = f"tcp://{c.host}:{port}"
        self.beat_echo = echo_for(self.address)  # main's beats: UDP, this port number (a thread)
        self.poller.register(self.sock, zmq.POLLIN)

    def close(self) -> None:
        """Close main's socket (tests that started a node in their own process)."""
        if self.sock is not None:
            self.sock.close(0)

    def _subscribe(self, address: str) -> None:
        """Follow the shadow's predictions at `address` (again, when the shadow moved)."""
        if address == self.shadow_pub or not address or isinstance(self.executor.slots, ResidentExperts):
            return
        if self.predictions is not None:
            self.poller.unregister(self.predictions)
            self.predictions.close(0)
        self.shadow_pub = address
        self.predictions = zmq.Context.instance().socket(zmq.SUB)
        self.predictions.setsockopt(zmq.LINGER, 0)
        secure_client(self.predictions, self.security.curve, "shadow")
        for group in prediction_topics(self.executor.keeper.topology, self.executor.index):
            self.predictions.setsockopt(zmq.SUBSCRIBE, f"g{group}".encode())
        self.predictions.connect(address)
        self.poller.register(self.predictions, zmq.POLLIN)

    def serve(self, ready_file: str | None = None) -> None:
        if self.sock is None:
            self.start()
        index, executor = self.executor.index, self.executor
        announce_ready(
            ready_file,
            role="worker",
            index=index,
            address=self.address,
            read_bytes=self.share_read[0],
            read_s=self.share_read[1],
        )
        c = self.cluster
        announce(
            c.main_addresses,
            "worker",
            self.address,
            index=index,
            where=c.where,
            credentials=self.security.client,
        )
        log.info("worker %d serving on %s", index, self.address)
        try:
            while True:
                can_preload = executor.can_preload()
                ready = dict(self.poller.poll(0 if can_preload else 1000))
                if self.sock in ready:  # main's requests first: they are on the critical path
                    self._serve_request()
                elif self.predictions is not None and self.predictions in ready:
                    self._guarded(self._take_prediction)
                elif can_preload:
                    self._guarded(executor.preload_next)
                elif not ready:
                    executor.tracer.flush()  # idle: a good moment to write the timeline out
        finally:
            executor.tracer.flush()
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
        self.executor.received = time.perf_counter()  # a result's handled_s counts from here
        try:
            message, tensors = from_frames(frames)
        except CodecError as exc:
            self.dropped.drop(exc)
            return
        reply = self._guarded(self.handle, message, tensors, peer.bytes)
        if reply is not None:  # a mini-batch that only completes a batch gets no answer of its own
            self.sock.send_multipart([peer, *reply], copy=False)
        if isinstance(message, ComputeExperts) and message.release:  # main's last call here
            self._guarded(self.executor.release, message.step)

    def handle(self, message, tensors: list[torch.Tensor], peer: bytes = b"") -> list | None:
        """One message from main: a Ping is answered here (this node's figures), the rest by the
        executor, a compute after the fault plan had its say."""
        if isinstance(message, Ping):
            self._subscribe(message.shadow_pub)
            return to_frames(self._pong())
        if isinstance(message, ComputeExperts):
            step = message.step
            self.fault.at(step.request, step.iteration, step.layer, message.part)
        answer = self.executor.answer(message, tensors, peer)
        if isinstance(message, LiveWorkers):
            self._subscribe(message.shadow_pub)
        return answer

    def _pong(self) -> Pong:
        ex = self.executor
        link = ex.slots.link
        emulated = [link.bandwidth_gbps, link.latency_ms] if link.enabled else []
        return Pong(
            ex.index,
            ex.store.layers,
            ex.store.nbytes,
            peak_rss_bytes(),
            emulated,
            ex.slots.device_bytes,
            self.cluster.where,
            device_peak_bytes(ex.slots.device),
            ex.cache.capacity,
            self.memory.bytes,
            self.memory.source,
            self.layout.strict and ex.keeper.topology.homes,
        )

    def _take_prediction(self) -> None:
        _topic, *frames = self.predictions.recv_multipart(copy=False)
        prediction, _ = from_frames(frames)
        if isinstance(prediction, Prediction):
            self.executor.queue_preloads(prediction)
