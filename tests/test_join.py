"""Issue 48, point 1: the join link — admission over TLS checked by the link's fingerprint, a secret
proved over a single-use nonce, roles handed out, and each refusal in one line.

The admission service runs on a real gRPC server with the cluster's TLS on 127.0.0.1; the boxes'
side is `odmoe.launch.join.admit`, as `odmoe-launch join=LINK` runs it. The cluster test starts main
with `cluster.join_port` and three `odmoe-launch join=LINK` processes (the shadow and two workers),
each with its own HOME and no checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from odmoe.launch.join import JoinRefused, admissions_for, admit
from odmoe.launch.settings import compose
from odmoe.main.admission import TokenUnlessJoining, join_link
from odmoe.models.checkpoint_index import build_index
from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.tools.model_names import resolve_model
from odmoe.transport.join_link import JoinLink, admission_proof, parse_link
from odmoe.transport.security import ServerSecrets, init_key_dir
from odmoe.transport.share_server import serve_share
from tests.test_cluster_fidelity import reference

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_a_link_round_trips_and_a_bad_one_says_what_it_should_be():
    link = JoinLink("s" * 24, "192.168.1.10", 50053, "ab" * 32)
    assert parse_link(str(link)) == link
    for bad in (
        "odmoe://short@h:1/" + "ab" * 32,
        "http://x",
        str(link)[:-1],
        str(link).replace("50053", "x"),
    ):
        with pytest.raises(ValueError, match="not a join link"):
            parse_link(bad)


def test_the_proof_binds_the_nonce_and_what_is_asked():
    base = admission_proof("secret", b"n" * 32, "worker", "", "10.0.0.2")
    assert base == admission_proof("secret", b"n" * 32, "worker", "", "10.0.0.2")
    for other in (
        admission_proof("secret", b"m" * 32, "worker", "", "10.0.0.2"),
        admission_proof("secret", b"n" * 32, "shadow", "", "10.0.0.2"),
        admission_proof("secret", b"n" * 32, "worker", "worker0", "10.0.0.2"),
        admission_proof("secret", b"n" * 32, "worker", "", "10.0.0.3"),
        admission_proof("other!", b"n" * 32, "worker", "", "10.0.0.2"),
    ):
        assert other != base


@pytest.fixture
def door(tmp_path):
    """Main's door as `role=main cluster.join_port=0` opens it: Share + Admission, TLS, the token."""
    keys = init_key_dir(tmp_path / "keys", 2)
    cfg = compose(["role=main", "cluster.workers=2", "cluster.group_size=1", "cluster.join_port=0",
                   f"security.key_dir={keys.root}"])  # fmt: skip
    where: dict[str, int] = {}
    admissions = admissions_for(cfg, ["worker.only_own_layers=true"], keys, "127.0.0.1", where)
    secrets = ServerSecrets.from_key_dir(keys.root)
    model = resolve_model("tiny")
    server, port, _ = serve_share(
        model, build_index(model), "127.0.0.1", 0, secrets,
        also=lambda s: odmoe_pb2_grpc.add_AdmissionServicer_to_server(admissions, s),
        token_check=TokenUnlessJoining(secrets),
    )  # fmt: skip
    where["port"] = port
    link = join_link(keys, keys.root / "join_secret", "127.0.0.1", port)
    yield link, admissions, keys, tmp_path
    server.stop(grace=0)


