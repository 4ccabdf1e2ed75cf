"""Key material and the checks that keep a cluster's transport its own: CurveZMQ, TLS and a token.

Contract. A key directory (`odmoe-keys init DIR`, or LocalCluster's scratch copy) holds

    DIR/public/<node>.key           every node's CURVE public key: the allow-list (every box gets all)
    DIR/private/<node>.key_secret   one node's CURVE keypair, 0600 (only that node's box gets it)
    DIR/tls/cert.pem                the self-signed certificate main serves gRPC and HTTP with
    DIR/tls/key.pem                 its private key, 0600 (main boxes only)
    DIR/token                       the client bearer token, 0600 (clients; workers and the shadow
                                    use it for main's Join RPC)

    DIR/revoked/<node>[.<n>].key    keys taken off the allow-list (`odmoe-keys revoke`): never admitted

Node names are `main` (every main, standbys included: they are interchangeable), `shadow`,
`worker<i>`; the name is the key's role. Every ZeroMQ server socket is a CURVE server whose ZAP
authenticator admits a key only for the roles that socket serves (`SERVER_SOCKETS`):

    a worker's ROUTER             main           (expert calls, pings, LiveWorkers, Release)
    the shadow's control PULL     main           (Begin, Align, End)
    the shadow's prediction PUB   main, workers  (each subscribes to its groups' predictions)

so a worker's key cannot call another worker as main or drive the shadow, and the shadow's key
cannot act as main or a worker. The allow-list (`AllowList`) is DIR/public less DIR/revoked, re-read
at the next handshake whenever either folder changes: a key added or revoked takes effect on the
running nodes without a restart (connections already made stay until they drop). A refused
handshake is logged once per key and socket, naming the key's node and the socket. Every client
socket names its server's public key, read at each connection, so a box that answers with another
key never completes a handshake, and a revoked server key is never connected to again (main's
probes of a lost worker go on without failing; the name's new key is reached once it is added). gRPC is
TLS with the certificate pinned (clients trust only DIR/tls/cert.pem and check the name
`odmoe-cluster` whatever address they dial) plus `authorization: Bearer <token>` on every call,
health checks included; the HTTP API takes the same token over HTTPS.

Why secrets are refused when others can read them (as ssh does): a key that any local user could
copy authenticates nothing. Every error here is a `SecurityError` that names the file and says
what to do, raised before a node binds anything.
"""

from __future__ import annotations

import contextlib
import datetime
import hmac
import ipaddress
import logging
import os
import re
import secrets
import shutil
import ssl
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("odmoe.transport.security")
TLS_NAME = "odmoe-cluster"  # the name in the certificate; gRPC clients check it whatever they dial
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class SecurityError(ValueError):
    """Key material is missing, malformed or readable by others; the message names the file."""


# -- the key directory -----------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyDir:
    root: Path

    @property
    def public(self) -> Path:
        return self.root / "public"

    @property
    def private(self) -> Path:
        return self.root / "private"

    @property
    def cert(self) -> Path:
        return self.root / "tls" / "cert.pem"

    @property
    def tls_key(self) -> Path:
        return self.root / "tls" / "key.pem"

    @property
    def token(self) -> Path:
        return self.root / "token"

    @property
    def revoked(self) -> Path:
        return self.root / "revoked"

    def public_key(self, node: str) -> Path:
        return self.public / f"{node}.key"

    def secret_key(self, node: str) -> Path:
        return self.private / f"{node}.key_secret"


def init_key_dir(root: str | Path, workers: int, hosts: tuple[str, ...] = ()) -> KeyDir:
    """Create a cluster's keys: CURVE keypairs for main, shadow and `workers` workers, a TLS
    certificate valid for `hosts` (plus loopback and TLS_NAME) and a client token. Refuses to
    overwrite an existing key directory."""
    keys = KeyDir(Path(root))
    if keys.public.exists() or keys.token.exists():
        raise SecurityError(f"{keys.root} already holds cluster keys; add a node with `odmoe-keys add`")
    for folder in (keys.root, keys.public, keys.private, keys.cert.parent):
        folder.mkdir(parents=True, exist_ok=True)
    keys.private.chmod(0o700)
    for name in ("main", "shadow", *(f"worker{i}" for i in range(workers))):
        add_node_key(keys, name)
    cert, key = self_signed_certificate(hosts)
    _write(keys.cert, cert, 0o644)
    _write(keys.tls_key, key, 0o600)
    _write(keys.token, (secrets.token_urlsafe(32) + "\n").encode(), 0o600)
    return keys


