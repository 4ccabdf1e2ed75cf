"""Main's side of the join link: admitting boxes, handing each its role, keys and settings.

Contract:
- `Admissions(keys, secret_file, workers, shadow, words_for)` is the `Admission` gRPC service.
  `Challenge` hands out a random nonce (single use, `NONCE_TTL_S`); `Admit` checks the box's
  HMAC over it with the secret in `secret_file` (read at each call: rewriting the file rotates the
  secret, and links carrying the old one are refused), then names the box: a restarted box asking
  for its earlier name gets it back; otherwise the shadow first (when the cluster has one and none
  is admitted), then the lowest free worker index; a full cluster, a box whose key was revoked
  (`odmoe-keys revoke` moved it to revoked/), a wrong secret, an unknown or reused nonce (a replay)
  are each refused with PERMISSION_DENIED (FAILED_PRECONDITION for a full cluster) and one line
  saying why. The box sends the public half of a keypair it made (the secret half never leaves
  it), which becomes the name's key in main's allow-list; the reply carries every public key, the
  TLS certificate, the token and `words_for(name, role, index)`: the settings it runs with. The
  channel is TLS whose certificate the box checked against the link's fingerprint. `Keys` (token
  required) returns every public key now, so boxes admitted earlier learn later boxes' keys.
- `Challenge` also answers the box's own nonce with `main_proof` over main's certificate
  fingerprint: main proves it holds the secret before the box sends its proof.
- `Ready(name, address, pub_address)` (token required) records where an admitted node serves;
  `wait_ready(timeout_s, min_workers)` blocks until the shadow (when there is one) and every worker
  (or `min_workers` of them) have, and returns their addresses for main's configuration; a node
  ready later is passed to `on_ready` (main takes it in while serving: a cluster growing).
- `secret_file` is made (0600, random) when missing; `join_link(...)` formats main's line.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.transport.join_link import JoinLink, admission_proof, fingerprint_of, main_proof
from odmoe.transport.security import (
    BearerToken,
    KeyDir,
    SecurityError,
    public_key_of,
    read_secret,
    read_token,
)

log = logging.getLogger("odmoe.main.admission")
NONCE_TTL_S = 60.0
OPEN_METHODS = frozenset({"/odmoe.rpc.Admission/Challenge", "/odmoe.rpc.Admission/Admit"})


class TokenUnlessJoining(BearerToken):
    """The token on every call but the two a box makes before it has one."""

    def intercept_service(self, continuation, details):
        if details.method in OPEN_METHODS:
            return continuation(details)
        return super().intercept_service(continuation, details)


def join_secret(path: Path) -> str:
    """The link's secret, made on first use (0600, as every secret here)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = path.open("x")
        path.chmod(0o600)
        with fd:
            fd.write(secrets.token_urlsafe(24) + "\n")
    return read_secret(path, "join secret").decode().strip()


def join_link(keys: KeyDir, secret_file: Path, host: str, port: int) -> JoinLink:
    return JoinLink(join_secret(secret_file), host, port, fingerprint_of(keys.cert.read_bytes()))


