"""The link relay (odmoe/tools/link_relay.py) over real sockets on 127.0.0.1: bytes arrive whole
and in order however they are jittered, late by the delay asked, held (not lost) through a black
hole; beats pass through it and stop in a black hole."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from odmoe.tools.link_relay import Relay
from odmoe.transport.beats import BeatEcho, BeatWatch
from odmoe.transport.suspicion import SuspicionSettings

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


class _EchoServer:
    """TCP: sends back whatever it receives."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        while data := conn.recv(65536):
            conn.sendall(data)
        conn.close()

    def close(self) -> None:
        self.listener.close()


def _connect(relay: Relay) -> socket.socket:
    host, port = relay.address.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)))


def _read(sock: socket.socket, n: int, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    got = b""
    while len(got) < n:
        got += sock.recv(65536)
    return got


def test_jittered_bytes_arrive_whole_in_order_and_late_by_the_delay():
    server = _EchoServer()
    relay = Relay(server.address, seed=3)
    relay.set(delay_s=0.02, jitter_s=0.03)
    sock = _connect(relay)
    try:
        start = time.monotonic()
        sock.sendall(b"x")
        assert _read(sock, 1, 5) == b"x"
        assert time.monotonic() - start >= 0.04  # two hops, each at least the delay
        sent = b"".join(i.to_bytes(4, "big") for i in range(2000))
        for i in range(0, len(sent), 100):  # many small writes, each jittered
            sock.sendall(sent[i : i + 100])
        assert _read(sock, len(sent), 10) == sent
    finally:
        sock.close()
        relay.close()
        server.close()


def test_a_black_hole_holds_bytes_until_it_heals():
    server = _EchoServer()
    relay = Relay(server.address)
    sock = _connect(relay)
    try:
        sock.sendall(b"a")
        assert _read(sock, 1, 5) == b"a"
        relay.black_hole(True)
        sock.sendall(b"bc")
        assert not select.select([sock], [], [], 0.5)[0]  # nothing comes back
        relay.black_hole(False)
        assert _read(sock, 2, 5) == b"bc"
    finally:
        sock.close()
        relay.close()
        server.close()


@pytest.mark.integration  # a relay on 127.0.0.1 and beats through it, waited out on the clock: ~1.5 s
def test_beats_pass_through_and_stop_in_a_black_hole():
    echo = BeatEcho("127.0.0.1", 0)
    relay = Relay(f"tcp://127.0.0.1:{echo.port}")
    relay.set(delay_s=0.01, jitter_s=0.02)
    watch = BeatWatch(SuspicionSettings(interval_s=0.05))
    try:
        watch.watch("worker0", relay.address)
        time.sleep(0.6)
        assert watch.take_lost() == [] and not watch.is_lost("worker0")
        relay.black_hole(True)
        deadline = time.monotonic() + 3
        while not watch.is_lost("worker0"):
            assert time.monotonic() < deadline, "a black-holed relay kept the beats going"
            time.sleep(0.02)
        relay.black_hole(False)
        deadline = time.monotonic() + 3
        while watch.is_lost("worker0"):
            assert time.monotonic() < deadline, "beats never came back through the relay"
            time.sleep(0.02)
    finally:
        watch.close()
        relay.close()
        echo.close()


@pytest.mark.integration  # a relay on 127.0.0.1 whose lost chunks wait a timeout: ~1.6 s
def test_a_lossy_link_delays_tcp_bytes_whole_and_drops_datagrams():
    server = _EchoServer()
    relay = Relay(server.address, seed=5)
    relay.set(loss=0.3, rto_s=0.05)
    sock = _connect(relay)
    try:
        sent = b"".join(i.to_bytes(4, "big") for i in range(500))
        for i in range(0, len(sent), 100):
            sock.sendall(sent[i : i + 100])
        assert _read(sock, len(sent), 20) == sent  # late, none lost, in order
        start = time.monotonic()
        for i in range(20):  # 40 chunks one at a time: some are "lost" and wait a timeout
            sock.sendall(bytes([i]))
            assert _read(sock, 1, 5) == bytes([i])
        assert time.monotonic() - start >= 0.1
    finally:
        sock.close()
        relay.close()
        server.close()
    dropped = sum(relay._dropped() for _ in range(1000))  # datagrams: each lost with p = 0.3
    assert 200 < dropped < 400


def test_retarget_sends_new_connections_to_the_new_address_and_refuses_when_nobody_is_there():
    first, second = _EchoServer(), _EchoServer()
    relay = Relay(first.address)
    try:
        sock = _connect(relay)
        sock.sendall(b"a")
        assert _read(sock, 1, 5) == b"a"
        sock.close()
        first.close()
        gone = socket.socket()
        gone.bind(("127.0.0.1", 0))  # a port with nobody listening
        relay.retarget(f"tcp://127.0.0.1:{gone.getsockname()[1]}")
        sock = _connect(relay)
        sock.settimeout(5)
        assert sock.recv(10) == b""  # closed at once, as a refused connection would be
        sock.close()
        gone.close()
        relay.retarget(second.address)
        sock = _connect(relay)
        sock.sendall(b"b")
        assert _read(sock, 1, 5) == b"b"
        sock.close()
    finally:
        relay.close()
        second.close()
