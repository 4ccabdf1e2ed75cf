"""Peers whose link black-holed are noticed (issue 47), without a cluster:
- odmoe.Client: its channel's keepalive pings go unanswered, so gRPC closes the connection and a
  call waiting on it fails UNAVAILABLE within about keepalive_s + keepalive_s, rather than after
  gRPC 1.85's default ping timeout (a minute). An in-process gRPC server answering Info, reached
  through a link relay (odmoe/tools/link_relay.py) whose black hole holds every byte.
- main's HTTP door: every connection it accepts carries TCP keepalive and TCP_USER_TIMEOUT
  (odmoe/serving/http_api.py: notice_silent_peers), set on the listening socket, which Linux
  copies into each accepted one. (That TCP then drops a black-holed client is
  tests/test_client_cut_off.py's, with real packet drops.)
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest
from fastapi import FastAPI

from odmoe import Client
from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.serving.http_api import HttpServer, notice_silent_peers
from odmoe.tools.link_relay import Relay

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


class _Info(odmoe_pb2_grpc.InferenceServicer):
    def Info(self, request, context):
        return odmoe_pb2.InfoReply(model_path="m", family="f", workers=1, group_size=1, info_json="{}")


def test_a_call_waiting_on_a_black_holed_main_fails_within_seconds():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    odmoe_pb2_grpc.add_InferenceServicer_to_server(_Info(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    relay = Relay(f"tcp://127.0.0.1:{port}")
    client = Client(relay.address.removeprefix("tcp://"), keepalive_s=0.5)  # no call deadline
    try:
        assert client.info()["family"] == "f"
        relay.black_hole(True)
        outcome: dict = {}

        def ask() -> None:
            started = time.monotonic()
            try:
                client.info()
                outcome["error"] = None
            except grpc.RpcError as exc:
                outcome["error"] = exc.code()
            outcome["s"] = time.monotonic() - started

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        asker.join(timeout=20)
        assert not asker.is_alive(), "a call to a black-holed main still waits after 20 s"
        assert outcome["error"] == grpc.StatusCode.UNAVAILABLE, outcome
        print(f"\nmain black-holed: the waiting call failed UNAVAILABLE after {outcome['s']:.2f} s")
    finally:
        client.close()
        relay.close()
        server.stop(0)


def _options(sock: socket.socket) -> tuple[int, int, int, int]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
    )


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux's")
def test_http_connections_are_accepted_with_keepalive_and_a_user_timeout():
    listener = socket.create_server(("127.0.0.1", 0))
    notice_silent_peers(listener, ping_s=1.0, ping_timeout_s=2.5)
    peer = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    assert _options(accepted) == (1, 1, 1, 2500)  # inherited from the listening socket
    for sock in (peer, accepted, listener):
        sock.close()
    app = FastAPI()
    app.get("/ok")(lambda: {"ok": True})
    server = HttpServer(app, "127.0.0.1", 0, ping_s=2.0, ping_timeout_s=3.0)
    server.start()
    try:
        assert _options(server.sock) == (1, 2, 2, 3000)
        assert httpx.get(server.url + "/ok").json() == {"ok": True}  # uvicorn serves on that socket
    finally:
        server.stop()
