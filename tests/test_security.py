"""Only the cluster's own nodes and its users get in (odmoe/transport/security.py).

Unit tests of the key files; real CURVE sockets in this process with each node's ZAP admission
(which role's key each server socket takes, revocation without a restart); then a real local cluster
(security on, as by default) probed from outside with real sockets: a peer without the keys gets
nothing from any ZeroMQ socket, a node's key is refused on the sockets its role does not talk to, a
revoked key is refused while the cluster goes on serving, a client without the token is refused, a
worker holding another key is refused by main at start-up by name, and the cluster's own client
still gets the reference tokens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import grpc
import httpx
import pytest
import zmq
import zmq.auth
from grpc_health.v1 import health_pb2, health_pb2_grpc
from zmq.utils.monitor import recv_monitor_message

from odmoe import LocalCluster
from odmoe.launch.local_cluster import ClusterStartError, NodePlacement
from odmoe.launch.settings import compose
from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.transport.messages import Ping, to_frames
from odmoe.transport.security import (
    SERVER_SOCKETS,
    ClientCredentials,
    Curve,
    KeyDir,
    SecurityError,
    add_node_key,
    check_certificate,
    init_key_dir,
    load_keypair,
    load_public_key,
    read_token,
    refusal,
    revoke_node_key,
    role_of,
    secure_server,
)
from tests.test_cluster_fidelity import reference

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

PROMPT = "def fibonacci(n):"


# -- key files ------------------------------------------------------------------------------------
@pytest.mark.integration  # runs the odmoe-keys command
def test_keys_init_writes_secrets_0600(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "odmoe.launch.keys", "init", str(tmp_path / "k"), "--workers", "2"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    keys = KeyDir(tmp_path / "k")
    for secret in [keys.token, keys.tls_key, *(keys.secret_key(n) for n in ("main", "shadow", "worker1"))]:
        assert secret.stat().st_mode & 0o777 == 0o600, secret
    assert keys.private.stat().st_mode & 0o777 == 0o700
    curve = Curve.load(keys.root, "worker1")
    assert curve.server_key("shadow") == load_public_key(keys.public_key("shadow"))
    assert len(read_token(keys.token)) >= 32
    again = subprocess.run(
        [sys.executable, "-m", "odmoe.launch.keys", "init", str(keys.root), "--workers", "2"],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "already holds cluster keys" in again.stderr


def test_key_files_give_clear_errors(tmp_path):
    keys = init_key_dir(tmp_path / "k", workers=1)
    secret = keys.secret_key("worker0")
    secret.chmod(0o644)
    with pytest.raises(SecurityError, match=r"accessible by others \(mode 0644\).*chmod 600"):
        load_keypair(secret)
    secret.chmod(0o600)
    with pytest.raises(SecurityError, match=r"missing: create the cluster's keys with `odmoe-keys init"):
        Curve.load(keys.root, "worker7")
    keys.token.chmod(0o640)
    with pytest.raises(SecurityError, match="client token .* accessible by others"):
        ClientCredentials.from_key_dir(keys.root)
    keys.token.write_text("short\n")
    keys.token.chmod(0o600)
    with pytest.raises(SecurityError, match="does not hold a token"):
        read_token(keys.token)
    secret.write_text("hello, not a certificate\n")
    with pytest.raises(SecurityError, match="is not a ZeroMQ certificate"):
        load_keypair(secret)
    secret.write_text('metadata\ncurve\n    public-key = "abc"\n    secret-key = "def"\n')
    with pytest.raises(SecurityError, match="not a 40-character Z85 CURVE key"):
        load_keypair(secret)
    keys.cert.write_text("not pem")
    with pytest.raises(SecurityError, match="is not a PEM certificate"):
        check_certificate(keys.cert)
    # a keypair that is not the one the allow-list knows by that name
    other = init_key_dir(tmp_path / "other", workers=1)
    os.replace(other.secret_key("worker0"), keys.secret_key("shadow"))
    with pytest.raises(SecurityError, match="is not the key the cluster knows as 'shadow'"):
        Curve.load(keys.root, "shadow")


def test_config_refuses_an_open_lan_unless_said():
    with pytest.raises(ValueError, match="needs security.key_dir"):
        compose(["role=worker"])
    with pytest.raises(ValueError, match=r"would expose 0\.0\.0\.0 without authentication"):
        compose(["role=worker", "security.enabled=false", "cluster.host=0.0.0.0"])
    cfg = compose(
        ["role=worker", "security.enabled=false", "cluster.host=0.0.0.0", "security.insecure_lan=true"]
    )
    assert not cfg.security.enabled
    assert not compose(["role=worker", "security.enabled=false"]).security.enabled  # loopback: fine
    assert compose(["role=local"]).security.enabled  # on by default


@pytest.mark.integration  # starts a process
def test_node_refuses_world_readable_secret(tmp_path):
    keys = init_key_dir(tmp_path / "k", workers=2)
    keys.secret_key("worker0").chmod(0o604)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "odmoe.launch.cli",
            "role=worker",
            "model.path=tiny",
            f"security.key_dir={keys.root}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "worker0.key_secret is accessible by others (mode 0604)" in out.stderr


# -- keys bound to roles: real CURVE sockets, this process ------------------------------------------
# Who connects to which server socket, as the nodes do it: main's DEALER to each worker, main's PUSH
# and SUB to the shadow, each worker's SUB to the shadow. Everything else must be refused.
ADMITTED = {
    ("worker", "main"),
    ("shadow-control", "main"),
    ("shadow-predictions", "main"),
    ("shadow-predictions", "worker1"),
}
SERVER_OF = {"worker": "worker0", "shadow-control": "shadow", "shadow-predictions": "shadow"}
CLIENT_KIND = {"worker": zmq.DEALER, "shadow-control": zmq.PUSH, "shadow-predictions": zmq.SUB}


def test_role_rule(tmp_path):
    assert [role_of(n) for n in ("main", "shadow", "worker0", "worker12")] == [
        "main",
        "shadow",
        "worker",
        "worker",
    ]
    assert [role_of(n) for n in ("main1", "worker", "worker01", "workers1", "box3")] == [None] * 5
    assert refusal("worker", "main", revoked=False) is None
    assert "only" in refusal("worker", "worker1", revoked=False)
    assert "revoked" in refusal("shadow-predictions", "worker1", revoked=True)
    assert "not in public/" in refusal("shadow-predictions", None, revoked=False)
    assert "has no role" in refusal("shadow-predictions", "box3", revoked=False)
    keys = init_key_dir(tmp_path / "k", workers=1)
    with pytest.raises(SecurityError, match="not a node name"):
        add_node_key(keys, "box3")
    with pytest.raises(SecurityError, match="exists already: .* revoke"):
        add_node_key(keys, "worker0")


def handshake(
    ctx: zmq.Context, kind: int, address: str, keypair: tuple[bytes, bytes], server_key: bytes
) -> str:
    """Connect a CURVE client holding `keypair` to `address`: "admitted", "refused" (the server's
    ZAP handler said no) or "no answer" within 5 s. What a node's own socket would meet."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_publickey, sock.curve_secretkey = keypair
    sock.curve_serverkey = server_key
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    sock.connect(address)
    try:
        if not monitor.poll(5000):
            return "no answer"
        event = recv_monitor_message(monitor)["event"]
        return "admitted" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def _keypair(keys: KeyDir, node: str) -> tuple[bytes, bytes]:
    return load_keypair(keys.secret_key(node))