def test_boxes_are_handed_the_shadow_then_each_worker_then_the_cluster_is_full(door):
    link, admissions, keys, tmp = door
    names = []
    for box in range(3):
        reply, _, _ = admit(str(link), "", f"10.0.0.{box}", home=tmp / f"box{box}")
        names.append(reply.name)
        home = tmp / f"box{box}"  # its keypair is its own: main holds only the public half
        assert keys.public_key(reply.name).read_bytes() == (home / "box.key").read_bytes()
        assert not keys.secret_key(reply.name).exists() and not reply.secret_key
        assert set(reply.public_keys) == {"main", "shadow", "worker0", "worker1"}
        assert f"model.pull_from=127.0.0.1:{link.port}" in reply.words
        assert "worker.only_own_layers=true" in reply.words  # main's own settings travel
        assert ("worker.index=" + reply.name[-1] in reply.words) == reply.name.startswith("worker")
    assert names == ["shadow", "worker0", "worker1"]
    with pytest.raises(JoinRefused, match="the cluster is full.*larger cluster.workers"):
        admit(str(link), "", "10.0.0.9", home=tmp / "box9")
    again, _, _ = admit(str(link), "", "10.0.0.1", home=tmp / "box1")  # a restart: its name back
    assert again.name == "worker0"


def test_main_starts_with_min_workers_and_later_boxes_reach_it_ready(door):
    """cluster.min_workers: main's rendezvous returns once the shadow and that many workers serve
    ('' for the others), and a box ready after that is handed to main (`on_ready`)."""
    _, admissions, _, _ = door
    admissions.admitted.update({"shadow": "h", "worker0": "h", "worker1": "h"})
    admissions.ready.update({"worker0": ("tcp://h:1", "")})
    with pytest.raises(TimeoutError, match="shadow, worker1 did not join"):
        admissions.wait_ready(timeout_s=0.1, min_workers=1)  # the shadow comes first
    admissions.ready["shadow"] = ("tcp://h:2", "tcp://h:3")
    with pytest.raises(TimeoutError, match="worker1 did not join"):
        admissions.wait_ready(timeout_s=0.1)  # all of them, without min_workers
    assert admissions.wait_ready(timeout_s=0.1, min_workers=1) == (
        ["tcp://h:1", ""],
        ("tcp://h:2", "tcp://h:3"),
    )
    seen = []
    admissions.on_ready = lambda *node: seen.append(node)

    class Context:
        def abort(self, code, why):
            raise AssertionError(why)

    admissions.Ready(odmoe_pb2.ReadyRequest(name="worker1", address="tcp://h:4"), Context())
    assert seen == [("worker1", "tcp://h:4", "")]


def test_a_wrong_secret_a_wrong_fingerprint_and_a_rotated_secret_are_refused(door):
    link, admissions, keys, tmp = door
    wrong = JoinLink("x" * 32, link.host, link.port, link.fingerprint)
    with pytest.raises(JoinRefused, match="does not hold the link's secret"):  # main's proof fails first
        admit(str(wrong), "", "10.0.0.1", home=tmp / "a")
    from odmoe.transport.security import ClientCredentials

    with ClientCredentials(token="", cert_pem=keys.cert.read_bytes()).channel(link.address) as channel:
        stub = odmoe_pb2_grpc.AdmissionStub(channel)  # a box that skips that check: main refuses it
        nonce = stub.Challenge(odmoe_pb2.ChallengeRequest()).nonce
        proof = admission_proof("x" * 32, nonce, "", "", "10.0.0.1")
        with pytest.raises(grpc.RpcError) as refused:
            stub.Admit(odmoe_pb2.AdmitRequest(nonce=nonce, proof=proof, host="10.0.0.1"))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "wrong join secret" in refused.value.details()
    other_cert = init_key_dir(tmp / "other", 1)  # another cluster's certificate
    from odmoe.transport.join_link import fingerprint_of

    forged = JoinLink(link.secret, link.host, link.port, fingerprint_of(other_cert.cert.read_bytes()))
    with pytest.raises(JoinRefused, match="not the cluster the link is for; nothing was sent"):
        admit(str(forged), "", "10.0.0.1", home=tmp / "b")
    assert admissions.admitted == {}
    (keys.root / "join_secret").write_text("a-new-secret-after-rotation\n")
    with pytest.raises(JoinRefused, match="or it was rotated"):
        admit(str(link), "", "10.0.0.1", home=tmp / "c")
    assert admissions.admitted == {}


