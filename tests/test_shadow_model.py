"""The shadow's model at each precision: same routing code, experts unfused only where quantized."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from odmoe.models.kv_rows import overwrite_newest_rows
from odmoe.shadow.shadow_model import PRECISIONS, UnfusedExperts, load_shadow_model, model_bytes
from tests.tiny_configs import TINY


def test_unfused_experts_equal_the_eager_kernel():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY["qwen2_moe"](), experts_implementation="eager")
    block = model.model.layers[0].mlp
    hidden = torch.randn(9, model.config.hidden_size)
    _, weights, index = block.gate(hidden)
    with torch.no_grad():
        want = block.experts(hidden, index, weights)
        got = UnfusedExperts(block.experts, model.config.hidden_act)(hidden, index, weights)
    assert torch.equal(got, want)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_loads_runs_and_reports_its_size(precision, model_dirs):
    model = load_shadow_model(model_dirs["mixtral"], precision)
    ids = torch.tensor([[5, 9, 200, 31]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits.float()).all()
    full = model_bytes(load_shadow_model(model_dirs["mixtral"], "fp32"))
    size = model_bytes(model)
    assert size <= full and (precision == "fp32" or size < full)
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    if precision in ("int8", "nf4", "int8_dynamic"):  # routers stay full precision
        assert all(g.weight.dtype == torch.float32 for g in gates)


def test_unknown_precision_is_rejected(model_dirs):
    with pytest.raises(ValueError, match="shadow.precision"):
        load_shadow_model(model_dirs["mixtral"], "int3")


def test_kv_alignment_overwrites_only_the_newest_rows():
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), layer)
    keys, values = torch.ones(2, 2, 1, 4), torch.full((2, 2, 1, 4), 2.0)
    overwrite_newest_rows(cache, keys, values)
    for layer in cache.layers:
        assert layer.keys[0, :, :4].abs().sum() == 0 and (layer.keys[0, :, 4] == 1).all()
        assert (layer.values[0, :, 4] == 2).all()
