"""Issue 48, point 3: a box that lacks the checkpoint pulls only its share of it, verified, resumable.

The Share service is a real gRPC server on 127.0.0.1 reading real files; a cluster test starts a
`role=seed` process and workers and a shadow that pull from it (model.pull_from) before they load."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import grpc
import pytest
import torch

from odmoe.launch.local_cluster import LocalCluster, NodePlacement
from odmoe.models.checkpoint import CheckpointError
from odmoe.models.checkpoint_index import SHARE_STATE, build_index
from odmoe.models.families import is_expert_key, layer_of_key
from odmoe.models.open_model import open_checkpoint
from odmoe.models.share_pull import ShareError, pull_share
from odmoe.rpc import odmoe_pb2_grpc
from odmoe.tools.model_names import resolve_model
from odmoe.transport.security import ClientCredentials, init_key_dir
from odmoe.transport.share_server import serve_share
from tests.test_cluster_fidelity import reference

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


@pytest.fixture
def source(tmp_path):
    """A copy of the tiny model (the tests change its bytes) served insecurely on a free port."""
    model = tmp_path / "source"
    shutil.copytree(resolve_model("tiny"), model)
    served = []

    def serve(index=None):
        server, port, servicer = serve_share(model, index or build_index(model), "127.0.0.1", 0, None)
        served.append(server)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        return odmoe_pb2_grpc.ShareStub(channel), servicer

    yield model, serve
    for server in served:
        server.stop(grace=0)


def experts_of(*layers):
    def choose(index, dest):
        checkpoint = open_checkpoint(dest)
        return {k for k in checkpoint.weight_map if is_expert_key(k) and layer_of_key(k) in layers}

    return choose


def test_a_share_holds_only_its_tensors_verified_and_a_second_pull_moves_nothing(source, tmp_path):
    model, serve = source
    stub, servicer = serve()
    dest = tmp_path / "pulled"
    first = pull_share(stub, dest, experts_of(1, 3))
    index = build_index(model)
    share = {t.name for t in index.tensors if is_expert_key(t.name) and layer_of_key(t.name) in (1, 3)}
    share_bytes = sum(t.nbytes for t in index.tensors if t.name in share)
    small = sum(f.header_end or f.size for f in index.files)  # whole small files, safetensors headers
    assert first.pulled_bytes == share_bytes + small == first.share_bytes
    assert servicer.bytes_sent == first.pulled_bytes  # nothing else crossed the wire
    pulled, whole = open_checkpoint(dest), open_checkpoint(model)
    for name in share:
        assert torch.equal(pulled.tensor(name), whole.tensor(name))
    with pytest.raises(CheckpointError, match="was not pulled"):
        pulled.tensor("model.embed_tokens.weight")  # a hole is refused, never read as zeros
    blocks = sum(p.stat().st_blocks * 512 for p in dest.iterdir())
    assert blocks < first.share_bytes + 64 * 4096  # sparse: the disk holds the share (+ partial pages)
    again = pull_share(stub, dest, experts_of(1, 3))
    assert again.pulled_bytes == 0 and again.tensors_pulled == 0
    more = pull_share(stub, dest, experts_of(0, 1, 3))  # a wider share: only what is new
    assert more.pulled_bytes == sum(
        t.nbytes for t in index.tensors if is_expert_key(t.name) and layer_of_key(t.name) == 0
    )


def test_bytes_that_do_not_match_the_index_are_refused_and_not_kept(source, tmp_path):
    model, serve = source
    index = build_index(model)  # what the source claims
    victim = next(t for t in index.tensors if layer_of_key(t.name) == 2 and is_expert_key(t.name))
    with open(model / victim.file, "r+b") as f:  # the bytes it then serves differ
        f.seek(victim.start + 5)
        byte = f.read(1)
        f.seek(victim.start + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    stub, _ = serve(index)
    dest = tmp_path / "pulled"
    with pytest.raises(ShareError, match=victim.name):
        pull_share(stub, dest, experts_of(2))
    record = json.loads((dest / SHARE_STATE).read_text())
    assert victim.name not in record["tensors"]
    with pytest.raises(CheckpointError, match="was not pulled"):
        open_checkpoint(dest).tensor(victim.name)


def test_a_changed_checkpoint_keeps_the_tensors_that_did_not_change(source, tmp_path):
    model, serve = source
    stub, _ = serve()
    dest = tmp_path / "pulled"
    pull_share(stub, dest, experts_of(0, 1))
    (model / "generation_config.json").write_text(json.dumps({"max_length": 77}))  # a new index
    stub, _ = serve()
    again = pull_share(stub, dest, experts_of(0, 1))
    assert again.tensors_pulled == 0 and again.pulled_bytes == len(json.dumps({"max_length": 77}))


@pytest.mark.integration  # a child process pulls and is killed mid-pull
def test_an_interrupted_pull_resumes_where_it_stopped(source, tmp_path):
    """A real pull in its own process, rate-capped, killed part way; the next pull moves the rest."""
    model, serve = source
    stub, _ = serve()
    index = build_index(model)
    server, port, _ = serve_share(model, index, "127.0.0.1", 0, None)  # the child's source
    dest = tmp_path / "pulled"
    script = (
        "import grpc, logging; logging.basicConfig(level=logging.INFO)\n"
        "from odmoe.models.share_pull import pull_share\n"
        "from odmoe.rpc import odmoe_pb2_grpc\n"
        f"stub = odmoe_pb2_grpc.ShareStub(grpc.insecure_channel('127.0.0.1:{port}'))\n"
        f"pull_share(stub, {str(dest)!r}, rate_bytes_s=1.0e6, progress_s=0.2)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until at least one tensor is recorded as verified
            record = dest / SHARE_STATE
            if record.is_file() and len(json.loads(record.read_text())["tensors"]) > 10:
                break
            time.sleep(0.1)
        child.kill()
        child.wait()
    finally:
        server.stop(grace=0)
    kept = set(json.loads((dest / SHARE_STATE).read_text())["tensors"])
    assert 10 < len(kept) < len(index.tensors)
    rest = pull_share(stub, dest)
    assert rest.tensors_pulled == len(index.tensors) - len(kept)
    assert rest.pulled_bytes <= sum(t.nbytes for t in index.tensors if t.name not in kept) + sum(
        f.size for f in index.files if not f.header_end
    )
    pulled, whole = open_checkpoint(dest), open_checkpoint(model)
    assert all(torch.equal(pulled.tensor(k), whole.tensor(k)) for k in whole.weight_map)


def test_several_sources_are_asked_in_turn_and_a_lost_one_hands_over(source, tmp_path):
    """model.pull_from="a,b": an unreachable first source is passed over; one lost in the middle of
    the pull hands the tensor it was sending to the next (started again, verified); a source that
    serves another checkpoint is never used."""
    model, serve = source
    whole = {t.name for t in build_index(model).tensors}
    dead = grpc.insecure_channel("127.0.0.1:1")  # nothing listens there
    first, _ = serve()
    second, servicer = serve()
    report = pull_share([odmoe_pb2_grpc.ShareStub(dead), first], tmp_path / "a")
    assert report.tensors_pulled == len(whole)
    # the first source goes away once the headers are in: the tensors come from the second
    server_a, port_a, _ = serve_share(model, build_index(model), "127.0.0.1", 0, None)
    stub_a = odmoe_pb2_grpc.ShareStub(grpc.insecure_channel(f"127.0.0.1:{port_a}"))

    def choose(index, dest):
        server_a.stop(grace=0).wait()
        return whole

    sent_before = servicer.bytes_sent
    pull_share([stub_a, second], tmp_path / "b", choose)
    held = json.loads((tmp_path / "b" / SHARE_STATE).read_text())["tensors"]
    assert set(held) == whole and servicer.bytes_sent - sent_before >= sum(
        t.nbytes for t in build_index(model).tensors
    )
    # a source of another checkpoint is passed over, and with none left the pull says so
    other = tmp_path / "other"
    shutil.copytree(model, other)
    (other / "config.json").write_text((other / "config.json").read_text() + " ")
    server_o, port_o, _ = serve_share(other, build_index(other), "127.0.0.1", 0, None)
    try:
        stub_o = odmoe_pb2_grpc.ShareStub(grpc.insecure_channel(f"127.0.0.1:{port_o}"))
        server_c, port_c, _ = serve_share(model, build_index(model), "127.0.0.1", 0, None)
        stub_c = odmoe_pb2_grpc.ShareStub(grpc.insecure_channel(f"127.0.0.1:{port_c}"))

        def lose_c(index, dest):
            server_c.stop(grace=0).wait()
            return whole

        with pytest.raises(ShareError, match="no source left"):
            pull_share([stub_c, stub_o], tmp_path / "c", lose_c)
    finally:
        server_o.stop(grace=0)


@pytest.mark.parametrize("qtype,shards", [("Q4_K", 1), ("Q8_0", 2)])
def test_a_gguf_model_is_pulled_tensor_by_tensor(gguf_file, tmp_path, qtype, shards):
    """A GGUF file (or a sharded set) is pulled like a safetensors checkpoint: each file's header, then
    only the role's tensors (a worker its layers' fused expert tensors as stored), into a sparse copy
    whose experts dequantize to the source's bits; main gets the rest; a second pull moves nothing."""
    from odmoe.launch.pull import choose_for, pulled_model
    from odmoe.launch.settings import compose

    source = gguf_file("qwen3_moe", qtype, shards)
    index = build_index(source)
    assert len(index.files) == shards and all(f.header_end for f in index.files)
    first = sorted(f.name for f in index.files)[0]
    server, port, _ = serve_share(os.path.dirname(source), index, "127.0.0.1", 0, None)
    try:
        stub = odmoe_pb2_grpc.ShareStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        words = [
            "cluster.workers=2",
            "cluster.group_size=1",
            "worker.only_own_layers=true",
            "security.enabled=false",
        ]
        cfg = compose(["role=worker", *words, "worker.index=1"])
        dest = tmp_path / "worker1"
        report = pull_share(stub, dest, choose_for(cfg, "worker"))
        held = json.loads((dest / SHARE_STATE).read_text())["tensors"]
        assert set(held) == {
            f"blk.1.ffn_{w}_exps.weight" for w in ("gate", "up", "down")
        }  # layer 1's experts
        heads = sum(f.header_end for f in index.files)
        assert report.pulled_bytes == heads + sum(t.nbytes for t in index.tensors if t.name in held)
        mine, theirs = open_checkpoint(pulled_model(dest)), open_checkpoint(source)
        assert pulled_model(dest).name == first
        for e in range(theirs.num_experts):
            a, b = mine.expert(1, e), theirs.expert(1, e)
            assert torch.equal(a.gate_up.view(torch.int32), b.gate_up.view(torch.int32))
            assert torch.equal(a.down.view(torch.int32), b.down.view(torch.int32))
        assert pull_share(stub, dest, choose_for(cfg, "worker")).pulled_bytes == 0
        main = pull_share(stub, tmp_path / "main", choose_for(compose(["role=worker", *words]), "main"))
        main_held = set(json.loads((tmp_path / "main" / SHARE_STATE).read_text())["tensors"])
        assert main_held == {t.name for t in index.tensors if "_exps." not in t.name}
        assert main.pulled_bytes < index.total_bytes / 2
    finally:
        server.stop(grace=0)


