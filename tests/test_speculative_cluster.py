"""Issue 13's modes in real local clusters: speculative alignment (with forced divergence, so the
shadow rolls back), hedged prefetch and tuned periods. Whatever the shadow does, the tokens equal
the single-process reference, for every family."""

from __future__ import annotations

import pytest

from odmoe import LocalCluster
from tests.conftest import FAMILY_NAMES
from tests.test_cluster_fidelity import PROMPTS, reference

pytestmark = pytest.mark.integration

SPECULATIVE = [
    "lab=on",
    "alignment.mode=speculative",
    "emulation.inject_wrong_token=0.3",
    "emulation.inject_wrong=0.2",
]
HEDGED = [
    "lab=on",
    "shadow.hedge_margin=0.2",
    "worker.slots=3",
    "shadow.precision=int8_dynamic",
    "emulation.inject_wrong=0.3",
]
TUNED = [
    "lab=on",
    "alignment.tune=true",
    "alignment.max_period=4",
    "emulation.inject_wrong_token=0.2",
    "emulation.inject_wrong=0.2",
]
MODES = {"speculative": SPECULATIVE, "hedged": HEDGED + ["alignment.mode=speculative"], "tuned": TUNED}


def _run(path: str, overrides: list[str], prompts=PROMPTS[:2]) -> list[dict]:
    stats = []
    overrides = [*overrides, "worker.cache=0"]  # cached experts would let requests skip the shadow
    with LocalCluster(path, workers=2, group_size=2, overrides=overrides) as cluster:
        for prompt in prompts:
            got = cluster.client.generate(prompt, max_new_tokens=32)
            assert got.token_ids == reference(path, prompt)[0], f"{overrides} changed the tokens"
            stats.append(got.stats)
    return stats


def test_a_speculative_shadow_that_diverges_rolls_back_and_the_tokens_stay(model_dirs, reap_children):
    stats = _run(model_dirs["mixtral"], SPECULATIVE)
    assert sum(s["shadow_rollbacks"] for s in stats) > 0  # divergence was forced, and repaired
    assert all(s["alignment"]["tuned"] is False for s in stats)
    assert all(s["lookahead_iterations_mean"] is not None for s in stats)


@pytest.mark.extended  # multi-process beyond the default run's budget: CI runs it
def test_hedges_are_loaded_counted_and_change_nothing(model_dirs, reap_children):
    stats = _run(model_dirs["qwen2_moe"], HEDGED + ["alignment.mode=speculative"])
    hedging = [s["hedging"] for s in stats]
    assert sum(h["hedge_loads"] for h in hedging) > 0
    assert all(h["hedge_bytes"] >= 0 and h["timely_recall_with_hedges"] is not None for h in hedging)


@pytest.mark.extended  # multi-process beyond the default run's budget: CI runs it
def test_tuned_periods_are_reported(model_dirs, reap_children):
    stats = _run(model_dirs["olmoe"], TUNED)
    for s in stats:
        report = s["alignment"]
        assert report["tuned"] is True and 1 <= report["token_period"] <= 4
        assert report["changes"][0] == [0, 1, 1]


@pytest.mark.extended  # every family x every mode: CI runs it
@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_family_in_every_mode(family, mode, model_dirs, reap_children):
    _run(model_dirs[family], MODES[mode], prompts=PROMPTS[:1])