@pytest.fixture
def node_sockets(tmp_path):
    """Each kind of node server socket, bound on 127.0.0.1 with its node's key and ZAP handler, as
    nodes/worker.py and nodes/shadow.py make them (a context each, as each node is a process of its
    own): (keys, a client context, socket kind -> address)."""
    keys = init_key_dir(tmp_path / "k", workers=2)
    contexts = {node: zmq.Context() for node in ("worker0", "shadow")}
    auths = [Curve.load(keys.root, node).authenticator(ctx) for node, ctx in contexts.items()]
    socks, addresses = [], {}
    for socket, node in SERVER_OF.items():
        kind = {"worker": zmq.ROUTER, "shadow-control": zmq.PULL, "shadow-predictions": zmq.PUB}[socket]
        sock = contexts[node].socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        secure_server(sock, Curve.load(keys.root, node), socket)
        addresses[socket] = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
        socks.append(sock)
    clients = zmq.Context()
    yield keys, clients, addresses
    for sock in socks:
        sock.close(0)
    for auth in auths:
        auth.stop()
    for ctx in (*contexts.values(), clients):
        ctx.term()


def test_each_node_socket_admits_the_keys_of_its_roles_only(node_sockets, caplog):
    keys, ctx, addresses = node_sockets
    assert set(addresses) == set(SERVER_SOCKETS)
    caplog.set_level("WARNING", logger="odmoe.transport.security")
    for socket, address in addresses.items():
        server_key = load_public_key(keys.public_key(SERVER_OF[socket]))
        for client in ("main", "shadow", "worker1"):
            want = "admitted" if (socket, client) in ADMITTED else "refused"
            got = handshake(ctx, CLIENT_KIND[socket], address, _keypair(keys, client), server_key)
            assert got == want, (client, socket)
        # a key the cluster never made: refused everywhere
        assert handshake(ctx, CLIENT_KIND[socket], address, zmq.curve_keypair(), server_key) == "refused"
    # refused twice more: still one line each, naming the key's node and the socket
    for _ in range(2):
        handshake(ctx, zmq.DEALER, addresses["worker"], _keypair(keys, "worker1"), _server(keys, "worker0"))
    lines = [r.getMessage() for r in caplog.records]
    refused_worker1 = [line for line in lines if "from worker1 on a worker's ROUTER" in line]
    assert len(refused_worker1) == 1, lines
    assert refused_worker1[0].startswith("worker0: refused a CURVE handshake from worker1")
    assert "admits main only" in refused_worker1[0]
    assert any("from shadow on the shadow's prediction PUB" in line for line in lines), lines
    assert any("from worker1 on the shadow's control PULL" in line for line in lines), lines


