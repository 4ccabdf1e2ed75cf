"""The join link, end to end: main admitting boxes, and a box joining by one line.

Contract:
- Main (`role=main` with `cluster.join_port` and no `cluster.worker_addresses`): `open_door` serves
  the Share service and the Admission service (odmoe.main.admission) on `cluster.join_port` before
  anything else, makes the key directory when it does not exist yet (`security.key_dir`, default
  ~/.config/odmoe/keys: the nodes' keys stay on main's box and are handed out at admission), prints
  `odmoe-launch join=odmoe://...` and writes it to KEY_DIR/join-link (0600); `rendezvous` waits for
  the shadow (when there is one) and every worker to be admitted and serving, and returns main's
  config words naming their addresses.
- A box (`odmoe-launch join=LINK [role=worker|shadow]`, or `join=auto:SECRET` by mDNS): `run_join`
  checks the certificate main serves against the link's fingerprint and that main holds the secret
  before sending anything, proves the secret over a fresh nonce with the public half of a keypair it
  made (the secret half never leaves it), writes what it is handed (the public keys, certificate,
  token) and its keypair as a key directory under ~/.cache/odmoe/joined/<host>_<port>/ with the
  usual modes, remembers its name (a restart asks for it back), starts its node with main's words
  plus its own (its own win), pulling its share of the checkpoint first (model.pull_from), tells
  main where it serves, and keeps its allow-list current (later boxes' keys). Every refusal is one
  line and exit code 2.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from odmoe.config import OdmoeConfig
from odmoe.main.admission import Admissions, TokenUnlessJoining, join_link
from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.transport.join_link import (
    JoinLink,
    admission_proof,
    auto_link,
    fingerprint_of,
    main_proof,
    parse_link,
)
from odmoe.transport.security import ClientCredentials, KeyDir, ServerSecrets, init_key_dir

log = logging.getLogger("odmoe.launch.join")
DEFAULT_KEY_DIR = "~/.config/odmoe/keys"
# main's own words that are not a joining node's (where main runs, what it serves, its keys)
NOT_SHARED = (
    "role=",
    "model.path=",
    "model.gguf_file=",
    "model.pull_from=",
    "model.pull_dir=",
    "model.cache_dir=",
    "node.ready_file=",
    "join=",
    "cluster.worker_addresses=",
    "cluster.shadow_address=",
    "cluster.shadow_pub_address=",
    "cluster.host=",
    "cluster.main_port=",
    "cluster.join_port=",
    "cluster.main_addresses=",
    "security.",
    "server.",
    "node.",
    "worker.index=",
    "hydra.",
)


class JoinRefused(RuntimeError):
    """One line saying why this box cannot join."""


def reachable_host(bind: str, towards: str = "192.0.2.1") -> str:
    """The address others reach this box by: `bind` unless it is a wildcard, else the address of
    the interface that routes towards `towards` (no packet is sent)."""
    if bind not in ("0.0.0.0", "::", ""):
        return bind
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((towards, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


# -- main's side -------------------------------------------------------------------------------
def key_dir_for_join(cfg: OdmoeConfig, host: str) -> KeyDir:
    keys = KeyDir(Path(cfg.security.key_dir or DEFAULT_KEY_DIR).expanduser())
    if not keys.token.exists():
        init_key_dir(keys.root, cfg.cluster.workers, (host,))
        log.info(
            "made the cluster's keys in %s (they stay on this box; nodes get theirs by the link)", keys.root
        )
    return keys


def admissions_for(
    cfg: OdmoeConfig, overrides: list[str], keys: KeyDir, host: str, where: dict[str, int]
) -> Admissions:
    """The Admission service; `where["port"]` is the join port, known once the server is bound."""
    shared = [w for w in overrides if not w.lstrip("+~").startswith(NOT_SHARED)]
    base = [
        *shared,
        f"cluster.workers={cfg.cluster.workers}",
        f"cluster.group_size={cfg.cluster.group_size}",
        f"shadow.enabled={str(cfg.shadow.enabled).lower()}",
    ]
    if cfg.model.gguf_file:
        base.append(f"model.gguf_file={cfg.model.gguf_file}")
    if cfg.cluster.main_port:  # a restarted node finds main again by itself
        base.append(f"cluster.main_addresses=[{host}:{cfg.cluster.main_port}]")

    def words(name: str, role: str, index: int) -> list[str]:
        own = [f"worker.index={index}"] if role == "worker" else []
        return [*base, f"model.pull_from={host}:{where['port']}", *own]

    return Admissions(keys, keys.root / "join_secret", cfg.cluster.workers, cfg.shadow.enabled, words)


def open_door(cfg: OdmoeConfig, overrides: list[str], model_path: str):
    """(server or None, Admissions or None): the Share service on cluster.join_port, and admission
    when main takes its nodes by the link (module contract)."""
    from odmoe.launch.pull import serve_checkpoint

    joining = cfg.cluster.join_port >= 0 and not cfg.cluster.worker_addresses and cfg.security.enabled
    if not joining:
        served = serve_checkpoint(cfg, model_path)
        return (served[0] if served else None), None
    host = reachable_host(cfg.cluster.host)
    keys = key_dir_for_join(cfg, host)
    where: dict[str, int] = {}
    admissions = admissions_for(cfg, overrides, keys, host, where)
    secrets = ServerSecrets.from_key_dir(keys.root)
    served = serve_checkpoint(
        cfg,
        model_path,
        secrets=secrets,
        also=lambda server: odmoe_pb2_grpc.add_AdmissionServicer_to_server(admissions, server),
        token_check=TokenUnlessJoining(secrets),
    )
    assert served is not None
    where["port"] = served[1]
    link = join_link(keys, keys.root / "join_secret", host, served[1])
    line = f"odmoe-launch join={link}"
    path = keys.root / "join-link"
    path.write_text(line + "\n")
    path.chmod(0o600)
    print(f"odmoe: on every other box run (also in {path}):\n    {line}", flush=True)
    if cfg.cluster.advertise:  # join=auto:SECRET finds it; the secret is still needed
        from odmoe.transport.lan_discovery import advertise

        name = f"odmoe main {socket.gethostname()} {served[1]}"
        admissions.advertised = advertise(name, host, served[1], link.fingerprint)
        print(f"odmoe: advertised by mDNS as {name!r}: join=auto:{link.secret} also works", flush=True)
    return served[0], admissions


def rendezvous(admissions: Admissions, min_workers: int = 0) -> list[str]:
    """main's words naming every admitted node's address, once all serve, or the shadow and
    `min_workers` workers (cluster.min_workers: '' for the others, taken in as they come); logs who
    is missing meanwhile."""
    while True:
        try:
            workers, shadow = admissions.wait_ready(timeout_s=30, min_workers=min_workers)
            break
        except TimeoutError as exc:
            log.info("waiting for nodes to join: %s", exc)
    listed = ",".join(a or "''" for a in workers)
    words = [f"cluster.worker_addresses=[{listed}]", "cluster.join_port=-1"]
    if shadow is not None:
        words += [f"cluster.shadow_address={shadow[0]}", f"cluster.shadow_pub_address={shadow[1]}"]
    return words


# -- a joining box -----------------------------------------------------------------------------
def _home(link_host: str, port: int) -> Path:
    return Path("~/.cache/odmoe/joined").expanduser() / f"{link_host}_{port}"


def _write_keys(root: Path, reply) -> KeyDir:
    keys = KeyDir(root)
    for folder, mode in (
        (keys.root, 0o700),
        (keys.public, 0o755),
        (keys.private, 0o700),
        (keys.cert.parent, 0o755),
    ):
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(mode)
    _refresh_public(keys, reply.public_keys)
    own = (root.parent / "box.key_secret").read_bytes()  # the keypair this box made (_box_keypair)
    for path, data, mode in (
        (keys.secret_key(reply.name), own, 0o600),
        (keys.token, (reply.token + "\n").encode(), 0o600),
        (keys.cert, reply.cert_pem, 0o644),
    ):
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        tmp.chmod(mode)
        tmp.replace(path)
    return keys


def find_link(text: str, choose=None, timeout_s: float = 2.0) -> str:
    """`auto:SECRET[@NAME]` -> a link to the main found by mDNS (odmoe.transport.lan_discovery);
    several in sight and no NAME: `choose(found)` picks one (the console asks), else refused."""
    from odmoe.transport.lan_discovery import DiscoveryUnavailable, find_mains

    auto = auto_link(text)
    if auto is None:
        return text
    secret, name = auto
    try:
        found = find_mains(timeout_s)
    except DiscoveryUnavailable as exc:
        raise JoinRefused(str(exc)) from None
    if name:
        found = [f for f in found if f.name == name]
    if not found:
        raise JoinRefused(
            "no odmoe main found by mDNS on this network"
            + (f" named {name!r}" if name else "")
            + " (main advertises with cluster.advertise=true): give the link main printed instead"
        )
    if len(found) > 1:
        if choose is None:
            names = ", ".join(f"{f.name} ({f.host}:{f.port})" for f in found)
            raise JoinRefused(f"several mains in sight: {names}; say which with join=auto:SECRET@NAME")
        found = [choose(found)]
    f = found[0]
    return str(JoinLink(secret, f.host, f.port, f.fingerprint))


def _ask(found):
    """The console picks among several mains found by mDNS."""
    for i, f in enumerate(found):
        print(f"  {i + 1}. {f.name} at {f.host}:{f.port} (certificate {f.fingerprint[:16]}...)")
    while True:
        answer = input(f"which main to join (1-{len(found)})? ").strip()
        if answer.isdigit() and 1 <= int(answer) <= len(found):
            return found[int(answer) - 1]


def _box_keypair(home: Path) -> bytes:
    """This box's CURVE keypair, made once (its secret half never leaves the box); returns the
    public half's certificate text, which main puts in its allow-list under the name it hands out."""
    import zmq.auth

    public = home / "box.key"
    if not public.is_file():
        home.mkdir(parents=True, exist_ok=True)
        home.chmod(0o700)
        _, secret = zmq.auth.create_certificates(str(home), "box")
        Path(secret).chmod(0o600)
    return public.read_bytes()