def add_node_key(keys: KeyDir, name: str) -> None:
    """A new CURVE keypair for node `name`: public half into the allow-list, secret half 0600."""
    if role_of(name) is None:
        raise SecurityError(f"{name!r} is not a node name: {NAME_RULE}")
    for existing in (keys.secret_key(name), keys.public_key(name)):
        if existing.exists():
            raise SecurityError(
                f"{existing} exists already: to give {name} a new key, `odmoe-keys revoke` the old one first"
            )
    keys.private.mkdir(mode=0o700, parents=True, exist_ok=True)
    keys.public.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(str(keys.private), name)
    Path(secret_file).chmod(0o600)
    shutil.move(public_file, keys.public_key(name))


def revoke_node_key(keys: KeyDir, name: str) -> Path:
    """Take node `name`'s key off the allow-list: public/<name>.key moves to revoked/ (kept there, so
    `odmoe-keys show` lists it and a copy put back in public/ is still refused) and its secret, if
    this directory holds it, is deleted, so `add_node_key` then makes a new keypair for the name.
    Returns where the public key went. The move is one rename: a node re-reading public/ meanwhile
    sees the key or not, never half of it."""
    public = keys.public_key(name)
    if not public.exists():
        raise SecurityError(f"{public} is missing: {name!r} holds no admitted key (revoked already?)")
    keys.revoked.mkdir(exist_ok=True)
    target, n = keys.revoked / f"{name}.key", 1
    while target.exists():  # revoked before: keep every key the name ever had
        target, n = keys.revoked / f"{name}.{n}.key", n + 1
    os.replace(public, target)
    keys.secret_key(name).unlink(missing_ok=True)
    return target


def revoked_nodes(keys: KeyDir) -> list[str]:
    """The names whose keys were revoked, once per key, in name order."""
    return sorted(_node_of_file(p.name) for p in keys.revoked.glob("*.key"))


def _revoked_keys(keys: KeyDir) -> dict[bytes, str]:
    return _keys_in(keys.revoked, "revoked/")


def _keys_in(folder: Path, what: str) -> dict[bytes, str]:
    """z85 key -> node, for every `.key` file in `folder` that parses (the others: a warning)."""
    found = {}
    for path in sorted(folder.glob("*.key")):
        try:
            found[load_public_key(path)] = _node_of_file(path.name)
        except (SecurityError, OSError) as exc:
            log.warning("%s: %s skipped: %s", what, path, exc)
    return found


def _node_of_file(filename: str) -> str:
    """`worker1.key` / `worker1.2.key` -> `worker1`."""
    return re.sub(r"(\.\d+)?\.key$", "", filename)


def _write(path: Path, data: bytes, mode: int) -> None:
    path.touch(mode=mode, exist_ok=False)  # created with its mode: never readable by others meanwhile
    path.chmod(mode)
    path.write_bytes(data)


def self_signed_certificate(hosts: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
    """(certificate PEM, private key PEM): EC P-256, ten years, names TLS_NAME, loopback and hosts."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in (TLS_NAME, *LOOPBACK, *hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(list(dict.fromkeys(names))), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


# -- reading it back, with the checks -----------------------------------------------------------------
def read_secret(path: Path, what: str) -> bytes:
    """A secret file's bytes; SecurityError when it is missing or group/world-accessible."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise SecurityError(
            f"{what} {path} is missing: create the cluster's keys with `odmoe-keys init DIR` and copy "
            "this node's files there (README: Several machines on a LAN)"
        ) from None
    if not stat.S_ISREG(mode):
        raise SecurityError(f"{what} {path} is not a file")
    if mode & 0o077:
        raise SecurityError(
            f"{what} {path} is accessible by others (mode {stat.S_IMODE(mode):04o}): "
            f"run `chmod 600 {path}`; a node will not start from a secret others can read"
        )
    return path.read_bytes()


