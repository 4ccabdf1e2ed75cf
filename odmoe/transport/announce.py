"""A (re)started worker or shadow tells every main where it serves, through main's gRPC Join.

Why: main knows its nodes by the addresses it was started with. A node restarted on another port
or box would never be used again; announcing itself lets main check it (a Ping proving its index
and layers) and take it back without a restart. The calls run on a daemon thread and retry every
`retry_s` until each main has answered once, so a node may start before main does. With security
on, Join is a TLS call with the cluster's token like any client's (`credentials`); main then still
checks the node over CURVE before it uses it.
"""

from __future__ import annotations

import logging
import threading

import grpc

from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.transport.security import ClientCredentials, grpc_channel

log = logging.getLogger("odmoe.transport.announce")


def announce(
    mains: list[str],
    role: str,
    address: str,
    index: int = 0,
    pub_address: str = "",
    where: str = "",
    retry_s: float = 1.0,
    credentials: ClientCredentials | None = None,
) -> threading.Thread | None:
    if not mains:
        return None
    metadata = credentials.metadata if credentials else None
    request = odmoe_pb2.JoinRequest(
        role=role, index=index, address=address, pub_address=pub_address, where=where
    )

    def run() -> None:
        pending = list(mains)
        stop = threading.Event()
        while pending:
            for main in list(pending):
                try:
                    with grpc_channel(main, credentials) as channel:
                        stub = odmoe_pb2_grpc.InferenceStub(channel)
                        reply = stub.Join(request, timeout=5, metadata=metadata)
                    log.info("%s %s announced to main %s: %s", role, address, main, reply.detail)
                    pending.remove(main)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                        log.error("main %s refused %s's Join: %s", main, role, exc.details())
                    # else main is not up (yet): try again
            stop.wait(retry_s)

    thread = threading.Thread(target=run, name="odmoe-announce", daemon=True)
    thread.start()
    return thread