def _refresh_public(keys: KeyDir, public_keys) -> int:
    """Make this box's allow-list main's: keys main holds written, keys main no longer holds (revoked
    there) moved to revoked/, so this box's node refuses them too; returns how many changed."""
    changed = 0
    for path in keys.public.glob("*.key"):
        if path.stem not in public_keys:
            keys.revoked.mkdir(parents=True, exist_ok=True)
            path.replace(keys.revoked / path.name)
            changed += 1
    for name, text in public_keys.items():
        path = keys.public_key(name)
        if path.is_file() and path.read_bytes() == text:
            continue
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(text)
        tmp.replace(path)
        changed += 1
    return changed


def _keep_keys_current(keys: KeyDir, link, credentials: ClientCredentials, child: subprocess.Popen) -> None:
    """While the node runs: fetch every public key from main every 2 s, so boxes admitted after this
    one (with keys of their own) are admitted here too (the node re-reads its allow-list)."""
    while child.poll() is None:
        try:
            with credentials.channel(link.address) as channel:
                reply = odmoe_pb2_grpc.AdmissionStub(channel).Keys(
                    odmoe_pb2.KeysRequest(), metadata=credentials.metadata, timeout=5
                )
            if changed := _refresh_public(keys, reply.public_keys):
                log.info("%d public key(s) updated from main", changed)
        except grpc.RpcError:
            pass  # main restarting: try again
        time.sleep(2.0)