def test_a_replayed_admission_is_refused(door):
    link, admissions, keys, tmp = door
    from odmoe.transport.security import ClientCredentials

    credentials = ClientCredentials(token="", cert_pem=keys.cert.read_bytes())
    with credentials.channel(link.address) as channel:
        stub = odmoe_pb2_grpc.AdmissionStub(channel)
        nonce = stub.Challenge(odmoe_pb2.ChallengeRequest()).nonce
        import zmq.auth

        public, _ = zmq.auth.create_certificates(str(tmp), "box")
        request = odmoe_pb2.AdmitRequest(
            nonce=nonce,
            proof=admission_proof(link.secret, nonce, "", "", "10.0.0.1"),
            host="10.0.0.1",
            public_key=Path(public).read_bytes(),
        )
        assert stub.Admit(request).name == "shadow"
        with pytest.raises(grpc.RpcError) as refused:
            stub.Admit(request)  # the same message again, as an eavesdropper would send it
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "already used (a replay?)" in refused.value.details()
        with pytest.raises(grpc.RpcError) as no_token:  # Ready needs the token the box was handed
            stub.Ready(odmoe_pb2.ReadyRequest(name="shadow", address="tcp://10.0.0.1:1"))
        assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.integration  # real mDNS announcements on this host, each lookup waits out its 1.5 s: ~11 s
def test_main_found_by_mdns_must_prove_the_secret(door, monkeypatch):
    """join=auto:SECRET: main advertised by mDNS (a real zeroconf announcement on this host) is
    found, and joined only because it proves the secret; another advertiser with another
    certificate, and a wrong secret, are refused; two mains in sight and no name: refused naming them."""
    pytest.importorskip("zeroconf")
    from odmoe.launch.join import find_link
    from odmoe.transport.lan_discovery import advertise

    link, admissions, keys, tmp = door
    ours = advertise("odmoe test main", "127.0.0.1", link.port, link.fingerprint)
    try:
        found = find_link(f"auto:{link.secret}", timeout_s=1.5)
        assert found == str(link)
        reply, _, _ = admit(found, "", "10.0.0.1", home=tmp / "auto")
        assert reply.name == "shadow"
        with pytest.raises(JoinRefused, match="does not hold the link's secret"):
            admit(find_link("auto:" + "y" * 24, timeout_s=1.5), "", "10.0.0.1", home=tmp / "auto2")
        other = init_key_dir(tmp / "rogue", 1)
        from odmoe.transport.join_link import fingerprint_of

        rogue = advertise("odmoe rogue main", "127.0.0.1", link.port, fingerprint_of(other.cert.read_bytes()))
        try:
            with pytest.raises(JoinRefused, match="several mains in sight: odmoe rogue main"):
                find_link(f"auto:{link.secret}", timeout_s=1.5)
            # naming the rogue: its advertised fingerprint is not the certificate served there
            with pytest.raises(JoinRefused, match="not the cluster the link is for"):
                admit(
                    find_link(f"auto:{link.secret}@odmoe rogue main", timeout_s=1.5),
                    "",
                    "10.0.0.1",
                    home=tmp / "r",
                )
        finally:
            rogue.close()
    finally:
        ours.close()
    with pytest.raises(JoinRefused, match="no odmoe main found by mDNS"):
        find_link(f"auto:{link.secret}@nobody", timeout_s=1.5)


