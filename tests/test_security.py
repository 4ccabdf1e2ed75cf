"""Only the cluster's own nodes and its users get in (odmoe/transport/security.py).

Unit tests of the key files; then a real local cluster (security on, as by default) probed from
outside with real sockets: a peer without the keys gets nothing from any ZeroMQ socket, a client
without the token is refused, a worker holding another key is refused by main at start-up by
name, and the cluster's own client still gets the reference tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest
import zmq
import zmq.auth
from grpc_health.v1 import health_pb2, health_pb2_grpc

from odmoe import LocalCluster
from odmoe.launch.local_cluster import ClusterStartError, NodePlacement
from odmoe.launch.settings import compose
from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.transport.messages import Ping, to_frames
from odmoe.transport.security import (
    ClientCredentials,
    Curve,
    KeyDir,
    SecurityError,
    check_certificate,
    init_key_dir,
    load_keypair,
    load_public_key,
    read_token,
)
from tests.test_cluster_fidelity import reference

PROMPT = "def fibonacci(n):"


# -- key files ------------------------------------------------------------------------------------
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