class Admissions(odmoe_pb2_grpc.AdmissionServicer):
    def __init__(
        self,
        keys: KeyDir,
        secret_file: Path,
        workers: int,
        shadow: bool,
        words_for: Callable[[str, str, int], list[str]],
    ):
        self.keys, self.secret_file, self.workers, self.shadow = keys, secret_file, workers, shadow
        self.words_for = words_for
        join_secret(secret_file)
        self.fingerprint = fingerprint_of(keys.cert.read_bytes())
        self._nonces: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self.admitted: dict[str, str] = {}  # name -> the host it said it serves on
        self.ready: dict[str, tuple[str, str]] = {}  # name -> (address, pub_address)
        self._changed = threading.Condition(self._lock)
        self.advertised = None  # the mDNS announcement, when cluster.advertise
        # once main serves: told of each node ready after main started (a cluster growing)
        self.on_ready: Callable[[str, str, str], None] | None = None

    # -- the RPCs ----------------------------------------------------------------------------
    def Challenge(self, request, context):
        nonce = secrets.token_bytes(32)
        now = time.monotonic()
        with self._lock:
            self._nonces = {n: t for n, t in self._nonces.items() if t > now}
            self._nonces[nonce] = now + NONCE_TTL_S
        proof = main_proof(join_secret(self.secret_file), request.box_nonce, self.fingerprint)
        return odmoe_pb2.ChallengeReply(nonce=nonce, main_proof=proof)

    def Admit(self, request, context):
        with self._lock:
            expiry = self._nonces.pop(request.nonce, None)
        if expiry is None or expiry < time.monotonic():
            self._refuse(
                context, "this admission's nonce is unknown or was already used (a replay?): ask again"
            )
        want = admission_proof(
            join_secret(self.secret_file), request.nonce, request.role, request.name, request.host
        )
        if not hmac.compare_digest(want, request.proof):
            self._refuse(context, "wrong join secret: the link is not this cluster's (or was rotated)")
        with self._lock:
            name, why = self._assign(request.role, request.name)
            if name is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
            if self._revoked(request.public_key):
                self._refuse(context, f"this box's key was revoked (it was {name}'s: odmoe-keys revoke)")
            self.admitted[name] = request.host
        role, index = ("shadow", 0) if name == "shadow" else ("worker", int(name.removeprefix("worker")))
        self._take_key(name, request.public_key, context)
        log.info("admitted %s as %s (serving on %s)", context.peer(), name, request.host or "?")
        return odmoe_pb2.AdmitReply(
            name=name,
            role=role,
            index=index,
            public_keys=self._public_keys(),
            cert_pem=self.keys.cert.read_bytes(),
            token=read_token(self.keys.token),
            words=self.words_for(name, role, index),
        )

    def Keys(self, request, context):
        return odmoe_pb2.KeysReply(public_keys=self._public_keys())

    def _public_keys(self) -> dict[str, bytes]:
        return {p.stem: p.read_bytes() for p in sorted(self.keys.public.glob("*.key"))}

    def _take_key(self, name: str, text: bytes, context) -> None:
        """The box's own public key becomes `name`'s in the allow-list (its secret half never left
        the box); main's nodes read the allow-list again when it changes, and boxes fetch it (Keys)."""
        try:
            key = public_key_of(text)
        except SecurityError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the box's public key: {exc}")
        path = self.keys.public_key(name)
        if path.is_file() and path.read_bytes() == text:
            return
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(text)
        tmp.replace(path)
        stale = self.keys.secret_key(name)  # a key main made for the name before: no longer its
        stale.unlink(missing_ok=True)
        log.info("%s's public key is now the one its box made (%s...)", name, key[:8].decode())

    def Ready(self, request, context):
        with self._changed:
            if request.name not in self.admitted:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{request.name} was not admitted")
            self.ready[request.name] = (request.address, request.pub_address)
            self._changed.notify_all()
            on_ready = self.on_ready
        log.info("%s serves on %s", request.name, request.address)
        if on_ready is not None:
            on_ready(request.name, request.address, request.pub_address)
        return odmoe_pb2.ReadyReply(detail=f"{request.name} at {request.address} noted")

    # -- main's side -------------------------------------------------------------------------
    def expected(self) -> list[str]:
        return (["shadow"] if self.shadow else []) + [f"worker{i}" for i in range(self.workers)]

    def wait_ready(
        self, timeout_s: float | None = None, min_workers: int = 0
    ) -> tuple[list[str], tuple[str, str] | None]:
        """(worker addresses by index, (shadow address, pub address) or None) once all are ready, or
        the shadow and `min_workers` workers (cluster.min_workers): "" for a worker not ready yet."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._changed:
            while not self._enough(min_workers):
                missing = [n for n in self.expected() if n not in self.ready]
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{', '.join(missing)} did not join within {timeout_s:.0f} s")
                self._changed.wait(timeout=min(left, 5.0) if left is not None else 5.0)
            workers = [self.ready.get(f"worker{i}", ("", ""))[0] for i in range(self.workers)]
            return workers, self.ready["shadow"] if self.shadow else None

    def _enough(self, min_workers: int) -> bool:
        if self.shadow and "shadow" not in self.ready:
            return False
        ready = sum(f"worker{i}" in self.ready for i in range(self.workers))
        return ready >= (min_workers or self.workers)

    def _assign(self, role: str, name: str) -> tuple[str | None, str]:
        names = self.expected()
        if name:
            if name not in names:
                return None, f"{name} is not a node of this cluster ({', '.join(names)})"
            return name, ""  # a restarted box: its own name back
        # a name is free until a box holds it; one whose key was revoked (gone from public/) is free again
        free = [n for n in names if n not in self.admitted or not self.keys.public_key(n).exists()]
        if role:
            free = [n for n in free if (n == "shadow") == (role == "shadow")]
        if not free:
            return None, (
                f"the cluster is full: {', '.join(names)} are admitted. A cluster grows up to its "
                f"cluster.workers ({self.workers}): start main with a larger cluster.workers (and "
                "cluster.min_workers for the boxes it starts with) to take more boxes, or "
                "`odmoe-keys revoke NODE` to free a name"
            )
        return free[0], ""

    def _revoked(self, text: bytes) -> bool:
        """The box's key is one `odmoe-keys revoke` moved to revoked/ (a box replacing it under the
        same name brings a new key and is admitted; to keep a revoked box out for good, rotate the
        secret too)."""
        revoked = self.keys.root / "revoked"
        if not revoked.is_dir():
            return False
        try:
            key = public_key_of(text)
        except SecurityError:
            return False  # refused as malformed by _take_key
        for path in revoked.glob("*.key"):
            try:
                if public_key_of(path.read_bytes()) == key:
                    return True
            except (SecurityError, OSError):
                continue
        return False

    @staticmethod
    def _refuse(context, why: str) -> None:
        log.warning("refused an admission from %s: %s", context.peer(), why)
        context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