def read_public(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise SecurityError(
            f"{what} {path} is missing: copy the cluster key directory's public/ and tls/cert.pem "
            "to every box (odmoe-keys init DIR made them)"
        ) from None


def _z85_key(text: bytes, label: bytes, path: Path) -> bytes:
    for line in text.decode("utf-8", "replace").splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name.strip() == label.decode():
            key = value.strip().strip('"').encode()
            if len(key) == 40:
                with contextlib.suppress(ValueError, KeyError):
                    zmq.utils.z85.decode(key)
                    return key
            raise SecurityError(f"{path}: {label.decode()} is not a 40-character Z85 CURVE key")
    raise SecurityError(
        f"{path} is not a ZeroMQ certificate (no {label.decode()} line): make it with `odmoe-keys`"
    )


def public_key_of(text: bytes) -> bytes:
    """The Z85 public key in a ZeroMQ certificate's text (SecurityError if there is none)."""
    return _z85_key(text, b"public-key", Path("<certificate>"))


def load_public_key(path: Path) -> bytes:
    return _z85_key(read_public(path, "public key"), b"public-key", path)


def load_keypair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a `.key_secret` file (checked 0600 first)."""
    text = read_secret(path, "secret key")
    return _z85_key(text, b"public-key", path), _z85_key(text, b"secret-key", path)


def read_token(path: Path) -> str:
    token = read_secret(path, "client token").decode("utf-8", "replace").strip()
    if len(token) < 16 or any(c.isspace() for c in token):
        raise SecurityError(f"{path} does not hold a token (one line of at least 16 characters)")
    return token


def check_certificate(path: Path) -> bytes:
    pem = read_public(path, "TLS certificate")
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise SecurityError(f"{path} is not a PEM certificate")
    return pem


# -- roles: which key may connect to which socket -----------------------------------------------------
NAME_RULE = "node names are main (every main, standbys included), shadow and worker<i>"


@dataclass(frozen=True)
class ServerSocket:
    what: str  # for log lines: which socket refused
    admits: tuple[str, ...]  # the roles whose keys may connect to it


# Every ZeroMQ server socket of a node, by its ZAP domain, with the only roles that connect to it
# (odmoe.main.membership: main's DEALER to each worker; odmoe.main.shadow_link: main's PUSH and SUB
# to the shadow; nodes/worker.py: each worker's SUB to the shadow). Nothing else connects to a node.
SERVER_SOCKETS: dict[str, ServerSocket] = {
    "worker": ServerSocket("a worker's ROUTER (main's expert calls)", ("main",)),
    "shadow-control": ServerSocket("the shadow's control PULL (main's Begin/Align/End)", ("main",)),
    "shadow-predictions": ServerSocket("the shadow's prediction PUB", ("main", "worker")),
}


def role_of(node: str) -> str | None:
    """A key's role from its node name (`main`, `shadow`, `worker<i>`); None for any other name."""
    if node in ("main", "shadow"):
        return node
    if re.fullmatch(r"worker(0|[1-9]\d*)", node):
        return "worker"
    return None


def refusal(socket: str, node: str | None, revoked: bool) -> str | None:
    """Why `socket` refuses the key of `node` (None: a key the allow-list does not know), or None
    when it admits it. Pure: the ZAP handler's whole decision."""
    served = SERVER_SOCKETS[socket]
    if node is None:
        return "a key not in public/: not one of this cluster's nodes"
    if revoked:
        return f"{node}'s key was revoked (odmoe-keys revoke)"
    role = role_of(node)
    if role is None:
        return f"{node}'s key has no role ({NAME_RULE})"
    if role not in served.admits:
        return f"{node}'s key has the role {role}, and this socket admits {' and '.join(served.admits)} only"
    return None


class AllowList:
    """Node name by CURVE public key: the keys in DIR/public less any in DIR/revoked. Re-read whenever
    a `.key` file in either folder appears, goes or changes (checked at each lookup, i.e. at each
    handshake: a directory listing and a few stat calls), so keys added or revoked take effect without
    a restart. A file that does not parse is skipped with a warning (it may be half copied)."""

    def __init__(self, keys: KeyDir):
        self.keys = keys
        self._signature: tuple = ()
        self._lock = threading.Lock()
        self.admitted: dict[bytes, str] = {}  # z85 key -> node
        self.revoked: dict[bytes, str] = {}
        self._load()

    def lookup(self, key: bytes) -> tuple[str | None, bool]:
        """(the node `key` belongs to, or None; whether that key was revoked)."""
        with self._lock:  # the ZAP thread, and tests
            if self._scan() != self._signature:
                self._load()
            if key in self.revoked:
                return self.revoked[key], True
            return self.admitted.get(key), False

    def _scan(self) -> tuple:
        found = []
        for folder in (self.keys.public, self.keys.revoked):
            with contextlib.suppress(FileNotFoundError), os.scandir(folder) as entries:
                for e in entries:
                    if e.name.endswith(".key"):
                        st = e.stat()
                        found.append((folder.name, e.name, st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(sorted(found))

    def _load(self) -> None:
        signature = self._scan()
        revoked, admitted = _revoked_keys(self.keys), _keys_in(self.keys.public, "allow-list")
        if self._signature:
            log.info(
                "allow-list re-read from %s: %d keys admitted, %d revoked",
                self.keys.public,
                len(admitted),
                len(revoked),
            )
        self.admitted, self.revoked, self._signature = admitted, revoked, signature


class RoleAdmission:
    """The ZAP credentials provider: admits a key on a socket only for that socket's roles, and logs
    each refusal once per (key, socket) (a refused client reconnects every 100 ms)."""

    MAX_LOGGED = 1024  # a LAN scanner with fresh keys must not grow this without bound

    def __init__(self, allow: AllowList, node: str):
        self.allow, self.node = allow, node
        self._logged: set[tuple[bytes, str, str]] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            node, revoked = self.allow.lookup(key)
            why = refusal(domain, node, revoked) if domain in SERVER_SOCKETS else "no such socket"
        except Exception as exc:  # never let the ZAP thread die: every handshake would hang
            node, why = None, f"the allow-list could not be read ({exc})"
        if why is None:
            return True
        seen = (key, domain, why)
        if seen not in self._logged and len(self._logged) < self.MAX_LOGGED:
            self._logged.add(seen)
            who = node if node is not None else f"key {key[:8].decode(errors='replace')}..."
            where = SERVER_SOCKETS[domain].what if domain in SERVER_SOCKETS else domain
            log.warning("%s: refused a CURVE handshake from %s on %s: %s", self.node, who, where, why)
        return False


# -- CurveZMQ -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Curve:
    """One node's CURVE identity and where the cluster's public keys are."""

    name: str
    public: bytes
    secret: bytes
    keys: KeyDir
    # node -> the server key last read for it; and the nodes whose missing key was logged
    _known: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)
    _gone: set[str] = field(default_factory=set, compare=False, repr=False)

    @classmethod
    def load(cls, key_dir: str | Path, name: str) -> Curve:
        keys = KeyDir(Path(key_dir))
        public, secret = load_keypair(keys.secret_key(name))
        if public in _revoked_keys(keys):
            raise SecurityError(
                f"{keys.secret_key(name)} was revoked (odmoe-keys revoke): this node needs a new key "
                f"(`odmoe-keys add DIR {name}` on the box that keeps the key directory)"
            )
        if not keys.public_key(name).exists() or load_public_key(keys.public_key(name)) != public:
            raise SecurityError(
                f"{keys.secret_key(name)} does not match {keys.public_key(name)}: this is not the key "
                f"the cluster knows as {name!r}"
            )
        return cls(name, public, secret, keys)

    def server_key(self, node: str) -> bytes:
        """`node`'s public key, read at each connection (so a name given a new key by `odmoe-keys
        revoke` + `add` is reached with the new one). A revoked key, or a key this process read before
        that has since left public/, gives a key nobody holds instead: the connection never completes
        a handshake, so a revoked node is never connected to again, and whoever keeps reconnecting
        (main probing a lost worker) goes on without failing. A key neither seen before nor revoked
        is a set-up mistake: SecurityError, naming the file."""
        path = self.keys.public_key(node)
        revoked = _revoked_keys(self.keys)
        if path.exists():
            key = load_public_key(path)
            if key not in revoked:
                self._known[node] = key
                self._gone.discard(node)
                return key
        elif node not in self._known and node not in revoked.values():
            load_public_key(path)  # raises: missing, copy it
        if node not in self._gone:
            self._gone.add(node)
            log.warning(
                "%s: %s's key is revoked or gone from %s: not connecting to %s until it has a new key",
                self.name,
                node,
                self.keys.public,
                node,
            )
        return zmq.curve_keypair()[0]  # its secret is dropped here: no box can answer as it

    def still_admitted(self, node: str) -> bool:
        """Whether the key this process last connected to `node` with is still `node`'s admitted key
        (not revoked, not replaced, not gone from public/). True for a node it never connected to."""
        known = self._known.get(node)
        if known is None:
            return True
        try:
            current = load_public_key(self.keys.public_key(node))
        except SecurityError:
            return False
        return current == known and known not in _revoked_keys(self.keys)

    def serve(self, sock: zmq.Socket, socket: str) -> None:
        """Make `sock` a CURVE server (before bind) of kind `socket` (a key of SERVER_SOCKETS): only
        allow-listed keys of the roles that socket serves complete a handshake."""
        if socket not in SERVER_SOCKETS:
            raise ValueError(f"no server socket {socket!r}: one of {', '.join(SERVER_SOCKETS)}")
        sock.curve_secretkey, sock.curve_publickey = self.secret, self.public
        sock.curve_server = True
        sock.zap_domain = socket.encode()  # the ZAP handler's `domain`: which roles to admit

    def connect_to(self, sock: zmq.Socket, node: str) -> None:
        """Make `sock` a CURVE client of `node` (before connect): it talks only to that key."""
        sock.curve_secretkey, sock.curve_publickey = self.secret, self.public
        sock.curve_serverkey = self.server_key(node)

    def authenticator(self, ctx: zmq.Context) -> ThreadAuthenticator:
        """The process's ZAP handler: each server socket admits the allow-listed keys of its roles
        (`RoleAdmission`), the allow-list re-read whenever public/ or revoked/ changes."""
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("odmoe.zap"))
        auth.start()
        admission = RoleAdmission(AllowList(self.keys), self.name)
        for socket in SERVER_SOCKETS:
            auth.configure_curve_callback(domain=socket, credentials_provider=admission)
        return auth


def secure_server(sock: zmq.Socket, curve: Curve | None, socket: str) -> None:
    """`socket`: which server socket this is (SERVER_SOCKETS), so which roles it admits."""
    if curve is not None:
        curve.serve(sock, socket)


def secure_client(sock: zmq.Socket, curve: Curve | None, server: str) -> None:
    if curve is not None:
        curve.connect_to(sock, server)


# -- gRPC and HTTP --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientCredentials:
    """What a client needs: the token, and the certificate it trusts (PEM bytes)."""

    token: str
    cert_pem: bytes

    @classmethod
    def from_key_dir(cls, key_dir: str | Path) -> ClientCredentials:
        keys = KeyDir(Path(key_dir))
        return cls(read_token(keys.token), check_certificate(keys.cert))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def channel(self, address: str, options: list | tuple = ()) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials(root_certificates=self.cert_pem)
        return grpc.secure_channel(
            address, creds, options=[*options, ("grpc.ssl_target_name_override", TLS_NAME)]
        )

    def ssl_context(self) -> ssl.SSLContext:
        """For HTTPS clients (httpx `verify=`): trusts the cluster's certificate only."""
        return ssl.create_default_context(cadata=self.cert_pem.decode())


def grpc_channel(
    address: str, credentials: ClientCredentials | None, options: list | tuple = ()
) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return credentials.channel(address, options)


@dataclass(frozen=True)
class ServerSecrets:
    """What main needs to serve: its certificate + key and the token it admits."""

    token: str
    cert: Path
    key: Path

    @classmethod
    def from_key_dir(cls, key_dir: str | Path) -> ServerSecrets:
        keys = KeyDir(Path(key_dir))
        check_certificate(keys.cert)
        read_secret(keys.tls_key, "TLS private key")
        return cls(read_token(keys.token), keys.cert, keys.tls_key)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])

    def authorized(self, header: str | None) -> bool:
        """`header` is an `Authorization` value; compared in constant time."""
        return header is not None and hmac.compare_digest(header.encode(), f"Bearer {self.token}".encode())