@pytest.mark.integration  # runs the odmoe-keys command
def test_a_revoked_box_is_refused_and_a_new_box_may_take_its_name(door):
    link, admissions, keys, tmp = door
    reply, home, _ = admit(str(link), "worker", "10.0.0.1", home=tmp / "box")
    assert reply.name == "worker0"
    done = subprocess.run(["odmoe-keys", "revoke", str(keys.root), "worker0"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with pytest.raises(JoinRefused, match="this box's key was revoked"):
        admit(str(link), "worker", "10.0.0.1", home=home)  # it restarts, asking for its name
    again, _, _ = admit(str(link), "worker", "10.0.0.2", home=tmp / "new-box")  # a new box, its own key
    assert again.name == "worker0"  # the revoked box's place, with the new box's key
    assert keys.public_key("worker0").read_bytes() == (tmp / "new-box" / "box.key").read_bytes()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_box(line: str, home: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "odmoe.launch.cli", line],
        stdout=subprocess.DEVNULL, stderr=open(home / "log", "ab"), env={**env, "HOME": str(home)},
        start_new_session=True,  # the box: this launcher and the node it starts, killed together
    )  # fmt: skip


def _name_of(home: Path) -> str:
    return json.loads(next(home.glob(".cache/odmoe/joined/*/identity.json")).read_text())["name"]


@pytest.mark.integration
@pytest.mark.extended  # main + three joining boxes, each pulling its share, one restarted: ~2-4 min here
def test_a_cluster_joined_only_by_the_link_serves_the_same_tokens(tmp_path, reap_children):
    """Main holds the checkpoint and makes its keys; the shadow and two workers start from nothing
    but the link (own HOME each: no keys, no checkpoint, no cache), pull their shares and serve.
    A box killed and started again with the same line gets its name back, pulls nothing, and main
    takes it back while serving."""
    from odmoe import Client

    model = resolve_model("tiny")
    key_dir, ready, log = tmp_path / "main-keys", tmp_path / "main.json", tmp_path / "main.log"
    env, port = dict(os.environ), _free_port()
    main = subprocess.Popen(
        [sys.executable, "-m", "odmoe.launch.cli", "role=main", f"model.path={model}", "cluster.workers=2",
         "cluster.group_size=1", "worker.only_own_layers=true", "cluster.join_port=0", "server.http=false",
         f"cluster.main_port={port}", f"security.key_dir={key_dir}", f"node.ready_file={ready}"],
        stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env,
    )  # fmt: skip
    boxes: dict[str, subprocess.Popen] = {}
    want, _ = reference(model, "def fibonacci(n):", new_tokens=12)
    try:
        deadline = time.monotonic() + 300
        while not (key_dir / "join-link").exists():
            assert main.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        line = (key_dir / "join-link").read_text().split()[-1]  # odmoe-launch join=LINK
        for b in range(3):
            (tmp_path / f"box{b}").mkdir()
            boxes[f"box{b}"] = _start_box(line, tmp_path / f"box{b}", env)
        while not ready.exists():
            assert main.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        with Client(f"127.0.0.1:{port}", credentials=str(key_dir)) as client:
            assert list(client.generate("def fibonacci(n):", max_new_tokens=12).token_ids) == want
            names = {_name_of(tmp_path / b): b for b in boxes}
            assert set(names) == {"shadow", "worker0", "worker1"}
            records = {b: next((tmp_path / b).glob(".cache/odmoe/pulled/*/odmoe-share.json")) for b in boxes}
            pulled = {b: json.loads(r.read_text())["pulled_bytes_total"] for b, r in records.items()}
            assert all(pulled.values())  # no box had the checkpoint: each pulled what it holds
            # worker1's box dies and is started again with the same line
            box = names["worker1"]
            before = client.info()["workers"][1]["address"]
            os.killpg(boxes[box].pid, 9)
            boxes[box].wait()
            boxes[box] = _start_box(line, tmp_path / box, env)
            while True:  # main takes it back (its Join through cluster.main_addresses)
                info = client.info()
                if 1 in info["live_workers"] and info["workers"][1]["address"] != before:
                    break
                assert time.monotonic() < deadline + 120, (tmp_path / box / "log").read_text()[-2000:]
                time.sleep(0.2)
            assert _name_of(tmp_path / box) == "worker1"
            assert json.loads(records[box].read_text())["pulled_bytes_total"] == pulled[box]  # nothing again
            assert list(client.generate("def fibonacci(n):", max_new_tokens=12).token_ids) == want
    finally:
        for p in boxes.values():
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
        main.terminate()
        for p in [*boxes.values(), main]:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _can_make_namespaces() -> bool:
    try:
        probe = subprocess.run(["ip", "netns", "add", "odmoe-probe"], capture_output=True)
    except FileNotFoundError:
        return False
    subprocess.run(["ip", "netns", "del", "odmoe-probe"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.integration
@pytest.mark.extended  # four namespaces, main + three boxes joined by the link: ~2-3 min here
def test_boxes_in_their_own_network_namespaces_join_by_the_link(tmp_path, reap_children):
    """netns_lan's LAN: main (with the checkpoint) and three boxes, each in its namespace with its
    own HOME; the boxes are given only the link and reach main over the bridge."""
    if not _can_make_namespaces():
        pytest.skip("cannot create network namespaces here (needs root and iproute2)")
    from odmoe import Client
    from odmoe_bench.netns_lan import Lan

    model = resolve_model("tiny")
    key_dir, ready = tmp_path / "main-keys", tmp_path / "main.json"
    nodes = ["main", "box0", "box1", "box2"]
    with Lan(nodes, gbit=1.0, latency_ms=0.1) as lan:
        main_host = lan.address("main")
        procs = [
            subprocess.Popen(
                ["ip", "netns", "exec", lan.namespace("main"), sys.executable, "-m", "odmoe.launch.cli",
                 "role=main", f"model.path={model}", "cluster.workers=2", "cluster.group_size=1",
                 "worker.only_own_layers=true", f"cluster.host={main_host}", "cluster.main_port=50051",
                 "cluster.join_port=50053", "server.http=false", f"security.key_dir={key_dir}",
                 f"node.ready_file={ready}"],
                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "main.log", "wb"),
            )
        ]  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not (key_dir / "join-link").exists():
                assert procs[0].poll() is None and time.monotonic() < deadline, (
                    tmp_path / "main.log"
                ).read_text()
                time.sleep(0.1)
            line = (key_dir / "join-link").read_text().split()[-1]
            assert f"@{main_host}:50053/" in line
            for box in nodes[1:]:
                home = tmp_path / box
                home.mkdir()
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", lan.namespace(box), sys.executable, "-m", "odmoe.launch.cli",
                         line],
                        stdout=subprocess.DEVNULL, stderr=open(home / "log", "wb"),
                        env={**os.environ, "HOME": str(home)},
                    )
                )  # fmt: skip
            while not ready.exists():
                assert procs[0].poll() is None and time.monotonic() < deadline + 180, (
                    tmp_path / "main.log"
                ).read_text()
                time.sleep(0.1)
            with Client(f"{main_host}:50051", credentials=str(key_dir)) as client:
                got = client.generate("def fibonacci(n):", max_new_tokens=12)
            want, _ = reference(model, "def fibonacci(n):", new_tokens=12)
            assert list(got.token_ids) == want
            served = {
                json.loads(next((tmp_path / b).glob(".cache/odmoe/joined/*/identity.json")).read_text())[
                    "name"
                ]: b
                for b in nodes[1:]
            }
            assert set(served) == {"shadow", "worker0", "worker1"}
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()


