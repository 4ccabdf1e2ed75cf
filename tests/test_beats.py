"""Beats over real UDP sockets on 127.0.0.1 (odmoe/transport/beats.py): an echo that stops
answering is lost within 1.5 s, one that answers again is named as back, foreign datagrams count
for nothing, and a peer that never answered is never suspected."""

from __future__ import annotations

import select
import socket
import time

import pytest

from odmoe.transport.beats import BeatEcho, BeatWatch, echo_for, host_port
from odmoe.transport.suspicion import SuspicionSettings

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def _wait(watch: BeatWatch, take, timeout_s: float) -> tuple[list[str], float]:
    """Block on the watch's fileno (as main's poller does) until `take` returns something."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        select.select([watch.fileno()], [], [], 0.05)
        if got := take():
            return got, time.monotonic() - start
    return [], time.monotonic() - start


def test_host_port_reads_zmq_addresses():
    assert host_port("tcp://10.0.0.3:5555") == ("10.0.0.3", 5555)
    assert host_port("tcp://[::1]:7") == ("::1", 7)


@pytest.mark.integration  # beats over UDP on 127.0.0.1, waited out on the clock: ~1.5 s
def test_a_silenced_echo_is_lost_within_1_5_s_and_back_when_it_answers_again():
    echo = BeatEcho("127.0.0.1", 0)
    port = echo.port
    watch = BeatWatch(SuspicionSettings(interval_s=0.05))
    try:
        watch.watch("worker3", f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)  # answers learnt
        assert watch.take_lost() == [] and not watch.is_lost("worker3")
        echo.close()  # the port now drops every beat: a black hole as main sees it
        lost, after = _wait(watch, watch.take_lost, 3.0)
        assert lost == ["worker3"] and after < 1.5 and watch.is_lost("worker3")
        assert "phi" in watch.why("worker3")
        echo = BeatEcho("127.0.0.1", port)
        back, after = _wait(watch, watch.take_back, 3.0)
        assert back == ["worker3"] and after < 0.5 and not watch.is_lost("worker3")
    finally:
        echo.close()
        watch.close()


@pytest.mark.integration  # beats over UDP on 127.0.0.1, waited out on the clock: ~2 s
def test_a_peer_that_never_answers_is_never_suspected_and_forgotten_peers_are_not_reported():
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))  # takes beats, answers none (a firewall that drops UDP)
    echo = BeatEcho("127.0.0.1", 0)
    watch = BeatWatch(SuspicionSettings(interval_s=0.05))
    try:
        watch.watch("worker0", f"tcp://127.0.0.1:{silent.getsockname()[1]}")
        watch.watch("worker1", f"tcp://127.0.0.1:{echo.port}")
        time.sleep(0.3)
        watch.forget("worker1")
        echo.close()
        time.sleep(1.5)
        assert watch.take_lost() == []
    finally:
        silent.close()
        watch.close()


def test_answers_without_the_watch_nonce_count_for_nothing():
    forger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    forger.bind(("127.0.0.1", 0))
    watch = BeatWatch(SuspicionSettings(interval_s=0.05))
    try:
        watch.watch("worker0", f"tcp://127.0.0.1:{forger.getsockname()[1]}")
        data, peer = forger.recvfrom(64)
        for _ in range(5):  # right shape, wrong nonce: never heard, never suspected
            forged = data[:4] + bytes(8) + data[12:]
            forger.sendto(forged, peer)
        time.sleep(0.3)
        forger.sendto(data, peer)  # the real beat echoed once: now it is judged, then lost
        lost, _ = _wait(watch, watch.take_lost, 3.0)
        assert lost == ["worker0"]
    finally:
        forger.close()
        watch.close()


def test_echo_for_takes_the_tcp_ports_number_and_gives_up_quietly_when_it_is_taken():
    echo = echo_for("tcp://127.0.0.1:0")
    assert echo is not None
    try:
        assert echo_for(f"tcp://127.0.0.1:{echo.port}") is None
    finally:
        echo.close()
