"""Real clusters serving from the compressed store (in memory, and from the pack file on disk) and
from the checkpoint on disk produce exactly transformers' greedy tokens, at float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from odmoe import LocalCluster
from odmoe.models.checkpoint import Checkpoint
from odmoe.worker.expert_pack import ExpertPack, write_pack
from tests.conftest import FAMILY_NAMES
from tests.test_cluster_fidelity import reference

pytestmark = pytest.mark.integration
PROMPT = "def fibonacci(n):"
NEW_TOKENS = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _check(path: str, words: list[str], dtype: str, shadow: bool = False) -> str:
    """Run one request through a cluster with `words`; assert its tokens; return worker0's log."""
    want_ids, want_logits = reference(path, PROMPT, dtype=DTYPES[dtype], new_tokens=NEW_TOKENS)
    overrides = [f"model.dtype={dtype}", f"shadow.enabled={str(shadow).lower()}", *words]
    with LocalCluster(path, workers=2, group_size=2, overrides=overrides) as cluster:
        got = cluster.client.generate(PROMPT, max_new_tokens=NEW_TOKENS, return_logits=True)
        log = next(n for n in cluster.nodes if n.name == "worker0").log_file.read_text()
    assert got.token_ids == want_ids, f"{words} diverged"
    assert torch.equal(got.final_logits, want_logits)  # as test_cluster_fidelity
    assert got.stats["experts_loaded"] > 0
    return log


# Half of each worker's experts compressed in host memory, half read from the pack on disk (the
# host_memory budget), so both forms serve the same request: Mixtral at bfloat16 (with the shadow's
# preloads), Qwen2-MoE at float32. Every family x dtype x store is the slow sweep below (a cluster
# takes 15-60 s here, so the default run keeps three).
@pytest.mark.parametrize(
    "family,dtype",
    [("mixtral", "bfloat16"), pytest.param("qwen2_moe", "float32", marks=pytest.mark.extended)],
)
def test_compressed_store_with_pack_and_budget_equals_reference(
    family, dtype, model_dirs, tmp_path, reap_children
):
    path = model_dirs[family]
    pack = write_pack(Checkpoint(path), tmp_path, DTYPES[dtype], chunk_elems=4096)
    half = sum(p.nbytes for p in ExpertPack(pack).experts.values()) // 2
    words = ["worker.store=compressed", f"worker.pack_dir={tmp_path}", f"worker.host_memory={half}"]
    log = _check(path, words, dtype, shadow=family == "mixtral")  # one with the shadow's preloads
    assert f"pack {pack}" in log and " compressed (" in log and " disk (" in log, log


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_disk_store_reads_the_checkpoint(model_dirs, reap_children):
    log = _check(model_dirs["qwen3_moe"], ["worker.store=disk"], "bfloat16")
    assert "store=disk" in log and " disk (" in log and "no pack file at" in log


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("store", ["compressed", "disk", "disk+pack"])
def test_every_store_family_and_dtype(family, dtype, store, model_dirs, tmp_path, reap_children):
    path = model_dirs[family]
    words = [f"worker.store={store.removesuffix('+pack')}", f"worker.pack_dir={tmp_path}"]
    if store == "disk+pack":
        write_pack(Checkpoint(path), tmp_path, DTYPES[dtype])
    _check(path, words, dtype, shadow=True)
