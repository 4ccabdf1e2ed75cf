"""gpt-oss's MXFP4 release layout (issue 31): odmoe's small gpt-oss model with its experts stored as
the release stores them (`*_blocks` / `*_scales`, quant_method mxfp4; odmoe.tools.mxfp4_checkpoint),
served against transformers loading the same directory in one process (on a CPU without triton it
dequantizes to bf16): the dequantization itself, main's tensors and every expert to the bit, the
workers keeping experts as stored (MXFP4 bytes on the link), tokens, logits and seeded sampling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from odmoe import LocalCluster
from odmoe.models.checkpoint import Checkpoint
from odmoe.models.mxfp4 import dequantize, quantize
from odmoe.tools.model_factory import make_model
from odmoe.tools.mxfp4_checkpoint import quantize_mxfp4
from odmoe.worker.expert_store import ExpertStore
from tests.conftest import _spec
from tests.test_cluster_fidelity import PROMPTS, check_sampling, reference
from tests.test_engine_inprocess import check_batched_equal_alone

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


@pytest.fixture(scope="session")
def mxfp4_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("mxfp4")
    bf16 = make_model(replace(_spec("gpt_oss"), dtype="bfloat16"), root / "gpt_oss-bf16")
    return str(quantize_mxfp4(bf16, root / "gpt_oss-mxfp4"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantizing_is_transformers_own(dtype):
    torch.manual_seed(0)
    w = torch.randn(3, 64, 96) * 0.05  # [E, out, in]
    pairs = [quantize(w[e]) for e in range(3)]
    blocks, scales = torch.stack([b for b, _ in pairs]), torch.stack([s for _, s in pairs])
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    got = torch.stack([dequantize(blocks[e], scales[e]).t() for e in range(3)]).to(dtype)
    assert torch.equal(got, want)
    assert (got.float() - w.transpose(1, 2)).abs().max() <= w.abs().max() / 4  # FP4: coarse, not wrong


def test_main_and_every_expert_dequantize_as_transformers_loads_them(mxfp4_dir):
    checkpoint = Checkpoint(mxfp4_dir)
    assert checkpoint.quantized_experts == "mxfp4"
    want = AutoModelForCausalLM.from_pretrained(mxfp4_dir).state_dict()
    main = checkpoint.non_expert_state_dict()
    assert main.keys() == {k for k in want if ".experts." not in k}
    assert all(torch.equal(main[k].to(want[k].dtype), want[k]) for k in main)
    store = ExpertStore.build(checkpoint, checkpoint.moe_layers, torch.bfloat16)
    assert store.holdings()["mxfp4"]["experts"] == len(store.keys())
    with pytest.raises(ValueError, match="experts are MXFP4"):
        ExpertStore.build(checkpoint, checkpoint.moe_layers, torch.bfloat16, "compressed")
    for layer in checkpoint.moe_layers:
        prefix = f"model.layers.{layer}.mlp.experts."
        for e in range(checkpoint.num_experts):
            gate_up = torch.cat(
                [want[prefix + "gate_up_proj"][e], want[prefix + "gate_up_proj_bias"][e][None]]
            )
            down = torch.cat([want[prefix + "down_proj"][e], want[prefix + "down_proj_bias"][e][None]])
            got_gate_up, got_down = torch.empty_like(gate_up), torch.empty_like(down)
            moved = store.load_into((layer, e), got_gate_up, got_down)
            assert torch.equal(got_gate_up, gate_up) and torch.equal(got_down, down), (layer, e)
            assert moved < 0.3 * (gate_up.numel() + down.numel()) * 2  # half a byte a weight, + scales


def test_requests_in_process_equal_transformers(mxfp4_dir):
    check_batched_equal_alone(mxfp4_dir, PROMPTS, torch.bfloat16)  # as transformers loads it on a CPU


@pytest.mark.integration
@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_a_cluster_serves_mxfp4_exactly(mxfp4_dir, reap_children):
    words = ["preset=paper", "shadow.precision=bf16", "prefill.mini_batch=3"]
    with LocalCluster(mxfp4_dir, workers=2, group_size=2, overrides=words) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=16, return_logits=True)
        want_ids, want_logits = reference(mxfp4_dir, PROMPTS[0], new_tokens=16)
        assert got.token_ids == want_ids and torch.equal(got.final_logits, want_logits)
        check_sampling(mxfp4_dir, cluster)


@pytest.mark.extended
@pytest.mark.integration
def test_a_lost_worker_changes_no_mxfp4_token(mxfp4_dir, reap_children):
    want, _ = reference(mxfp4_dir, PROMPTS[0], new_tokens=24)
    words = ["lab=on", "preset=paper", "fault.node=worker1", "fault.iteration=6"]
    with LocalCluster(mxfp4_dir, workers=2, group_size=2, overrides=words) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=24)
    assert got.token_ids == want and got.stats["failover"]["live_workers"] == [0]
