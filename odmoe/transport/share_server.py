"""Serving a checkpoint's bytes to the nodes that lack them (the `Share` gRPC service).

Contract: `ShareServer(directory, index)` answers `Index` with the directory's index
(odmoe.models.checkpoint_index: every file's and tensor's sha256) and `Read(file, offset, length)`
with that range's bytes in chunks of at most `CHUNK` — only of files the index names, only within
them (anything else is INVALID_ARGUMENT naming what was asked). `serve_share(...)` runs it on its own
gRPC server with the cluster's TLS and token (`BearerToken`, as main's API), so a node pulls before
main serves requests (main starts it first thing; `odmoe-launch role=seed` runs it alone on a box
that holds the checkpoint). It reads with `os.pread`, so many readers share one file handle.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from odmoe.models.checkpoint_index import CheckpointIndex
from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.transport.security import BearerToken, ServerSecrets

log = logging.getLogger("odmoe.transport.share_server")
CHUNK = 1 << 20


class ShareServer(odmoe_pb2_grpc.ShareServicer):
    def __init__(self, directory: str | Path, index: CheckpointIndex):
        self.directory, self.index = Path(directory), index
        self._json = index.to_json()
        self._sizes = {f.name: f.size for f in index.files}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_sent = 0

    def Index(self, request, context):
        return odmoe_pb2.ShareIndexReply(index_json=self._json)

    def Read(self, request, context):
        size = self._sizes.get(request.file)
        if size is None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{request.file!r} is not a file of this checkpoint"
            )
        if request.offset + request.length > size:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{request.file}: {request.length} bytes at {request.offset} go past its end ({size})",
            )
        fd = self._fd(request.file)
        at, end = request.offset, request.offset + request.length
        while at < end:
            data = os.pread(fd, min(CHUNK, end - at), at)
            if not data:
                context.abort(
                    grpc.StatusCode.DATA_LOSS, f"{request.file} is shorter on this box than its index"
                )
            at += len(data)
            with self._lock:
                self.bytes_sent += len(data)
            yield odmoe_pb2.ShareChunk(data=data)

    def _fd(self, name: str) -> int:
        with self._lock:
            if name not in self._fds:
                self._fds[name] = os.open(self.directory / name, os.O_RDONLY)
            return self._fds[name]


def serve_share(
    directory: str | Path,
    index: CheckpointIndex,
    host: str,
    port: int,
    secrets: ServerSecrets | None,
    also: Callable[[grpc.Server], None] | None = None,
    token_check: grpc.ServerInterceptor | None = None,
) -> tuple[grpc.Server, int, ShareServer]:
    """Start the Share service on host:port (0: any free port); returns (server, bound port, servicer).
    `also` adds other services to the same server (main's admission); `token_check` replaces
    `BearerToken` as the token's interceptor (one that lets a joining box's first calls through)."""
    interceptors: list[grpc.ServerInterceptor] = [token_check or BearerToken(secrets)] if secrets else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=interceptors)
    servicer = ShareServer(directory, index)
    odmoe_pb2_grpc.add_ShareServicer_to_server(servicer, server)
    if also is not None:
        also(server)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, secrets.grpc_credentials())
        if secrets
        else server.add_insecure_port(address)
    )
    if bound == 0:
        raise OSError(f"cannot serve the checkpoint on {address} (in use?)")
    server.start()
    log.info("serving %s's bytes on %s:%d (%d files)", directory, host, bound, len(index.files))
    return server, bound, servicer