def admit(link_text: str, role: str, host: str, home: Path | None = None):
    """Check main's certificate and that main holds the secret, prove it too, and return (reply,
    home, link): the module contract's first half, without starting a node (tests call it alone)."""
    try:
        link = parse_link(link_text)
    except ValueError as exc:
        raise JoinRefused(str(exc)) from None
    try:
        pem = ssl.get_server_certificate((link.host, link.port), timeout=10)
    except OSError as exc:
        raise JoinRefused(f"cannot reach main at {link.address}: {exc}") from None
    served = fingerprint_of(pem)
    if served != link.fingerprint:
        raise JoinRefused(
            f"main at {link.address} presents certificate {served[:16]}..., the link names "
            f"{link.fingerprint[:16]}...: not the cluster the link is for; nothing was sent"
        )
    home = home or _home(link.host, link.port)
    identity = home / "identity.json"
    name = json.loads(identity.read_text())["name"] if identity.is_file() else ""
    credentials = ClientCredentials(token="", cert_pem=pem.encode())
    box_nonce = os.urandom(32)
    with credentials.channel(link.address) as channel:
        stub = odmoe_pb2_grpc.AdmissionStub(channel)
        try:
            challenge = stub.Challenge(odmoe_pb2.ChallengeRequest(box_nonce=box_nonce), timeout=10)
            if not hmac.compare_digest(challenge.main_proof, main_proof(link.secret, box_nonce, served)):
                raise JoinRefused(
                    f"main at {link.address} does not hold the link's secret (or it was rotated): "
                    "not the cluster the link is for; nothing was sent"
                )
            nonce = challenge.nonce
            proof = admission_proof(link.secret, nonce, role, name, host)
            request = odmoe_pb2.AdmitRequest(
                nonce=nonce, proof=proof, role=role, name=name, host=host, public_key=_box_keypair(home)
            )
            reply = stub.Admit(request, timeout=10)
        except grpc.RpcError as exc:
            raise JoinRefused(f"main at {link.address} refused this box: {exc.details()}") from None
    home.mkdir(parents=True, exist_ok=True)
    identity.write_text(json.dumps({"name": reply.name}))
    return reply, home, link


