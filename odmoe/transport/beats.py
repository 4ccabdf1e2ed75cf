"""Beats: main asks each peer "are you there?" over UDP every `interval_s`; suspicion decides.

Contract: a worker or the shadow runs a `BeatEcho` on the UDP port with the number of its own TCP
port (`echo_for(address)`); it answers every beat datagram with the same bytes, on a thread of its
own. Main's `BeatWatch` sends beats to the peers it `watch`es, feeds each answer to that peer's
`Suspicion` (odmoe/transport/suspicion.py) and, when one is lost, queues its name for `take_lost()`
and makes `fileno()` readable, so a zmq.Poller wakes at once. A lost peer is still asked; when its
answers come again it is queued for `take_back()` with a fresh Suspicion (who uses that is up to
the caller: main takes a worker back only through its TCP probe and Pong, the shadow link on the
beat alone).

Why UDP, beside ZeroMQ's own heartbeats (odmoe/transport/heartbeat.py): on TCP one lost segment
holds everything behind it for a retransmission timeout (200 ms, then 400, 800...), so a
fixed-gap detector on a lossy link either waits seconds or declares live peers lost. Datagrams are
independent: at 5 % loss eight in a row must vanish before a live peer is suspected, and a black
hole is declared within ~0.9 s (the Suspicion's bound). ZeroMQ's heartbeats stay, with a longer
timeout (failover.heartbeat_timeout_s), for what beats cannot see: a TCP path that is broken while
UDP passes. Why a thread: libzmq's heartbeats are answered off the GIL; the echo and the watch are
threads that block in recvfrom/select (GIL released), so a peer busy in torch still answers in
milliseconds, and a frozen process (SIGSTOP) stops answering like a dead link.

A peer that never answers (a firewall that drops UDP, an older node) is never suspected by beats —
its loss is noticed by ZeroMQ's heartbeats alone — and is named once in the log. Beats carry a
random 64-bit nonce of this watch: answers without it (another main, a forger off the path) are
dropped. The echo answers only datagrams of the beat's exact size and magic, one for one, so it
cannot amplify traffic. Beats are not encrypted: they say nothing but "alive", and a forged one
can only delay a detection to the heartbeat's timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from odmoe.transport.suspicion import Suspicion, SuspicionSettings

log = logging.getLogger("odmoe.transport.beats")

MAGIC = b"odmB"
_BEAT = struct.Struct("!4sQIQ")  # magic, watch nonce, peer slot, sequence number
SILENT_NAMED_AFTER_S = 5.0  # a peer that never answered by then is named in the log


def host_port(address: str) -> tuple[str, int]:
    """("10.0.0.3", 5555) from "tcp://10.0.0.3:5555" (IPv6 hosts in brackets)."""
    rest = address.split("://", 1)[-1]
    host, _, port = rest.rpartition(":")
    return host.strip("[]"), int(port)


class BeatEcho:
    """A node's answer to beats: UDP on `host:port`, every beat echoed from a thread of its own."""

    def __init__(self, host: str, port: int):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="beat-echo", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(64)
            except OSError:  # closed
                return
            if len(data) == _BEAT.size and data.startswith(MAGIC):
                with contextlib.suppress(OSError):  # unreachable now: the next beat will tell
                    self.sock.sendto(data, peer)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes recvfrom
        self.sock.close()


def echo_for(address: str) -> BeatEcho | None:
    """The echo for a node listening on TCP `address`: same host, same port number, UDP. None
    (and a log line) when that port is taken: main then notices this node's loss by heartbeats."""
    host, port = host_port(address)
    try:
        return BeatEcho("" if host in ("*", "0.0.0.0") else host, port)
    except OSError as exc:
        log.warning("no beat echo on udp %s:%d (%s): losses are noticed by heartbeats alone", host, port, exc)
        return None


@dataclass
class _Peer:
    name: str
    where: tuple[str, int]
    suspicion: Suspicion
    lost: bool = False
    since: float = field(default_factory=time.monotonic)
    answered: bool = False
    named_silent: bool = False


