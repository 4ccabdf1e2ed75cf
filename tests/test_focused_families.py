"""Families with tests of their own rather than a place in every family-parametrized test
(tests/conftest.py FOCUSED_FAMILIES), each made by odmoe's model factory and loaded by path as a
user's checkpoint would be:
- GLM-4.5 / 4.6 (`glm4_moe`): DeepSeek-V3's MoE block and routing (sigmoid scores + correction bias,
  group-limited top-k, normalised and scaled weights, a float32 router) under grouped-query attention
  with partial rotary embeddings and q/k norms; the first layer dense, a shared expert (16 experts in
  4 groups, top-4).
- Phi-3.5-MoE (`phimoe`): Mixtral's disk layout and expert MLP, the sparsemixer router, LayerNorm
  and biased attention (8 experts, top-2).
- Qwen3-Next (`qwen3_next`): hybrid attention (three gated-DeltaNet layers with recurrent states to
  one full-attention layer), Qwen's fused experts and a sigmoid-gated shared expert (8 experts,
  top-2); its alignment and rollback have tests of their own (tests/test_hybrid_alignment.py).
- Qwen3.5-MoE's language model (`qwen3_5_moe_text`): the same architecture under its own config;
  `qwen3_5_moe`: the vision-language checkpoint as published, its language model served.
- gpt-oss (`gpt_oss`): fused, transposed, biased experts, the clamped SwiGLU, attention sinks and
  sliding-window layers.
- Llama 4 (`llama4_text`, top-2; `llama4`, the published vision-language wrapper, top-1): experts
  outside transformers' experts interface (rows scaled by the router before one bmm over every
  expert), a shared expert, MoE on every other layer, chunked attention and NoPE layers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe import LocalCluster
from odmoe.models.checkpoint import Checkpoint
from odmoe.shadow.shadow_model import (
    PRECISIONS,
    choice_scores,
    load_shadow_model,
    router_modules,
    router_output,
)
from tests.conftest import FOCUSED_FAMILIES
from tests.test_cluster_fidelity import PROMPTS, check_sampling, reference
from tests.test_engine_inprocess import check_batched_equal_alone
from tests.test_load_dtypes import test_every_tensor_has_from_pretrained_dtype as check_dtypes

pytestmark = [pytest.mark.parametrize("family", FOCUSED_FAMILIES), pytest.mark.pure]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_tensor_has_from_pretrained_dtype(model_dirs, family, dtype):
    check_dtypes(model_dirs, family, dtype)  # GLM's router and its bias stay float32 at bf16


def test_the_shadow_ranks_experts_as_the_router_chooses(model_dirs, family):
    checkpoint = Checkpoint(model_dirs[family])
    model = AutoModelForCausalLM.from_pretrained(model_dirs[family])
    torch.manual_seed(2)
    hidden = torch.randn(500, model.config.hidden_size)
    found = router_modules(model, checkpoint.num_experts)
    assert [layer for layer, _ in found] == list(checkpoint.moe_layers)  # GLM: the first layer is dense
    routers = [m for _, m in found]
    for router in routers:
        with torch.no_grad():
            logits, _, index = router_output(router, router(hidden))
        top = choice_scores(router, logits).topk(router.top_k, dim=-1).indices
        assert torch.equal(top.sort(-1).values, index.sort(-1).values)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_shadow_loads_at_every_precision(precision, model_dirs, family):
    model = load_shadow_model(model_dirs[family], precision)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 9, 200, 31]])).logits
    assert torch.isfinite(logits.float()).all()


def test_requests_batched_in_process_equal_alone(model_dirs, family):
    """Greedy and seeded requests decoding together, each equal to transformers alone."""
    check_batched_equal_alone(model_dirs[family], PROMPTS)


@pytest.mark.extended  # a real cluster: CI runs it
@pytest.mark.integration
@pytest.mark.parametrize(
    "words",
    [
        ["lab=on", "preset=paper", "shadow.precision=bf16", "emulation.inject_wrong=0.3"],
        ["worker.store=compressed"],
    ],
    ids=["paper-bf16-shadow", "defaults-compressed"],
)
def test_a_cluster_serves_it_exactly(words, model_dirs, family, reap_children):
    path = model_dirs[family]
    with LocalCluster(path, workers=2, group_size=2, overrides=[*words, "prefill.mini_batch=3"]) as cluster:
        for prompt in PROMPTS:
            want_ids, want_logits = reference(path, prompt, new_tokens=16)
            got = cluster.client.generate(prompt, max_new_tokens=16, return_logits=True)
            assert got.token_ids == want_ids and torch.equal(got.final_logits, want_logits)
            if "preset=paper" in words:  # the shadow found the routers: 30 % made wrong, the rest right
                assert 0.5 < got.stats["recall"]["overall"] < 0.9, got.stats["recall"]
        check_sampling(path, cluster)


@pytest.mark.extended
@pytest.mark.integration
def test_a_lost_worker_changes_no_token(model_dirs, family, reap_children):
    path = model_dirs[family]
    want, _ = reference(path, PROMPTS[0], new_tokens=24)
    # worker 0: the paper's placement deals a layer's experts from the group's first worker on, so a
    # top-1 model (Llama 4) asks only it in decode
    words = ["lab=on", "preset=paper", "fault.node=worker0", "fault.iteration=6"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=24)
    assert got.token_ids == want and got.stats["failover"]["live_workers"] == [1]