class BearerToken(grpc.ServerInterceptor):
    """Every RPC (health checks included) must carry `authorization: Bearer <token>`: otherwise it
    ends UNAUTHENTICATED before its handler runs, so no work is done for it."""

    def __init__(self, secrets_: ServerSecrets):
        self.secrets = secrets_

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        header = dict(details.invocation_metadata or ()).get("authorization")
        if handler is None or self.secrets.authorized(header):
            return handler
        return _refusal(handler, "missing or wrong bearer token" if header else "no bearer token")


def _refusal(handler, why: str):
    def refuse(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{why}: this cluster admits only its own clients")

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, handler.request_deserializer, handler.response_serializer)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class NodeSecurity:
    """What one node process loads at start (None fields: security off)."""

    curve: Curve | None = None
    client: ClientCredentials | None = None  # for main's Join RPC (workers, shadow)
    server: ServerSecrets | None = None  # main only

    @classmethod
    def load(cls, enabled: bool, key_dir: str, name: str, serves_clients: bool = False) -> NodeSecurity:
        if not enabled:
            return cls()
        return cls(
            curve=Curve.load(key_dir, name),
            client=ClientCredentials.from_key_dir(key_dir),
            server=ServerSecrets.from_key_dir(key_dir) if serves_clients else None,
        )