def _server(keys: KeyDir, node: str) -> bytes:
    return load_public_key(keys.public_key(node))


def _keys_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "odmoe.launch.keys", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.integration  # runs the odmoe-keys command
def test_a_revoked_key_is_refused_without_a_restart_and_add_makes_a_new_one(node_sockets, caplog):
    keys, ctx, addresses = node_sockets
    caplog.set_level("WARNING", logger="odmoe.transport.security")
    predictions, shadow = addresses["shadow-predictions"], _server(keys, "shadow")
    old = _keypair(keys, "worker1")
    assert handshake(ctx, zmq.SUB, predictions, old, shadow) == "admitted"
    out = _keys_cli("revoke", str(keys.root), "worker1")
    assert out.returncode == 0, out.stderr
    assert not keys.public_key("worker1").exists() and not keys.secret_key("worker1").exists()
    assert handshake(ctx, zmq.SUB, predictions, old, shadow) == "refused"  # the same running socket
    assert any(
        "from worker1 on the shadow's prediction PUB: worker1's key was revoked" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    shown = _keys_cli("show", str(keys.root))
    assert shown.returncode == 0 and "revoked:         worker1" in shown.stdout, shown.stdout
    assert _keys_cli("revoke", str(keys.root), "worker1").returncode == 2  # nothing left to revoke
    # a new keypair for the name: admitted; the old one stays refused, even copied back into public/
    out = _keys_cli("add", str(keys.root), "worker1")
    assert out.returncode == 0, out.stderr
    new = _keypair(keys, "worker1")
    assert new != old
    assert handshake(ctx, zmq.SUB, predictions, new, shadow) == "admitted"
    (keys.public / "worker1-again.key").write_bytes((keys.revoked / "worker1.key").read_bytes())
    assert handshake(ctx, zmq.SUB, predictions, old, shadow) == "refused"
    # revoked twice: both keys kept, both listed
    revoke_node_key(keys, "worker1")
    assert sorted(p.name for p in keys.revoked.iterdir()) == ["worker1.1.key", "worker1.key"]
    assert handshake(ctx, zmq.SUB, predictions, new, shadow) == "refused"
    assert "worker1, worker1" in _keys_cli("show", str(keys.root)).stdout
    # revoking main: no socket takes main's old key any more
    main = _keypair(keys, "main")
    assert handshake(ctx, zmq.DEALER, addresses["worker"], main, _server(keys, "worker0")) == "admitted"
    revoke_node_key(keys, "main")
    assert handshake(ctx, zmq.DEALER, addresses["worker"], main, _server(keys, "worker0")) == "refused"


def _connects(ctx: zmq.Context, curve: Curve, node: str, address: str) -> bool:
    """Whether `curve`'s client socket to `node`, made as main makes its connections, completes a
    handshake within a second."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    curve.connect_to(sock, node)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    try:
        return bool(monitor.poll(1000))
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


@pytest.mark.integration  # ZeroMQ connections on 127.0.0.1 probed as main does, every second: ~2 s
def test_main_stops_connecting_to_a_revoked_worker_and_reaches_its_new_key(node_sockets, caplog):
    """Main re-reads a worker's key at each connection (its probes of a lost worker): once revoked it
    never connects to that key again, and never fails for it either; the name's new key is used."""
    keys, ctx, addresses = node_sockets
    caplog.set_level("WARNING", logger="odmoe.transport.security")
    main = Curve.load(keys.root, "main")
    assert _connects(ctx, main, "worker0", addresses["worker"])
    with pytest.raises(SecurityError, match="worker9.key is missing"):  # never known: a set-up mistake
        main.server_key("worker9")
    old, old_secret = load_public_key(keys.public_key("worker0")), keys.secret_key("worker0").read_bytes()
    revoke_node_key(keys, "worker0")
    for _ in range(2):  # as main's probes of a lost worker do, every second
        assert not _connects(ctx, main, "worker0", addresses["worker"])
    lines = [r.getMessage() for r in caplog.records if "worker0's key is revoked" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("main: worker0's key is revoked or gone"), lines
    shutil.copy(keys.revoked / "worker0.key", keys.public_key("worker0"))  # the old key copied back
    assert main.server_key("worker0") != old
    keys.secret_key("worker0").touch(mode=0o600)
    keys.secret_key("worker0").write_bytes(old_secret)  # a box that kept its copy of the secret
    with pytest.raises(SecurityError, match="was revoked .*odmoe-keys add DIR worker0"):
        Curve.load(keys.root, "worker0")
    keys.public_key("worker0").unlink()
    keys.secret_key("worker0").unlink()
    add_node_key(keys, "worker0")
    assert main.server_key("worker0") == load_public_key(keys.public_key("worker0")) != old


# -- a real cluster, probed from outside ------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(workers=2, group_size=2) as c:
        yield c


def _stranger(ctx: zmq.Context, kind: int, tmp_path, server_key: bytes | None) -> zmq.Socket:
    """A socket of a peer on the LAN: plain (server_key None) or CURVE with its own keypair."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), f"stranger{kind}")
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(secret_file)
        sock.curve_serverkey = server_key
    return sock


@pytest.mark.integration
def test_peer_without_keys_gets_nothing(cluster, tmp_path, reap_children):
    ctx = zmq.Context.instance()
    keys = KeyDir(cluster.key_dir)
    probes = []
    for i, address in enumerate(cluster.worker_addresses):
        for server_key in (None, load_public_key(keys.public_key(f"worker{i}"))):
            sock = _stranger(ctx, zmq.DEALER, tmp_path, server_key)
            sock.connect(address)
            sock.send_multipart(to_frames(Ping(shadow_pub="")))
            probes.append(sock)
    subs = []
    for server_key in (None, load_public_key(keys.public_key("shadow"))):
        sub = _stranger(ctx, zmq.SUB, tmp_path, server_key)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(cluster.shadow_info["pub_address"])
        subs.append(sub)
    time.sleep(0.5)  # let the subscriptions reach the shadow, as a real subscriber's would
    result = cluster.client.generate(PROMPT, max_new_tokens=8)
    assert result.stats["recall"]["overall"] is not None  # the shadow did publish predictions
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        for sock in probes + subs:
            assert not sock.poll(0), "a peer without the cluster's keys received a frame"
        time.sleep(0.05)
    for sock in probes + subs:
        sock.close(0)
    want, _ = reference(cluster.model_path, PROMPT, new_tokens=8)
    assert result.token_ids == want


# (server socket, whose key connects): each a node key on a socket its role never talks to
WRONG_ROLE = {
    "worker-key-as-main-to-a-worker": ("worker", "worker1"),
    "shadow-key-to-a-worker": ("worker", "shadow"),
    "worker-key-to-the-shadow-control": ("shadow-control", "worker0"),
    "shadow-key-to-its-own-control": ("shadow-control", "shadow"),
}


def _address(cluster, socket: str) -> str:
    if socket == "worker":
        return cluster.worker_addresses[0]
    return cluster.shadow_info["address" if socket == "shadow-control" else "pub_address"]


@pytest.mark.integration
@pytest.mark.parametrize("case", list(WRONG_ROLE))
def test_a_node_key_is_refused_on_a_socket_its_role_does_not_use(cluster, case, reap_children):
    socket, client = WRONG_ROLE[case]
    keys, server = KeyDir(cluster.key_dir), SERVER_OF[socket]
    ctx = zmq.Context.instance()
    address, server_key = _address(cluster, socket), _server(keys, server)
    assert handshake(ctx, CLIENT_KIND[socket], address, _keypair(keys, client), server_key) == "refused"
    # the same socket takes main's key (a standby main's too: all mains hold it)
    assert handshake(ctx, CLIENT_KIND[socket], address, _keypair(keys, "main"), server_key) == "admitted"
    line = f"{server}: refused a CURVE handshake from {client} on {SERVER_SOCKETS[socket].what}"
    deadline = time.monotonic() + 5
    while line not in cluster.node(server).log_file.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.node(server).log_file.read_text().count(line) == 1, cluster.node(server).log_tail()
    if socket == "worker":  # and a call sent on the refused connection never reaches the worker
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_publickey, sock.curve_secretkey = _keypair(keys, client)
        sock.curve_serverkey = server_key
        sock.connect(address)
        sock.send_multipart(to_frames(Ping(shadow_pub="")))
        assert not sock.poll(1000), "a worker answered a ping from a key that is not main's"
        sock.close(0)


@pytest.mark.integration
def test_a_revoked_key_is_refused_while_the_cluster_serves_the_same_tokens(cluster, reap_children):
    """A worker key added to the running cluster's key directory is admitted to the predictions at
    once; revoked, it is refused from the next handshake on, with one line in the shadow's log, and
    the cluster goes on serving the reference tokens. No node restarts."""
    keys, ctx = KeyDir(cluster.key_dir), zmq.Context.instance()
    predictions, shadow = cluster.shadow_info["pub_address"], _server(keys, "shadow")
    spare = f"worker{len(cluster.worker_addresses)}"
    assert _keys_cli("add", str(keys.root), spare).returncode == 0
    key = _keypair(keys, spare)
    assert handshake(ctx, zmq.SUB, predictions, key, shadow) == "admitted"  # no restart needed
    want, _ = reference(cluster.model_path, PROMPT, new_tokens=8)
    assert cluster.client.generate(PROMPT, max_new_tokens=8).token_ids == want
    out = _keys_cli("revoke", str(keys.root), spare)
    assert out.returncode == 0, out.stderr
    assert handshake(ctx, zmq.SUB, predictions, key, shadow) == "refused"
    assert cluster.client.generate(PROMPT, max_new_tokens=8).token_ids == want
    line = f"refused a CURVE handshake from {spare} on the shadow's prediction PUB: {spare}'s key was revoked"
    assert cluster.node("shadow").log_file.read_text().count(line) == 1, cluster.node("shadow").log_tail()


@pytest.mark.integration
def test_client_without_token_is_refused(cluster, reap_children):
    before = _prompt_tokens(cluster)
    request = odmoe_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=4)
    with grpc.insecure_channel(cluster.address) as plain:  # no TLS at all
        with pytest.raises(grpc.RpcError) as err:
            list(odmoe_pb2_grpc.InferenceStub(plain).Generate(request, timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    creds = cluster.credentials
    wrong = ClientCredentials("x" * 43, creds.cert_pem)
    for metadata in (None, wrong.metadata):
        with creds.channel(cluster.address) as channel:
            stub = odmoe_pb2_grpc.InferenceStub(channel)
            calls = [
                lambda s=stub, m=metadata: list(s.Generate(request, timeout=5, metadata=m)),
                lambda s=stub, m=metadata: s.Join(
                    odmoe_pb2.JoinRequest(role="worker", index=0, address="tcp://127.0.0.1:1"),
                    timeout=5,
                    metadata=m,
                ),
                lambda s=stub, m=metadata: s.Info(odmoe_pb2.InfoRequest(), timeout=5, metadata=m),
                lambda c=channel, m=metadata: health_pb2_grpc.HealthStub(c).Check(
                    health_pb2.HealthCheckRequest(), timeout=5, metadata=m
                ),
            ]
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    body = {"model": "x", "prompt": PROMPT, "max_tokens": 4}
    tls = cluster.http_auth["verify"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")):
            reply = httpx.request(method, cluster.http_url + path, json=body, headers=headers, verify=tls)
            assert reply.status_code == 401, (path, reply.text)
            assert reply.json()["error"]["type"] == "authentication_error"
    assert httpx.get(cluster.http_url + "/health", verify=tls).json() == {"status": "ok"}
    with pytest.raises(httpx.HTTPError):  # plain HTTP gets no answer from an HTTPS port
        httpx.get(cluster.http_url.replace("https://", "http://") + "/v1/models", **cluster.http_auth)
    assert _prompt_tokens(cluster) == before  # no work was done for any of them
    # the cluster still answers its own client with the reference tokens
    want, _ = reference(cluster.model_path, PROMPT, new_tokens=6)
    assert cluster.client.generate(PROMPT, max_new_tokens=6).token_ids == want
    name = httpx.get(cluster.http_url + "/v1/models", **cluster.http_auth).json()["data"][0]["id"]
    answer = httpx.post(
        cluster.http_url + "/v1/completions",
        json={"model": name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0},
        timeout=60,
        **cluster.http_auth,
    )
    assert answer.status_code == 200, answer.text


def _prompt_tokens(cluster) -> float:
    page = httpx.get(cluster.http_url + "/metrics", **cluster.http_auth).text
    return sum(
        float(line.split()[-1]) for line in page.splitlines() if line.startswith("odmoe:prompt_tokens_total")
    )


@pytest.mark.integration
@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_worker_with_wrong_key_is_refused_by_name(tmp_path, reap_children):
    foreign = init_key_dir(tmp_path / "foreign", workers=2)  # a keypair main does not know as worker1

    def place(name: str) -> NodePlacement:
        return NodePlacement(words=[f"security.key_dir={foreign.root}"] if name == "worker1" else [])

    cluster = LocalCluster(workers=2, group_size=2, overrides=["shadow.enabled=false"], place=place)
    with pytest.raises(ClusterStartError) as err:
        cluster.start()
    message = str(err.value)
    assert "main exited" in message or "main" in message.splitlines()[0]
    assert "worker 1 (tcp://127.0.0.1:" in message and "failed the CURVE handshake" in message, message


@pytest.mark.extended  # a cluster of its own (~1 min here): CI runs it
def test_a_revoked_worker_is_dropped_then_its_new_key_taken_back(reap_children):
    """The whole replacement of a lost box: revoke worker1's key while it serves; main drops it within
    a second (as lost, though its process still runs) and goes on with worker0, tokens equal to the
    reference; its probes of worker1 meet a revoked key: no connection, no failure. A new key for the
    name, the node restarted with it: taken back, tokens still equal."""
    with LocalCluster(workers=2, group_size=2) as cluster:
        keys = KeyDir(cluster.key_dir)
        want, _ = reference(cluster.model_path, PROMPT, new_tokens=12)
        assert cluster.client.generate(PROMPT, max_new_tokens=12).token_ids == want
        assert _keys_cli("revoke", str(keys.root), "worker1").returncode == 0
        deadline = time.monotonic() + 10
        while cluster.client.info()["live_workers"] != [0]:
            assert time.monotonic() < deadline, "main kept using a revoked worker"
            time.sleep(0.1)
        got = cluster.client.generate(PROMPT, max_new_tokens=12)
        assert got.token_ids == want
        assert cluster.node("worker1").process.poll() is None  # still running: main just will not use it
        time.sleep(2.5)  # main probes the lost worker every second, with the key it reads then
        assert cluster.node("main").process.poll() is None
        info = cluster.client.info()
        assert info["live_workers"] == [0]
        assert any("revoked" in e["reason"] for e in info["membership_events"] if e["event"] == "lost")
        assert cluster.client.generate(PROMPT, max_new_tokens=12).token_ids == want
        log_text = cluster.node("main").log_file.read_text()
        assert log_text.count("main: worker1's key is revoked or gone") == 1, cluster.node("main").log_tail()
        assert _keys_cli("add", str(keys.root), "worker1").returncode == 0
        cluster.restart("worker1")  # announces itself; main reads worker1's new key and takes it back
        assert cluster.client.info()["live_workers"] == [0, 1]
        assert cluster.client.generate(PROMPT, max_new_tokens=12).token_ids == want
