"""The join link: one line that lets a box join a cluster, and the proofs that go with it.

Contract (pure):
- `JoinLink(secret, host, port, fingerprint)` formats as `odmoe://<secret>@<host>:<port>/<fingerprint>`
  and `parse_link(text)` reads it back, raising `ValueError` with the line a user can act on.
  `fingerprint` is the sha256 (hex) of main's TLS certificate (DER): the box checks the certificate
  it is served against it before sending anything, so nothing is trusted on first use.
- `fingerprint_of(cert_pem)` computes it; `admission_proof(secret, nonce, role, name, host)` is the
  HMAC-SHA256 a box sends to prove it holds the secret, bound to main's single-use nonce and to what
  it asks for, so a recorded admission cannot be replayed or turned into another.
  `main_proof(secret, box_nonce, fingerprint)` is main's answer to the box's own nonce, bound to the
  certificate the box sees: a main found by mDNS (whose fingerprint the box could not know
  beforehand) proves it holds the secret, and a relay with its own certificate cannot pass a real
  main's proof on.
- `auto_link(text)` splits `auto:SECRET[@NAME]` (found by mDNS, odmoe.transport.lan_discovery).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import ssl
from dataclasses import dataclass

SCHEME = "odmoe://"
_LINK = re.compile(
    r"^odmoe://(?P<secret>[A-Za-z0-9_-]{16,})@(?P<host>\[[^\]]+\]|[^:/@]+):(?P<port>\d+)/(?P<fp>[0-9a-f]{64})$"
)


@dataclass(frozen=True)
class JoinLink:
    secret: str
    host: str
    port: int
    fingerprint: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.secret}@{self.host}:{self.port}/{self.fingerprint}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_link(text: str) -> JoinLink:
    m = _LINK.match(text.strip())
    if m is None:
        raise ValueError(
            f"{text!r} is not a join link: expected odmoe://<secret>@<host>:<port>/<64 hex digits>, "
            "as `odmoe-launch role=main` prints it"
        )
    return JoinLink(m["secret"], m["host"].strip("[]"), int(m["port"]), m["fp"])


def fingerprint_of(cert_pem: bytes | str) -> str:
    pem = cert_pem.decode() if isinstance(cert_pem, bytes) else cert_pem
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


def main_proof(secret: str, box_nonce: bytes, fingerprint: str) -> bytes:
    return hmac.new(
        secret.encode(), b"\0".join([b"main", box_nonce, fingerprint.encode()]), hashlib.sha256
    ).digest()


def auto_link(text: str) -> tuple[str, str] | None:
    """(secret, main's name or "") of `auto:SECRET[@NAME]`; None for anything else."""
    if not text.startswith("auto:"):
        return None
    secret, _, name = text.removeprefix("auto:").partition("@")
    if len(secret) < 16:
        raise ValueError("join=auto:SECRET needs the cluster's secret (the part of main's link before @)")
    return secret, name


def admission_proof(secret: str, nonce: bytes, role: str, name: str, host: str) -> bytes:
    message = b"\0".join([nonce, role.encode(), name.encode(), host.encode()])
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()
