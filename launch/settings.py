"""Hydra -> typed config: the only place odmoe turns YAML and `key=value` overrides into OdmoeConfig.

`compose(overrides)` gives the same config `odmoe-launch` would build from the same command-line
words, so `LocalCluster(overrides=[...])` and the CLI share one config surface.

The product's schema is OdmoeConfig. Tests and benchmarks add the word `lab=on`: it composes
LabConfig, the same schema plus `fault.*` (fault injection) and `emulation.*` (slow links, wrong
predictions, resident experts); without it a word that sets one of those is refused (`lab_refusal`).
"""

from __future__ import annotations

from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.initialize import get_gh_backup, restore_gh_from_backup
from omegaconf import DictConfig, OmegaConf

from odmoe.config import LabConfig, OdmoeConfig
from odmoe.validation import validate

CONFIG_MODULE = "odmoe.conf"
LAB_WORD = "lab=on"
LAB_SECTIONS = ("fault", "emulation")  # LabConfig's keys beyond OdmoeConfig's
ConfigStore.instance().store(name="odmoe_schema", node=OdmoeConfig)
# conf/config.yaml's `optional lab` group: merged right after the schema, so its only effect is the
# schema's type and the two sections (every other key keeps its default, which later files change)
ConfigStore.instance().store(group="lab", name="on", node=LabConfig, package="_global_")


def lab_on(overrides: list[str]) -> bool:
    return any(word.lstrip("+") == LAB_WORD for word in overrides)


def lab_refusal(overrides: list[str]) -> str | None:
    """Why these words are refused, or None: one sets a lab key (fault.*, emulation.*) without lab=on."""
    if lab_on(overrides):
        return None
    for word in overrides:
        key = word.lstrip("+~").partition("=")[0]
        if key.partition(".")[0] in LAB_SECTIONS:
            return (
                f"{word!r}: fault.* and emulation.* are test and benchmark knobs, not settings of the "
                f"product; add the word {LAB_WORD} to use them (the lab overlay, odmoe.config.LabConfig)"
            )
    return None


def fault_disarmed(overrides: list[str]) -> list[str]:
    """The word that keeps a node started again, or a standby main, from firing the fault these
    words arm (meant for the first run, for main); none without the lab overlay, which has no fault."""
    return ["fault.node="] if lab_on(overrides) else []


def typed(cfg: DictConfig, schema: type):
    """A composed Hydra config as its dataclass (Hydra's own node dropped: its sweep interpolations
    only resolve inside a job)."""
    plain = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "hydra"}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), plain))


def to_config(cfg: DictConfig) -> OdmoeConfig:
    """Validated, as LabConfig where `lab=on` composed its sections, else as the product's OdmoeConfig."""
    config: OdmoeConfig = typed(cfg, LabConfig if "fault" in cfg else OdmoeConfig)
    validate(config)
    return config


def compose(overrides: list[str]) -> OdmoeConfig:
    if (refusal := lab_refusal(overrides)) is not None:
        raise ValueError(refusal)
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
