"""Shared fixtures: small checkpoints of every family, made once per session, and a reaper that
fails a test (and cleans up) if it leaves node processes behind."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from odmoe.tools.model_factory import FAMILIES, ModelSpec, make_model

FAMILY_NAMES = [
    f for f in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3") if f in FAMILIES
]
DEEPSEEK_NAMES = [f for f in FAMILY_NAMES if f.startswith("deepseek")]
# Every other family the factory makes has focused tests (tests/test_focused_families.py) rather than
# a place in every family-parametrized test: the default run's time budget
FOCUSED_FAMILIES = [f for f in FAMILIES if f not in FAMILY_NAMES]


# The fast tier (`-m fast`, `make test-fast`): the default run's tests of the files that say they
# start no process and train nothing (`pytestmark = pytest.mark.pure`: by inclusion, so a new file
# is not fast until it says so), the pure modules and the decode loop with in-process workers
# checked against transformers. A test there that starts nodes anyway, or waits seconds on a real
# network or the clock (mDNS, beats), is marked integration (or extended, slow, demo, gpu) and stays
# out; one that asks for `reap_children` without such a mark fails at collection (it would start
# processes in the fast tier).
HEAVY_MARKS = {"integration", "extended", "slow", "demo", "gpu"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the mark must be there when it looks
def pytest_collection_modifyitems(items):
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        if "pure" not in marks or marks & HEAVY_MARKS:
            continue
        if "reap_children" in getattr(item, "fixturenames", ()):
            raise pytest.UsageError(
                f"{item.nodeid} starts processes (reap_children) in a pure file: mark it integration"
            )
        item.add_marker(pytest.mark.fast)


def cluster_families(default: tuple[str, ...] | None = None) -> list:
    """FAMILY_NAMES for the cluster tests, DeepSeek's marked slow: a DeepSeek cluster (16 experts,
    top-4) takes 1.5-2 min here, so the default run covers DeepSeek with the focused cluster tests of
    tests/test_deepseek.py and `-m ""` runs the whole matrix. With `default`, only those families stay
    in the default run, the others are `extended` (the default run's time budget)."""

    def param(f: str):
        if f in DEEPSEEK_NAMES:
            return pytest.param(f, marks=pytest.mark.slow)
        if default is not None and f not in default:
            return pytest.param(f, marks=pytest.mark.extended)
        return f

    return [param(f) for f in FAMILY_NAMES]


def _spec(family: str) -> ModelSpec:
    # DeepSeek's experts are many and small: 16 routed (4 groups, 2 usable), top-4, a quarter as wide.
    many = family in DEEPSEEK_NAMES or family == "glm4_moe"
    return ModelSpec(
        family=family,
        layers=4,
        hidden=64,
        intermediate=32 if many else 128,
        experts=16 if many else 8,
        top_k=4 if many else 1 if family == "llama4" else 2,  # Llama 4 as published: top-1
        vocab=1024,
        max_positions=256,
        seed=0,
    )


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {f: str(make_model(_spec(f), root / f)) for f in (*FAMILY_NAMES, *FOCUSED_FAMILIES)}


# GGUF test files (tests/test_gguf_*.py): K-quants hold 256 values a block, so every matrix's rows
# must be whole blocks
GGUF_SPEC = ModelSpec(
    family="qwen3_moe", layers=2, hidden=256, intermediate=256, experts=4, top_k=2, vocab=1024
)


@pytest.fixture(scope="session")
def gguf_sources(tmp_path_factory) -> dict:
    """family -> odmoe's small model of that family in safetensors (GGUF_SPEC), made on first use."""
    root = tmp_path_factory.mktemp("gguf-src")

    class Sources(dict):
        def __missing__(self, family: str):
            self[family] = make_model(ModelSpec(**{**GGUF_SPEC.__dict__, "family": family}), root / family)
            return self[family]

    return Sources()


@pytest.fixture(scope="session")
def gguf_file(gguf_sources, tmp_path_factory):
    """(family, type) -> the model as a GGUF file of that type, written once per session."""
    from odmoe.tools.gguf_export import write_gguf

    root, made = tmp_path_factory.mktemp("gguf"), {}

    def file(family: str, qtype: str, shards: int = 1) -> str:
        key = (family, qtype, shards)
        if key not in made:
            made[key] = str(
                write_gguf(gguf_sources[family], root / f"{family}-{qtype}-{shards}", qtype, shards)
            )
        return made[key]

    return file


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


def run_together(calls: list) -> list:
    """Each zero-argument call on a thread of its own, all at once: their results in order. The
    first error any call raised is raised after all have ended."""
    import threading

    results: list = [None] * len(calls)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def generate_together(cluster, prompts: list[str], max_new_tokens: int) -> dict[str, list[int]]:
    """Each prompt from a client of its own, all at once: prompt -> its tokens."""
    import odmoe

    def ask(prompt: str) -> list[int]:
        with odmoe.Client(cluster.address, credentials=cluster.credentials) as client:
            return client.generate(prompt, max_new_tokens=max_new_tokens).token_ids

    tokens = run_together([lambda p=p: ask(p) for p in prompts])
    return dict(zip(prompts, tokens, strict=True))
