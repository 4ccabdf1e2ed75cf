"""Shared fixtures: small checkpoints of every family, made once per session, and a reaper that
fails a test (and cleans up) if it leaves node processes behind."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from odmoe.model_factory import FAMILIES, ModelSpec, make_model

FAMILY_NAMES = [
    f for f in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3") if f in FAMILIES
]
DEEPSEEK_NAMES = [f for f in FAMILY_NAMES if f.startswith("deepseek")]
# Families with focused tests of their own (tests/test_<family>.py) rather than a place in every
# family-parametrized test: the default run's time budget
FOCUSED_FAMILIES = [f for f in ("glm4_moe", "phimoe") if f in FAMILIES]


def cluster_families() -> list:
    """FAMILY_NAMES for the cluster tests, DeepSeek's marked slow: a DeepSeek cluster (16 experts,
    top-4) takes 1.5-2 min here, so the default run covers DeepSeek with the focused cluster tests of
    tests/test_deepseek.py and `-m ""` runs the whole matrix."""
    return [pytest.param(f, marks=pytest.mark.slow) if f in DEEPSEEK_NAMES else f for f in FAMILY_NAMES]


def _spec(family: str) -> ModelSpec:
    # DeepSeek's experts are many and small: 16 routed (4 groups, 2 usable), top-4, a quarter as wide.
    many = family in DEEPSEEK_NAMES or family == "glm4_moe"
    return ModelSpec(
        family=family,
        layers=4,
        hidden=64,
        intermediate=32 if many else 128,
        experts=16 if many else 8,
        top_k=4 if many else 2,
        vocab=1024,
        max_positions=256,
        seed=0,
    )


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {f: str(make_model(_spec(f), root / f)) for f in (*FAMILY_NAMES, *FOCUSED_FAMILIES)}


@pytest.fixture
def reap_children():
    """Yields; afterwards asserts no child process of this test run is still alive, killing any."""
    me = psutil.Process(os.getpid())
    before = {p.pid for p in me.children(recursive=True)}
    yield
    leftovers = [p for p in me.children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(leftovers, timeout=5)
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not alive, f"orphan node processes left running: {[p.pid for p in alive]}"
