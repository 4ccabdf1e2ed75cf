from pathlib import Path

import pytest

from odmoe.config import EmulationConfig, FaultConfig, LabConfig, OdmoeConfig, emulation_of, fault_of
from odmoe.launch.settings import compose

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_defaults_compose():
    cfg = compose([])
    assert cfg.role.name == "local" and cfg.cluster.workers == 2 and cfg.model.path == "demo"


@pytest.mark.parametrize("role", ["local", "main", "worker"])
def test_every_role_composes(role, tmp_path):
    extra = ["cluster.worker_addresses=[tcp://a:1,tcp://b:2]"] if role == "main" else []
    if role != "local":  # security is on by default: a LAN role names its key directory
        extra.append(f"security.key_dir={tmp_path}")
    assert compose([f"role={role}", *extra]).role.name == role


def test_lan_example_composes(tmp_path):
    cfg = compose(["role=main", "cluster=lan_example", f"security.key_dir={tmp_path}"])
    assert cfg.cluster.workers == 4 and len(cfg.cluster.worker_addresses) == 4


@pytest.mark.parametrize(
    "words,msg",
    [
        (["cluster.workers=3"], "not divisible"),
        (["worker.slots=0"], "slots"),
        (["role=worker", "worker.index=5"], "outside"),
        (["role=main"], "worker_addresses"),
        (["prompt="], "empty"),
        (["max_new_tokens=0"], "at least 1"),
        (["shadow.nice=20"], "shadow.nice"),
        (["shadow.nice=-1"], "shadow.nice"),
        (["cluster.homes=random"], "cluster.homes"),
        (["server.client_ping_s=0"], "server.client_ping_s"),
        (["server.client_ping_timeout_s=0.01"], "client_ping_timeout_s"),
    ],
)
def test_bad_configs_fail_with_a_readable_message(words, msg):
    with pytest.raises(ValueError, match=msg):
        compose(words)


def test_misspelt_key_fails():
    with pytest.raises(Exception, match="wrkers"):
        compose(["cluster.wrkers=3"])


@pytest.mark.integration  # starts a process
def test_local_cluster_defaults_to_the_tiny_model_not_the_trained_demo(tmp_path, monkeypatch):
    """odmoe-launch's default is `demo` (trained on first use); LocalCluster, which tests and
    benchmarks start, defaults to `tiny` and never trains. Composing and resolving start no node."""
    import odmoe.tools.training
    from odmoe.launch.local_cluster import LocalCluster

    def no_training(*args, **kwargs):
        raise AssertionError("LocalCluster's default must not train the demo model")

    monkeypatch.setattr(odmoe.tools.training, "train_model", no_training)
    cluster = LocalCluster(overrides=[f"model.cache_dir={tmp_path}"])
    try:
        assert Path(cluster.model_path).parent == tmp_path
        assert Path(cluster.model_path).name.startswith("mixtral-l4-h64-")  # ModelSpec(): tiny
    finally:
        cluster.stop()


@pytest.mark.parametrize("path", ["tiny", None])
def test_model_path_names(path, tmp_path, monkeypatch):
    from dataclasses import replace

    import odmoe.tools.training
    from odmoe.launch.local_cluster import resolve_model_path

    cfg = compose(["role=local", f"model.cache_dir={tmp_path}"])
    cfg = replace(cfg, model=replace(cfg.model, path=path))
    assert Path(resolve_model_path(cfg)).name.startswith("mixtral-l4-h64-")
    trained = []

    def fake_training(out, spec, settings):
        trained.append(spec)
        Path(out).mkdir(parents=True)

    monkeypatch.setattr(odmoe.tools.training, "train_model", fake_training)
    monkeypatch.setattr(odmoe.tools.training, "_train_with_pinned_kernels", fake_training)
    cfg = replace(cfg, model=replace(cfg.model, path="demo"))
    assert Path(resolve_model_path(cfg)).name.startswith("demo-mixtral-l4-h128-")
    assert trained == [odmoe.tools.training.DEMO_SPEC]  # what the demo would train (stubbed out here)
    cfg = replace(cfg, model=replace(cfg.model, path="trained"))  # the benchmarks' names too
    assert Path(resolve_model_path(cfg)).name.startswith("trained-mixtral-l4-h256-")
    assert trained[-1] == odmoe.tools.training.TRAINED_SPEC
    (tmp_path / "demo").mkdir()
    cfg = replace(cfg, model=replace(cfg.model, path=str(tmp_path / "demo")))
    assert resolve_model_path(cfg) == str(tmp_path / "demo")  # a directory is a directory