class BeatWatch:
    def __init__(self, settings: SuspicionSettings | None = None):
        self.settings = settings or SuspicionSettings()
        self.settings.check()
        self.nonce = int.from_bytes(os.urandom(8), "big")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("", 0))
        self._lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}  # slot -> peer; a slot is never reused
        self._slots: dict[str, int] = {}
        self._next_slot = 0
        self._lost: list[str] = []
        self._back: list[str] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = threading.Event()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="beat-watch", daemon=True)
        self._thread.start()

    # -- the caller's side (any thread) -------------------------------------------------------
    def watch(self, name: str, address: str) -> None:
        """Beat the node listening on TCP `address` (its echo: the same port number, UDP), with a
        fresh suspicion; replaces what was watched under `name`."""
        host, port = host_port(address)
        try:
            info = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
        except OSError as exc:
            log.warning("no beats to %s at %s (%s): heartbeats alone notice its loss", name, address, exc)
            return
        with self._lock:
            self._forget(name)
            slot, self._next_slot = self._next_slot, self._next_slot + 1
            self._peers[slot] = _Peer(name, info[0][4][:2], Suspicion(self.settings))
            self._slots[name] = slot

    def forget(self, name: str) -> None:
        with self._lock:
            self._forget(name)

    def _forget(self, name: str) -> None:
        slot = self._slots.pop(name, None)
        if slot is not None:
            del self._peers[slot]
        self._lost = [n for n in self._lost if n != name]
        self._back = [n for n in self._back if n != name]

    def fileno(self) -> int:
        """Readable while a loss or a return waits to be taken (for a poller)."""
        return self._wake_r.fileno()

    def take_lost(self) -> list[str]:
        """Peers lost since the last call, each once (drains the wake-up)."""
        self._drain_wake()
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def take_back(self) -> list[str]:
        """Lost peers answering again since the last call, each once."""
        self._drain_wake()
        with self._lock:
            back, self._back = self._back, []
        return back

    def is_lost(self, name: str) -> bool:
        with self._lock:
            slot = self._slots.get(name)
            return slot is not None and self._peers[slot].lost

    def why(self, name: str) -> str:
        with self._lock:
            slot = self._slots.get(name)
            if slot is None:
                return "no beats"
            s = self._peers[slot].suspicion
        return f"no beat answered for {s.bound_s:.2f}s (suspicion phi >= {self.settings.threshold:g})"

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self.sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: a wake-up is already waiting
            self._wake_w.send(b"!")

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: drained
            while self._wake_r.recv(64):
                pass

    # -- the watch's thread -------------------------------------------------------------------
    def _run(self) -> None:
        interval = self.settings.interval_s
        next_send = time.monotonic()
        while not self._closed.is_set():
            now = time.monotonic()
            if now >= next_send:
                self._send_all()
                next_send = max(next_send + interval, now)
            wake = min(next_send, self._next_deadline())
            try:
                readable, _, _ = select.select([self.sock], [], [], max(wake - time.monotonic(), 0))
            except (OSError, ValueError):  # closed under us
                return
            if readable:
                self._receive()
            self._judge(time.monotonic())

    def _send_all(self) -> None:
        with self._lock:
            targets = [(slot, p.where) for slot, p in self._peers.items()]
        self._seq += 1
        for slot, where in targets:
            with contextlib.suppress(OSError):  # no route now (a black hole may answer so): silence counts
                self.sock.sendto(_BEAT.pack(MAGIC, self.nonce, slot, self._seq), where)

    def _receive(self) -> None:
        now = time.monotonic()
        while True:
            try:
                data = self.sock.recv(64, socket.MSG_DONTWAIT)
            except (BlockingIOError, OSError):
                return
            if len(data) != _BEAT.size:
                continue
            magic, nonce, slot, _seq = _BEAT.unpack(data)
            if magic != MAGIC or nonce != self.nonce:
                continue
            with self._lock:
                peer = self._peers.get(slot)
                if peer is None:
                    continue
                peer.answered = True
                if peer.lost:  # back: judged afresh (its silence is not a gap to learn)
                    peer.lost, peer.suspicion = False, Suspicion(self.settings)
                    self._back.append(peer.name)
                    self._wake()
                    log.info("%s answers beats again", peer.name)
                peer.suspicion.beat(now)

    def _next_deadline(self) -> float:
        with self._lock:
            deadlines = [p.suspicion.deadline() for p in self._peers.values() if not p.lost]
        return min((d for d in deadlines if d is not None), default=float("inf"))

    def _judge(self, now: float) -> None:
        with self._lock:
            for peer in self._peers.values():
                if not peer.lost and peer.suspicion.lost(now):
                    peer.lost = True
                    self._lost.append(peer.name)
                    self._wake()
                    log.warning(
                        "%s lost: no beat answered for %.2fs (bound %.2fs)",
                        peer.name,
                        now - (peer.suspicion.last or now),
                        peer.suspicion.bound_s,
                    )
                elif not peer.answered and not peer.named_silent and now - peer.since > SILENT_NAMED_AFTER_S:
                    peer.named_silent = True
                    log.warning(
                        "%s at udp %s:%d never answered a beat (UDP blocked?): its loss is noticed by "
                        "heartbeats alone",
                        peer.name,
                        *peer.where,
                    )
