"""The pure parts of role=ray (odmoe.launch.ray_cluster), without a Ray cluster: which Ray nodes can
hold a role, which key files each role is given (and that they work), what the launcher keeps for
itself. The real placement is tests/test_ray_cluster.py."""

from __future__ import annotations

import stat

import pytest

from odmoe.config import RayRoleConfig
from odmoe.launch.ray_cluster import RayCluster, SecretFiles, offered, role_key_files
from odmoe.launch.settings import compose
from odmoe.transport.security import Curve, KeyDir, init_key_dir, revoke_node_key

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def _node(node_id: str, alive=True, labels=None, **resources) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 1.0, **resources}, "Labels": labels or {}}


def test_a_role_is_offered_only_nodes_with_its_resources_and_labels():
    nodes = [
        _node("head"),
        _node("w1", role_worker=1.0),
        _node("w2", role_worker=1.0, labels={"odmoe-role": "worker"}),
        _node("gone", alive=False, role_worker=1.0),
        _node("gpu", GPU=1.0, role_worker=1.0, labels={"odmoe-role": "worker"}),
    ]
    ids = lambda role: [n["NodeID"] for n in offered(nodes, role)]  # noqa: E731
    assert ids(RayRoleConfig()) == ["head", "w1", "w2", "gpu"]
    assert ids(RayRoleConfig(resources={"role_worker": 1})) == ["w1", "w2", "gpu"]
    assert ids(RayRoleConfig(labels={"odmoe-role": "worker"})) == ["w2", "gpu"]
    assert ids(RayRoleConfig(num_gpus=1, resources={"role_worker": 1})) == ["gpu"]
    assert ids(RayRoleConfig(num_cpus=2)) == []


def test_each_role_gets_its_own_secret_only_and_the_files_work(tmp_path):
    keys = init_key_dir(tmp_path / "keys", workers=3)
    revoke_node_key(keys, "worker2")
    worker = role_key_files(keys, "worker1", "worker1")
    main = role_key_files(keys, "main1", "main")  # a standby main: main's key
    assert sorted(k for k in worker.files if k.startswith("private/")) == ["private/worker1.key_secret"]
    assert "tls/key.pem" not in worker.files and "tls/key.pem" in main.files
    assert sorted(k for k in main.files if k.startswith("private/")) == ["private/main.key_secret"]
    assert {f"public/{n}.key" for n in ("main", "shadow", "worker0", "worker1")} <= set(worker.files)
    secret = keys.secret_key("worker1").read_bytes()
    assert secret.decode() not in repr(worker) and repr(worker).startswith("SecretFiles(")

    root = worker.write(tmp_path / "node" / "keys")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / "private" / "worker1.key_secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((root / "token").stat().st_mode) == 0o600
    assert stat.S_IMODE((root / "public" / "main.key").stat().st_mode) == 0o644
    curve = Curve.load(root, "worker1")  # refuses a secret others can read, or a mismatched pair
    assert curve.server_key("main") == Curve.load(keys.root, "main").public
    assert not (KeyDir(root).secret_key("worker0")).exists()
    # the revoked key travels as revoked: refused by name, even if some copy of it is in public/
    assert "public/worker2.key" not in worker.files
    assert (root / "revoked" / "worker2.key").read_bytes() == (keys.revoked / "worker2.key").read_bytes()


def test_secret_files_repr_names_no_path_or_content():
    files = SecretFiles({"private/worker0.key_secret": b"secret-key = 'x'", "token": b"t0k3n"})
    assert repr(files) == "SecretFiles(2 files)"


def test_the_launchers_own_words_do_not_reach_the_nodes(model_dirs):
    words = [
        "role=ray",
        "ray.address=10.0.0.1:6379",
        "+ray.worker.resources={role_worker:1}",
        f"model.path={model_dirs['mixtral']}",
        "security.key_dir=/somewhere",
        "cluster.host=0.0.0.0",
        "alignment.token_period=2",
        "server.http_port=0",
    ]
    cfg = compose([w for w in words if not w.startswith("security.key_dir")])
    cluster = RayCluster(cfg, words)
    assert cluster.words == ["alignment.token_period=2", "server.http_port=0"]
    assert cluster.model_path == model_dirs["mixtral"]