def run_join(cfg: OdmoeConfig, overrides: list[str]) -> int:
    role = cfg.role.name if cfg.role.name in ("worker", "shadow") else ""
    try:
        text = find_link(cfg.join, _ask if sys.stdin.isatty() else None)
        # the address main will dial: the one given (cluster.host=...), else this box's towards main
        chosen = any(w.startswith("cluster.host=") for w in overrides)
        host = reachable_host(cfg.cluster.host if chosen else "0.0.0.0", parse_link(text).host)
        reply, home, link = admit(text, role, host)
    except (JoinRefused, ValueError) as exc:
        print(f"odmoe-launch: {exc}", file=sys.stderr)
        return 2
    keys = _write_keys(home / "keys", reply)
    ready = home / f"{reply.name}.ready.json"
    ready.unlink(missing_ok=True)
    own = [w for w in overrides if not w.startswith(("join=", "role=", "node.ready_file="))]
    argv = [
        sys.executable, "-m", "odmoe.launch.cli", f"role={reply.role}", *reply.words,
        f"security.key_dir={keys.root}", f"cluster.host={host}", *own, f"node.ready_file={ready}",
    ]  # fmt: skip
    print(f"odmoe: admitted as {reply.name}; starting it (keys in {keys.root})", flush=True)
    child = subprocess.Popen(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    while not ready.exists():
        if child.poll() is not None:
            return child.returncode or 1
        time.sleep(0.1)
    info = json.loads(ready.read_text())
    if cfg.node.ready_file:  # whoever started this launcher learns what the node wrote
        Path(cfg.node.ready_file).write_text(json.dumps({**info, "name": reply.name}))
    credentials = ClientCredentials(token=reply.token, cert_pem=reply.cert_pem)
    with credentials.channel(link.address) as channel:
        odmoe_pb2_grpc.AdmissionStub(channel).Ready(
            odmoe_pb2.ReadyRequest(
                name=reply.name, address=info["address"], pub_address=info.get("pub_address", "")
            ),
            metadata=credentials.metadata,
            timeout=10,
        )
    threading.Thread(
        target=_keep_keys_current, args=(keys, link, credentials, child), name="odmoe-keys", daemon=True
    ).start()
    return child.wait()
