"""Defaults live in one place, the schema (odmoe/config.py): conf/'s YAML files set only what differs
from it, and only groups with real alternatives have a folder. And the two model defaults: the
schema's (tiny, so LocalCluster's) and odmoe-launch's (demo, in conf/config.yaml)."""

from functools import reduce
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from odmoe.config import ModelConfig, OdmoeConfig
from odmoe.launch.settings import compose

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

CONF = Path(__file__).resolve().parent.parent / "conf"
YAMLS = sorted(p for p in CONF.rglob("*.yaml") if "bench" not in p.relative_to(CONF).parts)


def flat(node: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and empty mappings are values."""
    out: dict[str, object] = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def keys_set(path: Path) -> dict[str, object]:
    """What a conf/ file sets, as dotted keys of OdmoeConfig: a group option's under its group's name
    unless it says `# @package _global_`; without a defaults list (an ablation case's takes the paper
    preset), nor the root's hydra node."""
    text = path.read_text()
    node = yaml.safe_load(text) or {}
    node = {k: v for k, v in node.items() if k != "defaults"}  # a defaults list is Hydra's, not a key
    if path.parent == CONF:
        return flat({k: v for k, v in node.items() if k != "hydra"})
    return flat(node, "" if text.startswith("# @package _global_") else f"{path.parent.name}.")


def nest(values: dict[str, object]) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}}."""
    out: dict = {}
    for dotted, value in values.items():
        *parents, name = dotted.split(".")
        reduce(lambda node, key: node.setdefault(key, {}), parents, out)[name] = value
    return out


def get(cfg: object, dotted: str) -> object:
    return reduce(getattr, dotted.split("."), cfg)


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: str(p.relative_to(CONF)))
def test_no_yaml_repeats_a_schema_default(path):
    values = keys_set(path)
    # the file's values as the schema's types ("0" stays a str, 120 becomes 120.0); a key the schema
    # lacks fails here
    typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OdmoeConfig), nest(values)))
    schema = OdmoeConfig()
    repeated = [key for key in values if get(typed, key) == get(schema, key)]
    assert not repeated, (
        f"conf/{path.relative_to(CONF)} sets {', '.join(repeated)} to the schema's default: "
        "write defaults only in odmoe/config.py"
    )


def test_every_group_has_real_alternatives():
    """A group folder of conf/ holds two options or more, or is optional (preset, ablation: none is
    the other choice): a group of one option would only repeat the schema."""
    entries = [
        next(iter(e))
        for e in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
        if isinstance(e, dict)
    ]
    optional = {e.removeprefix("optional ") for e in entries if e.startswith("optional ")}
    for folder in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name not in ("bench", "__pycache__")):
        options = list(folder.glob("*.yaml"))
        assert len(options) >= 2 or folder.name in optional, f"conf/{folder.name} has one option only"


def test_odmoe_launch_answers_with_demo_and_local_cluster_with_the_schemas_tiny(tmp_path, monkeypatch):
    import odmoe.launch.local_cluster as local_cluster

    assert compose([]).model.path == "demo"  # conf/config.yaml: what the README's first command runs
    assert ModelConfig().path == "tiny"
    seen = []  # the model LocalCluster would make (nothing is made or started here)
    monkeypatch.setattr(local_cluster, "resolve_model_path", lambda cfg: seen.append(cfg.model.path) or "")
    monkeypatch.setattr(local_cluster, "open_checkpoint", lambda path: None)
    cluster = local_cluster.LocalCluster(overrides=[f"model.cache_dir={tmp_path}"])
    cluster.stop()
    assert seen == ["tiny"] and cluster.cfg.model.path == "tiny"
