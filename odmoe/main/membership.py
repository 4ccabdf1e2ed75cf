"""Main's view of its workers: who is alive, the socket to each, and how a lost one comes back.

Contract (failure detection, see heartbeat.py for why heartbeats): every worker connection is a
heartbeated DEALER. `wait(timeout)` returns what arrived and which workers were lost meanwhile; a
lost worker's socket is closed at once, so its queued sends are dropped and a late answer from it
can never arrive (calls are also named by step and expert, so nothing is ever combined twice).
`mark_lost` is how RemoteExperts' per-call deadline (a process whose I/O thread lives but whose
Python is stuck) reaches the same verdict. With a `BeatWatch` (odmoe/transport/beats.py) every live
worker is also beaten over UDP and judged by a phi-accrual suspicion: a worker whose link drops
everything while its process lives is lost within ~1 s, while a lossy, jittery link (whose TCP
retransmissions can hold the heartbeats back for seconds) is not; the heartbeat's timeout is then
the backstop for a TCP path that breaks while UDP passes.

Coming back: `maintain()` (between requests and while idle) re-pings each lost worker's last
address every `probe_interval_s` (a worker restarted on the same address, or resumed after a
freeze) and any address announced with `join` (the only method safe from other threads: a worker
restarted elsewhere announces itself through main's gRPC Join). A candidate is admitted only when
its Pong says it is that worker index and stores every layer the topology gives it; then every
live worker gets the new `LiveWorkers` message, so predictions are dealt over the same live set main places
by. Everything else runs on main's engine thread (ZeroMQ sockets are not thread-safe).
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

import zmq

from odmoe.placement import LayerUnavailable, Topology
from odmoe.tools.trace import now_us
from odmoe.transport.beats import BeatWatch
from odmoe.transport.codec import CodecError
from odmoe.transport.heartbeat import Heartbeat, WatchedSocket
from odmoe.transport.messages import LiveWorkers, Ping, Pong, from_frames, to_frames
from odmoe.transport.security import Curve

log = logging.getLogger("odmoe.main.membership")


class WorkerUnavailable(RuntimeError):
    """A worker did not answer in time (dead, unreachable or overloaded), or no live worker holds
    what a request needs."""


@dataclass
class _Probe:
    """A connection to where a lost worker may be back, with one Ping queued on it."""

    index: int
    link: WatchedSocket
    since: float = field(default_factory=time.monotonic)


@dataclass
class MembershipEvent:
    worker: int
    event: str  # "lost" | "rejoined" | "refused"
    at_us: float
    reason: str = ""


def _pong(frames) -> Pong | None:
    """The Pong in `frames`, or None for anything else (frames from a worker are not trusted)."""
    try:
        message, _ = from_frames(frames)
    except CodecError:
        return None
    return message if isinstance(message, Pong) else None


def enough_to_start(topology: Topology, layers: list[int], pongs: dict[int, Pong], minimum: int) -> bool:
    """Start-up may end: every worker answered, or (with `minimum`, cluster.min_workers) at least
    `minimum` did and every layer has one that holds it."""
    if len(pongs) == topology.workers:
        return True
    if not minimum or len(pongs) < minimum:
        return False
    return all(topology.holders(layer, pongs) for layer in layers)


class Membership:
    def __init__(
        self,
        addresses: list[str],
        topology: Topology,
        layers: list[int],
        heartbeat: Heartbeat | None = None,
        probe_interval_s: float = 1.0,
        curve: Curve | None = None,
        homes_by_room: bool = True,
    ):
        if len(addresses) != topology.workers:
            raise ValueError(f"{len(addresses)} worker addresses for {topology.workers} workers")
        self.topology, self.layers, self.heartbeat = topology, layers, heartbeat or Heartbeat()
        self.probe_interval_s, self.curve = probe_interval_s, curve
        self.homes_by_room = homes_by_room  # cluster.homes: deal homes by the workers' cache rooms
        self.beats: BeatWatch | None = None  # owned, from connect(): closed with the membership
        self.ctx = zmq.Context.instance()
        self.addresses = list(addresses)
        self.links: dict[int, WatchedSocket] = {}  # connect() makes them
        self.pongs: dict[int, Pong] = {}
        self.probes: dict[int, _Probe] = {}
        self.announced: queue.Queue[tuple[int, str]] = queue.Queue()
        self.events: list[MembershipEvent] = []
        self.refusals: dict[int, str] = {}  # worker -> why its last CURVE handshake failed
        self.shadow_pub = ""
        self._poller: zmq.Poller | None = None  # None: the live set changed, rebuilt at the next wait
        self._by_socket: dict[zmq.Socket, tuple[int, bool]] = {}  # socket -> (worker, is monitor)
        self._beat_verdicts: dict[int, str] = {}  # worker -> why the beats say it is lost

    def connect(self, beats: BeatWatch | None = None) -> None:
        """The network start (the constructor only builds): a connection to every worker whose
        address is known ("" where not yet: a box that will join by the link), and the UDP `beats`
        that judge them (None: heartbeats alone)."""
        self.beats = beats
        self.links = {i: self._connect(i, a) for i, a in enumerate(self.addresses) if a}
        self._poller = None

    # -- who is alive ------------------------------------------------------------------------
    @property
    def live(self) -> frozenset[int]:
        return frozenset(self.links)

    def _connect(self, worker: int, address: str) -> WatchedSocket:
        # No send high-water mark: a full queue would make a send block or fail, and a slow worker
        # must never look dead. Main sends only what it then waits for, so the queue stays bounded.
        # With security on, only the holder of worker<i>'s key completes the CURVE handshake.
        return WatchedSocket(
            self.ctx,
            zmq.DEALER,
            address,
            self.heartbeat,
            sndhwm=0,
            curve=self.curve,
            server=f"worker{worker}",
        )

    def serving(self, layer: int) -> list[int]:
        """The live workers that serve `layer` now ([] where none does)."""
        try:
            return self.topology.serving_group(layer, self.live)
        except LayerUnavailable:
            return []

    def send(self, worker: int, frames: list, copy: bool = True) -> bool:
        """Send to a live worker (never blocks); False, and nothing sent, when it is not live."""
        link = self.links.get(worker)
        if link is None:
            return False
        link.sock.send_multipart(frames, copy=copy)
        return True

    def mark_lost(self, worker: int, reason: str) -> None:
        link = self.links.pop(worker, None)
        if link is None:
            return
        link.close()
        if self.beats is not None:
            self.beats.forget(f"worker{worker}")
        self.pongs.pop(worker, None)
        self._poller = None
        self.events.append(MembershipEvent(worker, "lost", now_us(), reason))
        log.warning("worker %d (%s) lost: %s; live: %s", worker, link.address, reason, sorted(self.links))

    def wait(self, timeout_ms: int) -> tuple[list[tuple[int, list]], list[int]]:
        """Block up to timeout_ms for answers or losses: ([(worker, frames)], [workers lost])."""
        received, lost = [], []
        for sock, _ in (self._poller or self._rebuild_poller()).poll(max(timeout_ms, 0)):
            if self.beats is not None and sock == self.beats.fileno():
                lost += [w for w in self._beats_lost() if w not in lost]
                continue
            worker, is_monitor = self._by_socket[sock]
            link = self.links.get(worker)
            if link is None:
                continue
            if is_monitor:
                if link.lost():
                    lost.append(worker)
                    if link.refused:
                        self.refusals[worker] = (
                            f"worker {worker} ({link.address}) failed the CURVE handshake: {link.refused}; "
                            f"give that box the cluster's private/worker{worker}.key_secret and public/"
                        )
                    else:
                        self.refusals.pop(worker, None)
                continue
            received.append((worker, link.sock.recv_multipart(copy=False)))
        for worker in lost:
            if worker in self._beat_verdicts:
                self.mark_lost(worker, self._beat_verdicts.pop(worker))
            else:
                self.mark_lost(worker, self.refusals.get(worker) or "connection lost (heartbeat or reset)")
        return received, lost

    def _beats_lost(self) -> list[int]:
        """Live workers the beats say are lost (their reasons kept for mark_lost)."""
        assert self.beats is not None
        found = []
        for name in self.beats.take_lost():
            worker = int(name.removeprefix("worker"))
            if worker in self.links:
                self._beat_verdicts[worker] = self.beats.why(name)
                found.append(worker)
        return found

    def _rebuild_poller(self) -> zmq.Poller:
        self._poller, self._by_socket = zmq.Poller(), {}
        for worker, link in self.links.items():
            for sock, is_monitor in ((link.sock, False), (link.monitor, True)):
                self._poller.register(sock, zmq.POLLIN)
                self._by_socket[sock] = (worker, is_monitor)
        if self.beats is not None:
            self._poller.register(self.beats.fileno(), zmq.POLLIN)
        return self._poller

    # -- start-up ------------------------------------------------------------------------------
    def ping_all(self, timeout_s: float, shadow_pub: str, minimum: int = 0) -> list[Pong]:
        """Every configured worker must be up and be what its address says (start-up only).
        With `minimum` (cluster.min_workers), that many suffice once every layer has one that holds
        it: the others are left to `maintain`, which takes each in when it answers (growth).

        Raises WorkerUnavailable naming the workers that stay silent or are misconfigured. Returns
        the Pongs of the workers that answered, by index."""
        self.shadow_pub = shadow_pub
        for worker in self.links:
            self.send(worker, to_frames(Ping(shadow_pub=shadow_pub)))
        deadline = time.monotonic() + timeout_s
        while not enough_to_start(self.topology, self.layers, self.pongs, minimum):
            received, lost = self.wait(int((deadline - time.monotonic()) * 1000))
            if refused := [w for w in lost if w in self.refusals]:
                raise WorkerUnavailable(self.refusals[refused[0]])
            if lost and not minimum:
                raise WorkerUnavailable(f"worker(s) {lost} dropped the connection while starting")
            if not received and time.monotonic() >= deadline:
                silent = [i for i in range(self.topology.workers) if i not in self.pongs]
                more = (
                    f" (cluster.min_workers={minimum} needs {minimum} and every layer held)"
                    if minimum
                    else ""
                )
                raise WorkerUnavailable(
                    f"worker(s) {silent} did not answer a ping within {timeout_s:.0f}s{more}"
                )
            for worker, frames in received:
                pong = _pong(frames)
                if pong is not None:
                    if problem := self._verify(worker, pong):
                        raise WorkerUnavailable(problem)
                    self.pongs[worker] = pong
                    if self.beats is not None:
                        self.beats.watch(f"worker{worker}", self.addresses[worker])
        for worker in [w for w in self.links if w not in self.pongs]:  # not up yet: probed from now on
            link = self.links.pop(worker)
            link.close()
            self._poller = None
            log.info(
                "worker %d is not up yet: main serves without it and takes it in when it answers", worker
            )
        self.broadcast()
        return [self.pongs[i] for i in sorted(self.pongs)]

    def _verify(self, worker: int, pong: Pong) -> str:
        address = self.addresses[worker]
        if pong.worker != worker:
            return f"{address} answers as worker {pong.worker}, expected worker {worker}"
        if missing := sorted(set(self.topology.stored_layers(worker, self.layers)) - set(pong.layers)):
            return f"worker {worker} ({address}) does not hold layers {missing}"
        return ""

    # -- coming back ---------------------------------------------------------------------------
    def join(self, worker: int, address: str) -> None:
        """A worker announces it serves at `address` (any thread). Checked by `maintain`."""
        self.announced.put((worker, address))

    def maintain(self) -> bool:
        """Notice losses while idle (so /health tells the truth between requests), probe lost workers,
        admit the ones that prove themselves. True when `live` changed."""
        changed = False
        for worker, link in list(self.links.items()):
            if link.lost():
                self.mark_lost(worker, "connection lost while idle (heartbeat or reset)")
        if self.beats is not None:
            for worker in self._beats_lost():
                self.mark_lost(worker, self._beat_verdicts.pop(worker))
        while not self.announced.empty():  # filled by other threads, emptied only here
            worker, address = self.announced.get_nowait()
            if not 0 <= worker < self.topology.workers:
                log.warning("ignoring an announcement from %s as worker %d: no such index", address, worker)
                continue
            self.addresses[worker] = address
            if worker not in self.links:
                self._probe(worker)
        for worker in range(self.topology.workers):
            if worker in self.links or not self.addresses[worker]:  # "": where it serves is not known yet
                continue
            probe = self.probes.get(worker) or self._probe(worker)
            if self._admit(probe):
                changed = True
            elif time.monotonic() - probe.since > self.probe_interval_s:
                self._probe(worker)  # a fresh connection and Ping: the old one may have been dropped
        if changed:
            self.broadcast()
        return changed

    def _probe(self, worker: int) -> _Probe:
        old = self.probes.pop(worker, None)
        if old is not None:
            old.link.close()
        link = self._connect(worker, self.addresses[worker])
        link.sock.send_multipart(to_frames(Ping(shadow_pub=self.shadow_pub)))  # queued until it connects
        probe = self.probes[worker] = _Probe(worker, link)
        return probe

    def _admit(self, probe: _Probe) -> bool:
        link = probe.link
        while link.sock.poll(0):
            pong = _pong(link.sock.recv_multipart(copy=False))
            if pong is None:
                continue
            if problem := self._verify(probe.index, pong):
                self.events.append(MembershipEvent(probe.index, "refused", now_us(), problem))
                log.warning("not taking worker %d back: %s", probe.index, problem)
                link.close()
                del self.probes[probe.index]
                return False
            del self.probes[probe.index]
            link.lost()  # drain the connect events of the probe
            self.links[probe.index], self.pongs[probe.index] = link, pong
            if self.beats is not None:
                self.beats.watch(f"worker{probe.index}", self.addresses[probe.index])
            self._poller = None
            self.events.append(MembershipEvent(probe.index, "rejoined", now_us(), link.address))
            log.info("worker %d (%s) is back; live: %s", probe.index, link.address, sorted(self.links))
            return True
        return False

    def broadcast(self, shadow_pub: str | None = None) -> None:
        """Tell every live worker who is live (and where predictions come from)."""
        if shadow_pub is not None:
            self.shadow_pub = shadow_pub
        rooms = self.rooms() if self.homes_by_room else []
        if self.topology.homes and rooms:
            self.topology = self.topology.with_rooms(rooms)  # main places by the rooms it tells
        t = self.topology
        message = to_frames(
            LiveWorkers(
                sorted(self.links), self.shadow_pub, rooms, list(t.slow), t.probe_every, list(t.slow_rooms)
            )
        )
        for worker in list(self.links):
            self.send(worker, message)

    def steer(self, slow: frozenset[int], probe_every: int, slow_rooms: list[int] | None = None) -> None:
        """From now on decode work is steered away from the stragglers `slow` (odmoe.main.stragglers;
        with homes, each is home for at most its `slow_rooms` entry, in sorted order): main places
        by it, and every live worker is told, so its preloads and its cache agree."""
        self.topology = self.topology.with_slow(slow, probe_every, slow_rooms or ())
        log.warning(
            "stragglers now %s%s: decode work steered to their groups' other workers (probed every %d "
            "iterations)",
            sorted(slow) or "none",
            f" (homes dealt by rooms {slow_rooms})" if slow_rooms else "",
            probe_every,
        )
        self.broadcast()

    def rooms(self) -> list[int]:
        """Every worker's cache room from its last Pong ([] until every worker has answered once)."""
        if len(self.pongs) < self.topology.workers:
            return []
        return [self.pongs[w].cache_room for w in range(self.topology.workers)]

    def close(self) -> None:
        for link in [*self.links.values(), *(p.link for p in self.probes.values())]:
            link.close()
        self.links, self.probes = {}, {}
        if self.beats is not None:
            self.beats.close()
