"""A client cut off from main mid-stream (issue 47): its link black-holes (no FIN, no RST: every byte
either way is held), so nothing tells main the client is gone but main's own pings
(server.client_ping_s, nodes/main.py: server_options). Main must let the connection go within
about ping + timeout, cancel the request so its place and K/V are freed, and the other clients'
streams must go on with the reference tokens.

Real processes and sockets: a LocalCluster, one client reaching main through a link relay
(odmoe/tools/link_relay.py) whose black hole holds that client's bytes, another client straight to
main. The detection time is printed (`-s`) and only loosely bounded: tests never assert timings.

The HTTP/SSE door has no pings a client answers: there TCP finds the silent client
(odmoe/serving/http_api.py: TCP_USER_TIMEOUT and keepalive on every connection, an SSE comment
every ping). A relay cannot stand in for that black hole: its kernel acknowledges the bytes it
holds, so main's TCP sees a healthy peer. The HTTP test drops the client connection's packets
for real instead, with iptables on the loopback (only that connection's two ports, no namespace;
root and iptables, skipped with the reason elsewhere; CI installs iptables).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from odmoe import Client, LocalCluster
from odmoe.tools.link_relay import Relay
from tests.test_batching import PROMPTS, alone

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # a cluster: ~1 min here


def _metric(cluster: LocalCluster, name: str) -> float:
    page = httpx.get(f"{cluster.http_url}/metrics", **cluster.http_auth).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", page, re.M)
    return float(found.group(1)) if found else 0.0


def _until_cancelled(cluster, cancelled: float, holed: float) -> float:
    """Seconds from the black hole until main counts one more cancelled request (at most 15: not
    cancelled by then, main never noticed, and the request ran to its end or still runs)."""
    while _metric(cluster, CANCELLED) == cancelled:
        assert time.monotonic() - holed < 15, "main never cancelled the cut-off client's request"
        time.sleep(0.05)
    return time.monotonic() - holed


def _until_its_place_is_free(cluster) -> None:
    deadline = time.monotonic() + 10
    while _metric(cluster, "odmoe:num_requests_running") != 0:
        assert time.monotonic() < deadline, "the cut-off request kept its place"
        time.sleep(0.05)


CANCELLED = 'odmoe:requests_total{finish_reason="cancelled"}'


def test_a_client_black_holed_mid_stream_is_cancelled_and_the_others_stay_exact(model_dirs, reap_children):
    path, other_tokens = model_dirs["mixtral"], 120
    want = list(alone(path, PROMPTS[1], other_tokens, 0))
    # pings every 0.5 s, 1 s to answer: let go well before the cut-off request could end by itself;
    # worker.cache=0 (experts loaded at every use) slows decoding down to make sure of that
    words = ["server.client_ping_s=0.5", "server.client_ping_timeout_s=1.0", "worker.cache=0"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        cluster.client.generate(PROMPTS[0], max_new_tokens=2)  # warm
        relay = Relay(f"tcp://{cluster.address}")
        # keepalive_s long: this client does nothing about the black hole in the test's time, so
        # whatever ends its request is main's doing
        cut = Client(relay.address.removeprefix("tcp://"), keepalive_s=120, credentials=cluster.credentials)
        other: dict[str, object] = {}
        try:
            # as long as the model allows (256 positions): seconds of decoding if nobody stops it
            stream = cut.stream(PROMPTS[0], max_new_tokens=240, ignore_eos=True)
            got = [next(stream).token_id for _ in range(3)]
            assert got == list(alone(path, PROMPTS[0], 3, 0))
            runner = threading.Thread(
                target=lambda: other.update(
                    result=cluster.client.generate(PROMPTS[1], max_new_tokens=other_tokens)
                ),
                daemon=True,
            )
            runner.start()
            cancelled = _metric(cluster, CANCELLED)
            holed = time.monotonic()
            relay.black_hole(True)
            detect_s = _until_cancelled(cluster, cancelled, holed)
            running_then = runner.is_alive()
            runner.join(timeout=120)
            assert other["result"].token_ids == want, "the other client's stream differs from the reference"
            _until_its_place_is_free(cluster)
            log = cluster.node("main").log_file.read_text()
            assert "cancelled by its client" in log
            print(
                f"\nclient black-holed mid-stream: request cancelled {detect_s:.2f}s later "
                f"(server.client_ping_s + client_ping_timeout_s = 0.5 + 1 s); the other stream "
                f"{'still running then, ' if running_then else ''}exact ({other_tokens} tokens)"
            )
        finally:
            relay.close()
            cut.close()


class _Dropped:
    """Every packet of one loopback TCP connection dropped on arrival, both ways (iptables INPUT
    rules on `lo` naming its two ports): a black hole for that connection alone."""

    def __init__(self, port_a: int, port_b: int):
        tag = f"odmoe-test-{port_a}-{port_b}"
        self.rules = [
            ["INPUT", "-i", "lo", "-p", "tcp", "--sport", str(a), "--dport", str(b), "-m", "comment"]
            + ["--comment", tag, "-j", "DROP"]
            for a, b in ((port_a, port_b), (port_b, port_a))
        ]

    def __enter__(self):
        for rule in self.rules:
            subprocess.run(["iptables", "-w", "-A", *rule], check=True, capture_output=True)
        return self

    def __exit__(self, *exc) -> None:
        for rule in self.rules:
            subprocess.run(["iptables", "-w", "-D", *rule], capture_output=True)


def _can_drop() -> str:
    """Why loopback packets cannot be dropped here ("" when they can)."""
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables)"
    probe = subprocess.run(["iptables", "-w", "-S", "INPUT"], capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"iptables cannot be used here: {probe.stderr.strip()[:200]}"


def _post_completion(cluster: LocalCluster, body: dict) -> socket.socket:
    """POST /v1/completions over a socket of our own, so its port is known: HTTPS with the
    cluster's certificate and token when security is on (the default)."""
    url = urlsplit(cluster.http_url)
    sock = socket.create_connection((url.hostname, url.port))
    if url.scheme == "https":
        sock = cluster.credentials.ssl_context().wrap_socket(sock, server_hostname=url.hostname)
    payload = json.dumps(body).encode()
    auth = f"Authorization: Bearer {cluster.token}\r\n" if cluster.token else ""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def _read_events(sock: socket.socket, n: int, timeout_s: float = 60) -> list[dict]:
    """The first n `data:` events of an SSE response (the HTTP head and chunk sizes skipped)."""
    sock.settimeout(timeout_s)
    buffer, events = b"", []
    while len(events) < n:
        got = sock.recv(65536)
        assert got, "the stream ended early"
        buffer += got
        events = [json.loads(m) for m in re.findall(rb"^data: (\{.*\})\r?$", buffer, re.M)]
    return events


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "unstreamed"])
def test_an_http_client_black_holed_mid_request_is_cancelled_and_the_others_stay_exact(
    stream, model_dirs, reap_children
):
    """Streamed, the SSE bytes (tokens, comments) go unacknowledged; not streamed, nothing is sent
    until the end, so TCP's keepalive probes are what go unacknowledged."""
    if why := _can_drop():
        pytest.skip(why)
    path, other_tokens = model_dirs["mixtral"], 120
    want = list(alone(path, PROMPTS[1], other_tokens, 0))
    words = ["server.client_ping_s=0.5", "server.client_ping_timeout_s=1.0", "worker.cache=0"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        cluster.client.generate(PROMPTS[0], max_new_tokens=2)  # warm
        model = httpx.get(f"{cluster.http_url}/v1/models", **cluster.http_auth).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 240, "stream": stream, "ignore_eos": True}
        cut = _post_completion(cluster, body)
        other: dict[str, object] = {}
        try:
            if stream:
                assert len(_read_events(cut, 3)) >= 3
            else:
                deadline = time.monotonic() + 60
                while _metric(cluster, "odmoe:num_requests_running") < 1:
                    assert time.monotonic() < deadline, "the request never started"
                    time.sleep(0.05)
            runner = threading.Thread(
                target=lambda: other.update(
                    result=cluster.client.generate(PROMPTS[1], max_new_tokens=other_tokens)
                ),
                daemon=True,
            )
            runner.start()
            cancelled = _metric(cluster, CANCELLED)
            with _Dropped(cut.getsockname()[1], urlsplit(cluster.http_url).port):
                holed = time.monotonic()
                detect_s = _until_cancelled(cluster, cancelled, holed)
                running_then = runner.is_alive()
                runner.join(timeout=120)
                assert other["result"].token_ids == want, "the other client's stream differs"
                _until_its_place_is_free(cluster)
            assert "cancelled by its client" in cluster.node("main").log_file.read_text()
            print(
                f"\nHTTP client ({'SSE' if stream else 'not streamed'}) black-holed mid-request: "
                f"request cancelled {detect_s:.2f}s later "
                f"(server.client_ping_s + client_ping_timeout_s = 0.5 + 1 s); the other stream "
                f"{'still running then, ' if running_then else ''}exact ({other_tokens} tokens)"
            )
        finally:
            cut.close()
