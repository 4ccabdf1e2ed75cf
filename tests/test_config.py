import pytest

from odmoe.launch.settings import compose


def test_defaults_compose():
    cfg = compose([])
    assert cfg.role.name == "local" and cfg.cluster.workers == 2 and cfg.model.path is None


@pytest.mark.parametrize("role", ["local", "main", "worker"])
def test_every_role_composes(role):
    extra = ["cluster.worker_addresses=[tcp://a:1,tcp://b:2]"] if role == "main" else []
    assert compose([f"role={role}", *extra]).role.name == role


def test_lan_example_composes():
    cfg = compose(["role=main", "cluster=lan_example"])
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
    ],
)
def test_bad_configs_fail_with_a_readable_message(words, msg):
    with pytest.raises(ValueError, match=msg):
        compose(words)


def test_misspelt_key_fails():
    with pytest.raises(Exception, match="wrkers"):
        compose(["cluster.wrkers=3"])
