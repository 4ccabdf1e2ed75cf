"""Connections whose peer's death is noticed in about a second: ZeroMQ heartbeats + a socket monitor.

Contract: `WatchedSocket(ctx, zmq.DEALER, address, heartbeat)` connects a socket with
ZMQ_HEARTBEAT_IVL / ZMQ_HEARTBEAT_TIMEOUT set and a monitor attached; `lost()` drains the monitor
and says whether the connection dropped since the last call. Why heartbeats and not a timer in
Python: libzmq's I/O thread sends and answers them without the GIL, so a peer that is busy loading
or computing in Python still counts as alive, while one that is killed (the kernel resets the TCP
connection: milliseconds), frozen (SIGSTOP freezes its I/O thread too) or cut off (no traffic for
`timeout_s` after a heartbeat) is reported as DISCONNECTED. Slowness alone never is.

With a `Curve` identity the socket is a CURVE client of the node named `server` (odmoe/transport/security.py);
a failed handshake (the peer holds another key, or does not admit ours) is kept in `refused`, so
whoever gives up on the connection can say why.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from odmoe.transport.security import Curve, secure_client

HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "it does not admit this node's key",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "it does not hold the key the cluster knows it by",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "it does not speak CURVE (security off there?)",
}


CONNECT_TIMEOUT_MS = 1000


@dataclass(frozen=True)
class Heartbeat:
    interval_s: float = 0.2  # a ZMTP PING this often on an idle connection
    timeout_s: float = 1.0  # no traffic at all for this long after a PING: the peer is gone


class WatchedSocket:
    def __init__(
        self,
        ctx: zmq.Context,
        kind: int,
        address: str,
        heartbeat: Heartbeat,
        sndhwm: int | None = None,
        curve: Curve | None = None,
        server: str = "",
    ):
        self.address, self.server = address, server
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        if sndhwm is not None:  # must precede connect: a pipe takes the HWM it is created with
            self.sock.setsockopt(zmq.SNDHWM, sndhwm)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, max(int(heartbeat.interval_s * 1000), 1))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(int(heartbeat.timeout_s * 1000), 1))
        # a connect that gets no answer is given up after this and tried afresh (reconnect_ivl, 0.1 s):
        # else the kernel's SYN backoff (1, 2, 4, 8... s) delays a peer's return after a black hole
        self.sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        secure_client(self.sock, curve, server)
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        for event in HANDSHAKE_FAILED:
            events |= event
        self.monitor = self.sock.get_monitor_socket(events)
        self.sock.connect(address)
        self.connected = False  # a ZMTP handshake has completed since the last drop
        self.refused = ""  # why the last handshake failed ("" once one succeeds)

    def lost(self) -> bool:
        """Drain the monitor: True when the connection dropped (after having been up, or not)."""
        dropped = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                dropped, self.connected = True, False
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self.refused = True, ""
            elif event in HANDSHAKE_FAILED:
                self.refused = HANDSHAKE_FAILED[event]
        return dropped

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
