"""A user-space relay in front of one node that makes its link slow, jittery or silent.

Contract: `Relay("tcp://host:port")` listens on 127.0.0.1 (or `host=`) and forwards every TCP
connection to the target, and every UDP datagram to the target's UDP port of the same number (where
odmoe's beats go, odmoe/transport/beats.py) — so a node told the relay's address instead of the
target's reaches the target through it, both ways. `set(delay_s, jitter_s)`: each chunk of bytes
(and each datagram) is held `delay_s` plus a uniformly random share of `jitter_s`; a TCP stream's
bytes keep their order (a chunk never overtakes the one before: jitter then shows as bursts, as on a
real link under TCP). `black_hole(True)`: nothing passes any more until `black_hole(False)` —
TCP bytes wait in the relay (as a link that drops everything makes TCP retransmit them later:
nothing is lost, only late), datagrams are dropped. `set(..., loss=p)`: a lossy link as TCP
sees it — each datagram is dropped with probability p, and each chunk of a TCP stream is held one
retransmission timeout more (`rto_s`, 0.2 s, doubled for each further loss in a row, as TCP backs
off) with probability p, so it and every byte after it arrive late, none lost. `retarget(target)`:
connections made from now on (and datagrams) go to another address, e.g. the node restarted on a
new port (connections already open stay with the old one). `close()` ends every connection.

Why a relay and not the kernel: these machines have no sch_netem (no kernel delay or jitter);
`tc tbf` shapes rate only and iptables drops but cannot delay (benchmarks/netns_lan.py uses those).
Threads, not asyncio: a relay lives in a test or benchmark process beside a client, and each hop
is one blocking read and one timed write.
"""

from __future__ import annotations

import heapq
import random
import socket
import threading
import time

from odmoe.transport.beats import host_port

CHUNK = 65536


class Relay:
    def __init__(self, target: str, host: str = "127.0.0.1", seed: int = 0):
        self.target = host_port(target)
        self.delay_s, self.jitter_s, self.loss, self.rto_s = 0.0, 0.0, 0.0, 0.2
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._open = threading.Event()  # set: traffic passes (clear: a black hole)
        self._open.set()
        self._closed = threading.Event()
        self.listener = socket.create_server((host, 0))
        port = self.listener.getsockname()[1]
        self.address = f"tcp://{host}:{port}"
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((host, port))  # beats to the relay's port number go on to the target's
        self._udp_out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._udp_out.bind((host, 0))
        self._udp_peer: tuple[str, int] | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        for target_fn in (self._accept, self._udp_in, self._udp_back):
            threading.Thread(target=target_fn, daemon=True).start()

    # -- the test's side ------------------------------------------------------------------------
    def set(self, delay_s: float = 0.0, jitter_s: float = 0.0, loss: float = 0.0, rto_s: float = 0.2) -> None:
        if not 0 <= loss < 1:
            raise ValueError(f"loss is a probability below 1, got {loss}")
        self.delay_s, self.jitter_s, self.loss, self.rto_s = delay_s, jitter_s, loss, rto_s

    def retarget(self, target: str) -> None:
        self.target = host_port(target)

    def black_hole(self, on: bool = True) -> None:
        if on:
            self._open.clear()
        else:
            self._open.set()

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        for sock in [self.listener, self.udp, self._udp_out, *self._conns]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _hold(self) -> float:
        """Seconds a TCP chunk waits: the delay, its share of the jitter, and a retransmission
        timeout for each time it was "lost" (backing off as TCP does)."""
        with self._rng_lock:
            held, rto = self.delay_s + self._rng.random() * self.jitter_s, self.rto_s
            while self.loss and self._rng.random() < self.loss:
                held, rto = held + rto, rto * 2
            return held

    def _dropped(self) -> bool:
        with self._rng_lock:
            return bool(self.loss) and self._rng.random() < self.loss

    # -- TCP ------------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                continue
            try:
                server = socket.create_connection(self.target, timeout=1.0)
                server.settimeout(None)
            except OSError:  # nobody there (a killed node): refused, as the node itself would be
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns += [client, server]
            for src, dst in ((client, server), (server, client)):
                self._pump(src, dst)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """src -> dst: a reader stamps each chunk with when it may leave, a writer sends it then."""
        queue: list[tuple[float, int, bytes]] = []
        ready = threading.Condition()
        seq = [0]

        def read() -> None:
            last = 0.0
            while True:
                try:
                    data = src.recv(CHUNK)
                except OSError:
                    data = b""
                with ready:
                    if data:
                        last = max(last, time.monotonic() + self._hold())  # order kept
                    seq[0] += 1
                    heapq.heappush(queue, (last if data else 0.0, seq[0], data))
                    ready.notify()
                if not data:
                    return

        def write() -> None:
            while True:
                with ready:
                    while not queue:
                        ready.wait()
                    at, _, data = queue[0]
                    wait = at - time.monotonic()
                    if data and wait > 0:
                        ready.wait(wait)
                        continue
                    heapq.heappop(queue)
                if not data:  # the other side closed: so does this one
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                self._open.wait()  # a black hole: bytes wait here until it heals
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    # -- UDP (beats) ----------------------------------------------------------------------------
    def _later(self, sock: socket.socket, data: bytes, where) -> None:
        if not self._open.is_set() or self._dropped():
            return  # dropped, as a black hole (or a lossy link) drops datagrams
        with self._rng_lock:
            hold = self.delay_s + self._rng.random() * self.jitter_s
        timer = threading.Timer(hold, self._send_quietly, (sock, data, where))
        timer.daemon = True
        timer.start()

    def _send_quietly(self, sock: socket.socket, data: bytes, where) -> None:
        if self._open.is_set():
            try:
                sock.sendto(data, where)
            except OSError:
                pass

    def _udp_in(self) -> None:
        while True:
            try:
                data, peer = self.udp.recvfrom(2048)
            except OSError:
                return
            self._udp_peer = peer
            self._later(self._udp_out, data, self.target)

    def _udp_back(self) -> None:
        while True:
            try:
                data, _ = self._udp_out.recvfrom(2048)
            except OSError:
                return
            if self._udp_peer is not None:
                self._later(self.udp, data, self._udp_peer)
