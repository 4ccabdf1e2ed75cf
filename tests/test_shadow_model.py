"""The shadow's model at each precision: same routing code, experts unfused only where quantized;
built layer by layer from the safetensors, equal to `from_pretrained` at full precision."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from odmoe.models.kv_rows import overwrite_newest_rows
from odmoe.shadow.precision import (
    PROCESS_BYTES,
    QUANTIZED,
    WeightShape,
    choose_precision,
    linear_bytes,
    shadow_weight_bytes,
)
from odmoe.shadow.quantized_linear import Int4Linear, quantized_linear
from odmoe.shadow.shadow_model import (
    PRECISIONS,
    UnfusedExperts,
    load_shadow_model,
    model_bytes,
    resolve_precision,
    weight_shapes,
)
from tests.conftest import FAMILY_NAMES
from tests.tiny_configs import TINY

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

IDS = torch.tensor([[5, 9, 200, 31, 7, 100, 64]])


def test_unfused_experts_equal_the_eager_kernel():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(TINY["qwen2_moe"](), experts_implementation="eager")
    block = model.model.layers[0].mlp
    hidden = torch.randn(9, model.config.hidden_size)
    _, weights, index = block.gate(hidden)
    with torch.no_grad():
        want = block.experts(hidden, index, weights)
        got = UnfusedExperts.from_fused(block.experts, model.config.hidden_act)(hidden, index, weights)
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
    if precision not in ("fp32", "bf16", "fp16"):  # routers stay full precision
        assert all(g.weight.dtype == torch.float32 for g in gates)


@pytest.mark.parametrize(
    "family", [*FAMILY_NAMES, "qwen3_next", "qwen3_5_moe", "gpt_oss", "llama4", "phimoe", "ernie4_5_moe"]
)
def test_the_layer_by_layer_load_equals_from_pretrained_to_the_bit(family, model_dirs):
    """fp32: the logits of transformers' own load (multimodal wrappers: its language model)."""
    want = AutoModelForCausalLM.from_pretrained(model_dirs[family], dtype=torch.float32).eval()
    got = load_shadow_model(model_dirs[family], "fp32")
    with torch.no_grad():
        assert torch.equal(got(IDS).logits, want(IDS).logits)


def test_bf16_keeps_the_float32_router_from_pretrained_keeps(model_dirs):
    """DeepSeek-V3's router is float32 at bf16 (`_keep_in_fp32_modules_strict`): the same logits."""
    path = model_dirs["deepseek_v3"]
    want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    got = load_shadow_model(path, "bf16")
    assert got.model.layers[1].mlp.gate.weight.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(got(IDS).logits, want(IDS).logits)


@pytest.mark.parametrize("precision", ["int8_dynamic", "int4"])
def test_a_quantized_shadow_keeps_routers_full_and_the_embedding_as_stored(precision, model_dirs):
    model = load_shadow_model(model_dirs["qwen2_moe"], precision)
    assert model.dtype == torch.float32  # the compute dtype: the embedding is a buffer
    assert model.get_input_embeddings().weight.dtype == torch.float32  # the factory saves float32
    assert type(model.lm_head) is not torch.nn.Linear  # quantized
    assert model.model.layers[0].mlp.shared_expert_gate.weight.dtype == torch.float32
    assert not any(p.is_meta for p in model.parameters())


