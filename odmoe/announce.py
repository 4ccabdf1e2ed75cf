"""A (re)started worker or shadow tells every main where it serves, through main's gRPC Join.

Why: main knows its nodes by the addresses it was started with. A node restarted on another port
or box would never be used again; announcing itself lets main check it (a Ping proving its index
and layers) and take it back without a restart. The calls run on a daemon thread and retry every
`retry_s` until each main has answered once, so a node may start before main does.
"""

from __future__ import annotations

import logging
import threading

import grpc

from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc

log = logging.getLogger("odmoe.announce")


def announce(
    mains: list[str], role: str, address: str, index: int = 0, pub_address: str = "", retry_s: float = 1.0
) -> threading.Thread | None:
    if not mains:
        return None
    request = odmoe_pb2.JoinRequest(role=role, index=index, address=address, pub_address=pub_address)

    def run() -> None:
        pending = list(mains)
        stop = threading.Event()
        while pending:
            for main in list(pending):
                try:
                    with grpc.insecure_channel(main) as channel:
                        reply = odmoe_pb2_grpc.InferenceStub(channel).Join(request, timeout=5)
                    log.info("%s %s announced to main %s: %s", role, address, main, reply.detail)
                    pending.remove(main)
                except grpc.RpcError:
                    pass  # main not up (yet): try again
            stop.wait(retry_s)

    thread = threading.Thread(target=run, name="odmoe-announce", daemon=True)
    thread.start()
    return thread