def test_a_model_name_that_is_neither_a_model_nor_a_path_names_both(tmp_path):
    from odmoe.models.checkpoint import CheckpointError
    from odmoe.tools.model_names import resolve_model

    with pytest.raises(CheckpointError, match=r"does not exist \(nor is .traind. one of .*, trained"):
        resolve_model("traind", tmp_path)


def test_miss_policy_defaults_to_lossless_reload_and_takes_its_knobs():
    assert compose([]).miss.policy == "reload" and not compose([]).miss.lossy
    cfg = compose(["miss.policy=buddy", "miss.tae_percentile=20", "miss.alpha=0.8", "miss.k_max=3"])
    assert (cfg.miss.policy, cfg.miss.tae_percentile, cfg.miss.alpha, cfg.miss.k_max) == ("buddy", 20, 0.8, 3)
    for words, msg in ((["miss.policy=skip"], "miss.policy"), (["miss.alpha=0"], "miss.alpha")):
        with pytest.raises(ValueError, match=msg):
            compose(words)


def test_the_test_knobs_live_in_the_lab_overlay_and_their_old_keys_are_gone():
    """fault.* and emulation.* are the lab overlay's (lab=on: tests and benchmarks), not the product
    schema's; shadow.inject_wrong*, worker.resident and worker.link.* are gone (0.x)."""
    for old in ("shadow.inject_wrong=0.1", "shadow.inject_wrong_token=0.2", "worker.resident=true",
                "worker.link.latency_ms=2"):  # fmt: skip
        with pytest.raises(Exception, match="Could not override"):
            compose(["lab=on", old])
    new = compose(
        ["lab=on", "emulation.inject_wrong=0.1", "emulation.resident=true", "emulation.link.bandwidth_gbps=1"]
    )
    assert isinstance(new, LabConfig)
    assert (new.emulation.inject_wrong, new.emulation.resident, new.emulation.link.bandwidth_gbps) == (
        0.1,
        True,
        1.0,
    )
    lab = compose(["lab=on"])
    assert (lab.emulation, lab.fault) == (EmulationConfig(), FaultConfig())  # off unless asked for
    assert lab == LabConfig(**vars(compose([])), fault=FaultConfig(), emulation=EmulationConfig())


def test_the_product_schema_has_no_lab_keys_and_refuses_their_words_saying_how_to_opt_in():
    product = compose(["preset=paper"])
    assert (
        type(product) is OdmoeConfig and not hasattr(product, "fault") and not hasattr(product, "emulation")
    )
    assert (fault_of(product), emulation_of(product)) == (FaultConfig(), EmulationConfig())  # read as off
    for word in ("fault.node=worker1", "+emulation.resident=true", "emulation.link.latency_ms=3"):
        with pytest.raises(ValueError, match="add the word lab=on"):
            compose([word])
    lab = compose(["lab=on", "preset=paper", "fault.node=worker1", "fault.iteration=6"])
    assert (fault_of(lab).node, fault_of(lab).iteration) == ("worker1", 6)
    assert lab.worker.cache == product.worker.cache == "0"  # the preset still applies over the overlay


@pytest.mark.integration  # starts a process
def test_odmoe_launch_refuses_a_lab_word_without_lab_on():
    """Before Hydra starts (a plain odmoe-launch is the product): exit 2 and the way to opt in."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "odmoe.launch.cli", "role=plan", "fault.node=worker1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "add the word lab=on" in run.stderr, run.stderr
