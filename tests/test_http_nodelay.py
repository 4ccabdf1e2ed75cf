"""Main's HTTP door sends an answer as soon as it has it: every connection it accepts has
TCP_NODELAY. asyncio sets that option only on a socket whose `proto` says TCP; an accepted socket
takes its listener's, and the listener HttpServer binds (socket.create_server, since 2026-11-28)
says 0, so the door's connections ran with Nagle's algorithm: over TLS a whole
(non-streamed) answer's body waited for the client's delayed ACK of its headers, 40 ms on most
requests (suite frontdoor on 2026-11-29: http_whole 16 % slower than gRPC, streamed 3 %). A real
uvicorn server with the cluster's TLS, a real connection, the option read off the accepted socket."""

from __future__ import annotations

import socket

import httpx
import pytest
from fastapi import FastAPI

from odmoe.serving.http_api import HttpServer
from odmoe.transport.security import ClientCredentials, ServerSecrets, init_key_dir

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_every_accepted_connection_has_nodelay(tmp_path):
    keys = init_key_dir(tmp_path / "keys", workers=1)
    app, seen = FastAPI(), []
    server = HttpServer(app, "127.0.0.1", 0, ServerSecrets.from_key_dir(keys.root), ping_s=1.0)

    @app.get("/nodelay")
    def nodelay() -> dict:
        for connection in server.server.server_state.connections:
            sock = connection.transport.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        return {}

    server.start()
    try:
        verify = ClientCredentials.from_key_dir(keys.root).ssl_context()
        assert httpx.get(server.url + "/nodelay", verify=verify).status_code == 200
    finally:
        server.stop()
    assert seen and all(seen), f"TCP_NODELAY on the accepted connections: {seen}"