@contextlib.contextmanager
def running_seed(model, key_dir, ready):
    """`odmoe-launch role=seed` serving `model` (TLS + token) while the block runs: its address."""
    seed = subprocess.Popen(
        [sys.executable, "-m", "odmoe.launch.cli", "role=seed", f"model.path={model}",
         "cluster.join_port=0", f"security.key_dir={key_dir}", f"node.ready_file={ready}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and seed.poll() is None:
            time.sleep(0.05)
        yield json.loads(ready.read_text())["share_address"]
    finally:
        seed.terminate()
        seed.wait(timeout=10)


@pytest.mark.integration
@pytest.mark.extended  # two cluster starts and a seed: ~1 min quiet, ~3 min on a busy box
def test_nodes_without_the_checkpoint_pull_their_share_and_serve_the_same_tokens(tmp_path, reap_children):
    """A seed process serves the checkpoint (TLS + token); two workers (one group each, only their own
    layers) and the shadow hold none of it and pull their shares; main has it. Tokens equal
    transformers'; each worker pulled its layers' experts (+ the small files and headers) and no more;
    a second start pulls nothing."""
    model = resolve_model("tiny")
    keys = init_key_dir(tmp_path / "keys", 2)
    with running_seed(model, keys.root, tmp_path / "seed.json") as address:

        def place(name: str) -> NodePlacement:
            if name.startswith("main"):
                return NodePlacement()
            return NodePlacement(words=[f"model.pull_from={address}", f"model.pull_dir={tmp_path / name}"])

        words = [f"security.key_dir={keys.root}", "worker.only_own_layers=true"]
        prompt = "def fibonacci(n):"
        want, _ = reference(model, prompt, new_tokens=12)
        for start in ("first", "second"):
            with LocalCluster(model, workers=2, group_size=1, overrides=words, place=place) as cluster:
                got = cluster.client.generate(prompt, max_new_tokens=12)
                assert list(got.token_ids) == want, start
            records = {
                n: json.loads((tmp_path / n / SHARE_STATE).read_text())
                for n in ("worker0", "worker1", "shadow")
            }
            if start == "first":
                totals = {n: r["pulled_bytes_total"] for n, r in records.items()}
        index = build_index(model)
        for i, layers in enumerate(((0, 2), (1, 3))):  # 2 groups: worker i stores layers i, i + 2
            share = sum(
                t.nbytes for t in index.tensors if is_expert_key(t.name) and layer_of_key(t.name) in layers
            )
            assert totals[f"worker{i}"] == share  # tensor bytes pulled: its share exactly
            assert set(records[f"worker{i}"]["tensors"]) == {
                t.name for t in index.tensors if is_expert_key(t.name) and layer_of_key(t.name) in layers
            }
        assert totals["shadow"] == sum(t.nbytes for t in index.tensors)  # the shadow computes everything
        assert {n: r["pulled_bytes_total"] for n, r in records.items()} == totals  # the second start: none
        assert ClientCredentials.from_key_dir(keys.root).token  # the pull went through the token
    assert not os.path.exists(tmp_path / "main")  # main used its own checkpoint


@pytest.mark.integration
@pytest.mark.extended  # a seed and a cluster whose workers and shadow pull a GGUF file: ~1 min here
def test_a_cluster_pulls_its_shares_of_a_gguf_file_and_serves_it_exactly(gguf_file, tmp_path, reap_children):
    """role=seed serves a Q4_K GGUF file; the workers (one group each, their own layers) and the shadow
    pull their shares of it, sparse, and the cluster's tokens equal transformers' GGUF loading."""
    from tests.test_gguf_cluster import PROMPT, generate_reference

    source = gguf_file("qwen3_moe", "Q4_K")
    keys = init_key_dir(tmp_path / "keys", 2)
    with running_seed(source, keys.root, tmp_path / "seed.json") as address:

        def place(name: str) -> NodePlacement:
            if name.startswith("main"):
                return NodePlacement()
            return NodePlacement(words=[f"model.pull_from={address}", f"model.pull_dir={tmp_path / name}"])

        words = [f"security.key_dir={keys.root}", "worker.only_own_layers=true", "worker.cache=0"]
        want, _, _ = generate_reference(source, 12)
        with LocalCluster(source, workers=2, group_size=1, overrides=words, place=place) as cluster:
            assert list(cluster.client.generate(PROMPT, max_new_tokens=12).token_ids) == want
        index = build_index(source)
        for i in range(2):  # 2 groups of one: worker i stores layer i (GGUF_SPEC: 2 MoE layers)
            held = set(json.loads((tmp_path / f"worker{i}" / SHARE_STATE).read_text())["tensors"])
            assert held == {f"blk.{i}.ffn_{w}_exps.weight" for w in ("gate", "up", "down")}
        shadow = json.loads((tmp_path / "shadow" / SHARE_STATE).read_text())
        assert shadow["pulled_bytes_total"] == sum(t.nbytes for t in index.tensors)
