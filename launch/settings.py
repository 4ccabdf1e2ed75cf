"""Hydra -> typed config: the only place odmoe turns YAML and `key=value` overrides into OdmoeConfig.

`compose(overrides)` gives the same config `odmoe-launch` would build from the same command-line
words, so `LocalCluster(overrides=[...])` and the CLI share one config surface.
"""

from __future__ import annotations

from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.initialize import get_gh_backup, restore_gh_from_backup
from omegaconf import DictConfig, OmegaConf

from odmoe.config import OdmoeConfig
from odmoe.validation import validate

CONFIG_MODULE = "odmoe.conf"
ConfigStore.instance().store(name="odmoe_schema", node=OdmoeConfig)


def typed(cfg: DictConfig, schema: type):
    """A composed Hydra config as its dataclass (Hydra's own node dropped: its sweep interpolations
    only resolve inside a job)."""
    plain = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "hydra"}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), plain))


def to_config(cfg: DictConfig) -> OdmoeConfig:
    config: OdmoeConfig = typed(cfg, OdmoeConfig)
    validate(config)
    return config


def compose(overrides: list[str]) -> OdmoeConfig:
    if not GlobalHydra.instance().is_initialized():
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            return to_config(hydra_compose("config", overrides=overrides))
    # Inside a running Hydra app (an odmoe-launch sweep, odmoe-bench, whose config root is another):
    # set that app's Hydra aside, compose odmoe-launch's config, then put the app's Hydra back.
    running = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            return to_config(hydra_compose("config", overrides=overrides))
    finally:
        restore_gh_from_backup(running)