@pytest.mark.integration  # runs the odmoe-keys command
def test_rotating_the_secret_refuses_old_links_and_rewrites_the_line(door):
    link, admissions, keys, tmp = door
    (keys.root / "join-link").write_text(f"odmoe-launch join={link}\n")
    done = subprocess.run(["odmoe-keys", "rotate-join", str(keys.root)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    line = (keys.root / "join-link").read_text().split()[-1]
    assert line in done.stdout and str(link) not in line
    assert oct((keys.root / "join_secret").stat().st_mode & 0o777) == "0o600"
    with pytest.raises(JoinRefused, match="or it was rotated"):
        admit(str(link), "", "10.0.0.1", home=tmp / "old")
    reply, _, _ = admit(line.removeprefix("join="), "", "10.0.0.1", home=tmp / "new")
    assert reply.name == "shadow"


def test_a_box_takes_main_s_allow_list_revocations_included(tmp_path):
    """A key main no longer holds (revoked there) leaves this box's public/ for its revoked/."""
    from odmoe.launch.join import _refresh_public

    keys = init_key_dir(tmp_path / "keys", 2)
    held = {p.stem: p.read_bytes() for p in keys.public.glob("*.key") if p.stem != "worker1"}
    held["worker0"] = b"changed"
    assert _refresh_public(keys, held) == 2
    assert not keys.public_key("worker1").exists() and (keys.revoked / "worker1.key").exists()
    assert keys.public_key("worker0").read_bytes() == b"changed"
    assert _refresh_public(keys, held) == 0


@pytest.mark.integration
@pytest.mark.extended  # main + three joining boxes, one of them while main serves: ~2-3 min here
def test_a_box_joining_a_serving_cluster_is_taken_in_and_given_work(tmp_path, reap_children):
    """Growth (issue 48, point 5): with cluster.min_workers=1 main serves as soon as the shadow and
    one worker have joined; a second worker's box joins by the same line while a stream runs, is
    taken in without stopping it, and computes experts from then on; every token is the reference's."""
    import threading

    from odmoe import Client

    model = resolve_model("tiny")
    key_dir, ready, log = tmp_path / "main-keys", tmp_path / "main.json", tmp_path / "main.log"
    env, port = dict(os.environ), _free_port()
    main = subprocess.Popen(
        [sys.executable, "-m", "odmoe.launch.cli", "role=main", f"model.path={model}", "cluster.workers=2",
         "cluster.group_size=2", "cluster.min_workers=1", "worker.cache=0", "cluster.join_port=0",
         "server.http=false", f"cluster.main_port={port}", f"security.key_dir={key_dir}",
         f"node.ready_file={ready}"],
        stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env,
    )  # fmt: skip
    boxes: list[subprocess.Popen] = []
    prompt = "def fibonacci(n):"
    want, _ = reference(model, prompt, new_tokens=24)
    try:
        deadline = time.monotonic() + 300
        while not (key_dir / "join-link").exists():
            assert main.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        line = (key_dir / "join-link").read_text().split()[-1]
        for b in range(2):  # the shadow, then worker0
            (tmp_path / f"box{b}").mkdir()
            boxes.append(_start_box(line, tmp_path / f"box{b}", env))
        while not ready.exists():
            assert main.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        with Client(f"127.0.0.1:{port}", credentials=str(key_dir)) as client:
            assert client.info()["live_workers"] == [0]  # serving with one of its two workers
            first = client.generate(prompt, max_new_tokens=24)
            assert list(first.token_ids) == want and set(first.stats["per_worker"]) == {"worker0"}
            runs: list[list[int]] = []
            joined = threading.Event()

            def keep_streaming() -> None:  # requests back to back from before the box starts until after
                while not joined.is_set() or len(runs) < 2:
                    runs.append([piece.token_id for piece in client.stream(prompt, max_new_tokens=24)])

            stream = threading.Thread(target=keep_streaming)
            stream.start()
            (tmp_path / "box2").mkdir()
            boxes.append(_start_box(line, tmp_path / "box2", env))  # a box joins the serving cluster
            while 1 not in client.info()["live_workers"]:
                assert time.monotonic() < deadline + 120, (tmp_path / "box2" / "log").read_text()[-2000:]
                time.sleep(0.2)
            joined.set()
            stream.join(timeout=120)
            assert len(runs) >= 2 and all(r == want for r in runs)  # served throughout, the same tokens
            assert _name_of(tmp_path / "box2") == "worker1"
            after = client.generate(prompt, max_new_tokens=24)
            assert list(after.token_ids) == want
            assert after.stats["per_worker"]["worker1"]["experts"] > 0  # given its share of the work
            assert client.info()["homes_problem"] == ""  # checked once grown: the homes fit
    finally:
        for p in boxes:
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
        main.terminate()
        for p in [*boxes, main]:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
