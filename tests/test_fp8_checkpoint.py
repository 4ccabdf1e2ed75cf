"""Block-wise FP8 checkpoints as published (issue 31): made by transformers' own FP8 quantizer from
odmoe's small models (DeepSeek-V3 and Qwen3-MoE: families with FP8 releases), stored as the releases
are (float8 e4m3 + `weight_scale_inv` per block, `quantization_config` quant_method fp8), and served
against transformers loading the same directory in one process (on a CPU it dequantizes to bf16):
main's tensors and every expert to the bit, the workers keeping experts as stored (FP8 bytes on the
link), tokens, logits and seeded sampling equal."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe import LocalCluster
from odmoe.models.checkpoint import Checkpoint
from odmoe.models.families import UnsupportedModelError
from odmoe.shadow.shadow_model import PRECISIONS, load_shadow_model
from odmoe.tools.fp8_checkpoint import quantize_fp8
from odmoe.tools.model_factory import make_model
from odmoe.worker.expert_store import ExpertStore
from tests.conftest import _spec
from tests.test_cluster_fidelity import PROMPTS, check_sampling, reference
from tests.test_engine_inprocess import check_batched_equal_alone

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

FAMILIES = ["deepseek_v3", "qwen3_moe"]
BLOCK = (32, 32)  # the releases' 128 x 128 is wider than these models' matrices


@pytest.fixture(scope="session")
def fp8_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for family in FAMILIES:
        bf16 = make_model(replace(_spec(family), dtype="bfloat16"), root / f"{family}-bf16")
        out[family] = str(quantize_fp8(bf16, root / f"{family}-fp8", BLOCK))
        out[f"{family}-bf16"] = str(bf16)
    return out


@functools.cache
def _transformers(path: str):
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.mark.parametrize("family", FAMILIES)
def test_main_and_every_expert_dequantize_as_transformers_loads_them(fp8_dirs, family):
    path = fp8_dirs[family]
    checkpoint = Checkpoint(path)
    assert checkpoint.fp8 is not None and checkpoint.quantized_experts == "fp8"
    want = _transformers(path)
    main = checkpoint.non_expert_state_dict()
    assert main.keys() == {k for k in want if ".experts." not in k}
    quantized = [k for k in checkpoint.weight_map if k.endswith("_scale_inv") and ".experts." not in k]
    assert quantized, "attention and shared experts are stored in FP8 too"
    for key, value in main.items():
        assert torch.equal(value.to(want[key].dtype), want[key]), key
    with pytest.raises(ValueError, match="experts are FP8"):
        ExpertStore.build(checkpoint, checkpoint.moe_layers, torch.bfloat16, "compressed")
    # a worker's store keeps them as stored and loads them into a slot as transformers holds them
    store = ExpertStore.build(checkpoint, checkpoint.moe_layers, torch.bfloat16)
    held = store.holdings()
    assert held["fp8"]["experts"] == len(store.keys()) and held["decompressed"]["experts"] == 0
    for layer in checkpoint.moe_layers:
        fused = want[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        down = want[f"model.layers.{layer}.mlp.experts.down_proj"]
        for e in range(checkpoint.num_experts):
            gate_up, d = torch.empty_like(fused[e]), torch.empty_like(down[e])
            moved = store.load_into((layer, e), gate_up, d)
            assert torch.equal(gate_up, fused[e]) and torch.equal(d, down[e]), (layer, e)
            bf16_bytes = (gate_up.numel() + d.numel()) * 2
            assert moved < 0.6 * bf16_bytes  # one byte a weight, plus a float32 scale per block


# DeepSeek-V3's (16 experts, top-4) beyond the default run's ~15 min: Qwen3's covers the path
@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.extended) if f == "deepseek_v3" else f for f in FAMILIES]
)
def test_requests_in_process_equal_transformers(fp8_dirs, family):
    check_batched_equal_alone(fp8_dirs[family], PROMPTS, torch.bfloat16)  # as transformers loads it on a CPU


@pytest.mark.integration
@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_a_cluster_serves_fp8_exactly_and_moves_fp8_bytes(fp8_dirs, reap_children):
    """DeepSeek-V3 in FP8 through a real cluster (the paper's cacheless workers, a bf16 shadow,
    prefill mini-batches): tokens and final logits equal transformers', seeded sampling too; the
    bytes loaded per token are the FP8 checkpoint's, against the same model stored in bf16."""
    path, bf16 = fp8_dirs["deepseek_v3"], fp8_dirs["deepseek_v3-bf16"]
    words = ["preset=paper", "shadow.precision=bf16", "prefill.mini_batch=3"]
    loaded = {}
    for name, model in (("fp8", path), ("bf16", bf16)):
        with LocalCluster(model, workers=2, group_size=2, overrides=words) as cluster:
            got = cluster.client.generate(PROMPTS[0], max_new_tokens=16, return_logits=True)
            if name == "fp8":
                want_ids, want_logits = reference(path, PROMPTS[0], new_tokens=16)
                assert got.token_ids == want_ids and torch.equal(got.final_logits, want_logits)
                check_sampling(path, cluster)
            loaded[name] = got.stats["bytes_loaded"] / max(got.stats["experts_loaded"], 1)
    assert loaded["fp8"] < 0.6 * loaded["bf16"], loaded


@pytest.mark.parametrize(
    "method, refusal",
    [
        ("awq", "'awq'-quantized checkpoint is not served; .*block-wise FP8.*MXFP4"),
        ("mxfp4", "MXFP4 experts are served for gpt-oss, not qwen3_moe"),
    ],
)
def test_other_quantizations_are_refused_with_what_is_served(fp8_dirs, tmp_path, method, refusal):
    import json
    import shutil

    path = tmp_path / method
    shutil.copytree(fp8_dirs["qwen3_moe-bf16"], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=refusal):
        Checkpoint(path)


def test_odmoe_pack_says_it_passes_fp8_experts_through(fp8_dirs, capsys):
    from odmoe.launch.pack import main as pack

    assert pack([fp8_dirs["qwen3_moe"]]) == 0
    assert "experts are FP8" in capsys.readouterr().out


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_shadow_loads_an_fp8_checkpoint_at_every_precision(fp8_dirs, precision):
    model = load_shadow_model(fp8_dirs["deepseek_v3"], precision)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 9, 200, 31]])).logits
    assert torch.isfinite(logits.float()).all()


@pytest.mark.extended
@pytest.mark.integration
@pytest.mark.parametrize("family", FAMILIES)
def test_a_lost_worker_changes_no_fp8_token(fp8_dirs, family, reap_children):
    path = fp8_dirs[family]
    want, _ = reference(path, PROMPTS[0], new_tokens=24)
    words = ["lab=on", "preset=paper", "fault.node=worker1", "fault.iteration=6"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=24)
    assert got.token_ids == want and got.stats["failover"]["live_workers"] == [0]