def test_int4_linear_computes_with_the_weight_it_stands_for():
    """A weight already on an int4 grid (per group of 64 inputs: (q - 8) * scale + zero, scale and
    zero in bf16) comes back exactly: the output is the bf16 matmul's (the kernel's layout and
    its scale/zero convention are what `int4_pack` writes); a random weight comes out close."""
    torch.manual_seed(0)
    out_features, in_features, group = 96, 256, 64
    q = torch.randint(0, 16, (out_features, in_features // group, group)).float()
    q[..., 0], q[..., 1] = 0, 15  # every group spans the whole grid, so its scale is found exactly
    scale = torch.rand(out_features, in_features // group, 1).add(0.5).bfloat16().float()
    zero = torch.randn(out_features, in_features // group, 1).bfloat16().float()
    weight = ((q - 8) * scale + zero).reshape(out_features, in_features)
    bias, x = torch.randn(out_features), torch.randn(5, 3, in_features)
    linear = quantized_linear(weight, bias, "int4")
    assert isinstance(linear, Int4Linear) and linear.group == group
    got = linear(x)
    want = (x.bfloat16().float() @ weight.T + bias).float()
    assert got.shape == want.shape and got.dtype == x.dtype
    assert (got - want).norm() / want.norm() < 0.01
    random = torch.randn(out_features, in_features)
    near = quantized_linear(random, None, "int4")(x)
    assert (near - x @ random.T).norm() / (x @ random.T).norm() < 0.15  # 4 bits: ~9 %
    assert model_bytes(linear) - bias.numel() * 4 <= 0.3 * weight.numel() * 2  # of bf16's bytes
    # widths the kernel cannot take (outputs not a multiple of 16) stay in float
    assert type(quantized_linear(torch.randn(24, 64), None, "int4")) is torch.nn.Linear


def test_choose_precision_takes_the_first_that_fits():
    estimates = {"int8_dynamic": 8 << 30, "int4": 4 << 30, "int8": 8 << 30, "nf4": 4 << 30}
    assert choose_precision(estimates, (8 << 30) + PROCESS_BYTES, "cpu") == "int8_dynamic"
    assert choose_precision(estimates, (8 << 30) + PROCESS_BYTES - 1, "cpu") == "int4"
    assert choose_precision(estimates, 1 << 30, "cpu") == "int4"  # nothing fits: the smallest
    assert choose_precision(estimates, 64 << 30, "cuda") == "int8"
    assert choose_precision(estimates, 6 << 30, "cuda") == "nf4"


def test_weight_bytes_are_what_each_kernel_holds():
    assert linear_bytes(4096, 1024, "int8_dynamic") == 4096 * 1024 + 4 * 4096
    assert linear_bytes(4096, 1024, "int4") == 4096 * 512 + 4 * 4096 * 1024 // 64
    assert linear_bytes(24, 64, "int4") == 4 * 24 * 64  # kept in float
    # Mixtral-8x7B: 32 layers of 8 experts (4096 wide, 14336 inside), 32000 words
    layer = [WeightShape("linear", (4096, 4096)), WeightShape("linear", (1024, 4096))] * 2
    layer += [WeightShape("other", (8, 4096)), WeightShape("other", (4096,)), WeightShape("other", (4096,))]
    shapes = [WeightShape("experts", (256, 28672, 4096)), WeightShape("experts", (256, 4096, 14336))]
    shapes += layer * 32 + [WeightShape("embedding", (32000, 4096)), WeightShape("head", (32000, 4096))]
    bf16 = shadow_weight_bytes(shapes, "bf16")
    assert bf16 == 2 * sum(s.numel for s in shapes) and 93e9 < bf16 < 94e9  # 46.7 B parameters
    assert shadow_weight_bytes(shapes, "int8_dynamic") <= 0.55 * bf16
    assert shadow_weight_bytes(shapes, "int4") <= 0.3 * bf16


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8_dynamic", "int4", "nf4"])
def test_the_estimate_made_before_loading_is_what_the_shadow_holds(precision, model_dirs):
    from odmoe.models.checkpoint import Checkpoint
    from odmoe.models.load_dtypes import meta_skeleton

    checkpoint = Checkpoint(model_dirs["deepseek_v3"])
    shapes = weight_shapes(meta_skeleton(checkpoint.config, torch.float32), checkpoint.family.expert_layout)
    estimate = shadow_weight_bytes(shapes, precision, embedding_itemsize=4)
    held = model_bytes(load_shadow_model(model_dirs["deepseek_v3"], precision))
    assert abs(estimate - held) <= 0.02 * held, (estimate, held)


def test_auto_picks_by_the_node_memory_and_says_why(model_dirs, caplog):
    path = model_dirs["mixtral"]
    with caplog.at_level("INFO", logger="odmoe.shadow.model"):
        assert resolve_precision(path, "auto", "cpu", "64GiB") == "int8_dynamic"
    assert "int8_dynamic" in caplog.text and "64.00 GiB (node.memory)" in caplog.text
    assert resolve_precision(path, "auto", "cpu", str(PROCESS_BYTES)) == "int4"
    assert resolve_precision(path, "int8", "cpu", "1KiB") == "int8"  # a precision asked for is kept


def test_unknown_precision_is_rejected(model_dirs):
    with pytest.raises(ValueError, match="shadow.precision"):
        load_shadow_model(model_dirs["mixtral"], "int3")
    with pytest.raises(ValueError, match="on CUDA use int8 or nf4"):
        load_shadow_model(model_dirs["mixtral"], "int4", "cuda")


def test_a_checkpoint_lacking_a_tensor_is_loaded_the_old_way_and_says_so(model_dirs, tmp_path, caplog):
    """The layer-by-layer load refuses a model whose weight map lacks a tensor it needs (here the final
    norm, which from_pretrained initializes): `load_whole_shadow_model` loads it, with a log line."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "lacking"
    shutil.copytree(model_dirs["mixtral"], path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="odmoe.shadow.model"):
        model = load_shadow_model(str(path), "int4")
    assert "through from_pretrained" in caplog.text and "model.norm.weight" in caplog.text
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()
    assert any(isinstance(m, Int4Linear) for m in model.modules())


_PEAK = """
import gc, json, sys
from pathlib import Path
from odmoe.shadow.shadow_model import load_shadow_model

def status():
    lines = Path("/proc/self/status").read_text().splitlines()
    return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in lines if l.endswith("kB")}

base = status()["VmRSS"]
model = load_shadow_model(sys.argv[1], sys.argv[2])
gc.collect()
after = status()
Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS
from odmoe.shadow.shadow_model import model_bytes
model_bytes(model)  # what the shadow node logs once loaded
counted = status()["VmHWM"] - status()["VmRSS"]
print(json.dumps({"base": base, "peak": after["VmHWM"], "steady": after["VmRSS"], "counting": counted}))
"""


@pytest.mark.integration  # loads in a process of its own, to read its peak memory: ~5 s
@pytest.mark.parametrize("precision", ["int8_dynamic", pytest.param("int4", marks=pytest.mark.extended)])
def test_loading_peaks_at_the_steady_size_plus_about_one_layer(precision, tmp_path_factory):
    """VmHWM of a process that loads the shadow (a model of 8 layers of 12 MiB each, bf16): what
    loading costs beyond what stays is about one layer, not the model at full precision (the old
    load read it all in float32 first: twice the checkpoint, then quantized copies beside it)."""
    from odmoe.tools.model_factory import ModelSpec, make_model

    root = tmp_path_factory.getbasetemp() / "peak-model"
    if not (root / "config.json").exists():
        spec = ModelSpec(
            family="mixtral", layers=8, hidden=256, intermediate=1024, vocab=1024, dtype="bfloat16"
        )
        make_model(spec, root)
    layer = 8 * 3 * 256 * 1024 * 2  # its experts, as stored; attention adds 0.5 MiB
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, str(root), precision], capture_output=True, text=True, check=True
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["peak"] - got["steady"] <= 2 * layer, got  # from_pretrained's load: 12 layers' worth
    # all it took, imports on first use (~40 MiB) and what it holds included: 8 layers' worth; the
    # old load went up to 40
    assert got["peak"] - got["base"] < 12 * layer, got
    # counting its bytes costs nothing (state_dict() unpacked every int8 linear at once: the whole
    # model's int8 weights again, 4.5 instead of 2.5 GiB at real width)
    assert got["counting"] < layer // 2, got


def test_kv_alignment_overwrites_only_the_newest_rows():
    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), layer)
    keys, values = torch.ones(2, 2, 1, 4), torch.full((2, 2, 1, 4), 2.0)
    overwrite_newest_rows(cache, keys, values)
    for layer in cache.layers:
        assert layer.keys[0, :, :4].abs().sum() == 0 and (layer.keys[0, :, 4] == 1).all()
        assert (layer.values[0, :, 4] == 2).all()


def test_every_quantized_precision_is_listed():
    assert set(QUANTIZED) < set(PRECISIONS) and "auto" in PRECISIONS
