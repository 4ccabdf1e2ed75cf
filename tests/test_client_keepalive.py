"""odmoe.Client notices a main whose link black-holed (issue 47): its channel's keepalive pings go
unanswered, so gRPC closes the connection and a call waiting on it fails UNAVAILABLE within about
keepalive_s + keepalive_s, rather than after gRPC 1.85's default ping timeout (a minute).

No cluster: an in-process gRPC server answering Info, reached through a link relay
(odmoe/tools/link_relay.py) whose black hole holds every byte, as a link that drops everything does.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from odmoe import Client
from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.tools.link_relay import Relay


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
