"""Main's skeleton and the workers' experts hold every tensor in the dtype from_pretrained gives it.

Issue 27: transformers 5.24 keeps DeepSeek's router `gate.weight` in float32 at bf16 and main cast it
to bf16, so at bf16 the routers' logits (and then the tokens) differed from transformers'. These
tests compare dtypes with a real `from_pretrained` for every family and dtype, so a transformers
release that changes its rule fails here, not in the tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe.models.checkpoint import Checkpoint
from odmoe.models.load_dtypes import _dtype_plan, _plan_matcher, expert_dtype, loaded_dtypes, meta_skeleton
from odmoe.models.main_model import build_main_model, experts_modules
from tests.conftest import FAMILY_NAMES

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_tensor_has_from_pretrained_dtype(model_dirs, family, dtype):
    dtype = DTYPES[dtype]
    path = model_dirs[family]
    want = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    want_dtypes = {n: t.dtype for n, t in (*want.named_parameters(), *want.named_buffers())}
    main = build_main_model(Checkpoint(path), dtype)
    expert_names = {f"{n}.{p}" for n, _ in _named_experts(main.model) for p in ("gate_up_proj", "down_proj")}
    got = {n: t.dtype for n, t in (*main.model.named_parameters(), *main.model.named_buffers())}
    checked = 0
    for name, got_dtype in got.items():
        if name in expert_names:  # on meta in main: the workers hold them (below)
            continue
        assert got_dtype == want_dtypes[name], f"{family} {dtype}: main's {name} is {got_dtype}"
        checked += 1
    assert checked > 10
    # The workers' store: what the worker node computes its dtype with.
    experts = expert_dtype(Checkpoint(path).config, dtype)
    for name in expert_names:
        assert want_dtypes[name] == experts, (
            f"{family} {dtype}: workers hold {experts}, {name} is {want_dtypes[name]}"
        )


def _named_experts(model):
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(m)], m) for _, m in experts_modules(model)]


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_routers_equal_from_pretrained_at_bf16(model_dirs, family):
    """The case that broke: transformers 5.24 keeps the router weight float32 at bf16 (5.23 did not);
    main's routers must hold what from_pretrained's hold, bit for bit, whichever release it is."""
    path = model_dirs[family]
    want = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).named_parameters())
    main = build_main_model(Checkpoint(path), torch.bfloat16)
    routers = {n: p for n, p in main.model.named_parameters() if n.endswith("mlp.gate.weight")}
    assert routers
    for name, got in routers.items():
        assert got.dtype == want[name].dtype and torch.equal(got, want[name]), name


class _NoPlanModel(torch.nn.Module):
    """A model class from a transformers without `_get_dtype_plan` (pure rule, no loading)."""

    _keep_in_fp32_modules = ["norm"]
    _keep_in_fp32_modules_strict = ["gate.weight"]


@pytest.mark.parametrize(
    ("dtype", "norm", "gate"),
    [
        (torch.float32, None, None),
        (torch.bfloat16, None, torch.float32),  # only the strict list applies at bf16
        (torch.float16, torch.float32, torch.float32),  # both at fp16
    ],
)
def test_fallback_rule_without_get_dtype_plan(dtype, norm, gate):
    match = _plan_matcher(_dtype_plan(_NoPlanModel(), dtype))
    assert match("model.layers.0.self_attn.q_proj.weight") is None
    assert match("model.norm.weight") == norm
    assert match("model.layers.0.input_layernorm.weight") == norm  # transformers searches, not equals
    assert match("model.layers.3.mlp.gate.weight") == gate
    assert match("model.layers.3.mlp.gate_proj.weight") is None


def test_a_tensor_created_in_a_fixed_dtype_keeps_it(model_dirs):
    """Step 2 of the rule: what the class builds in float32 stays float32 with no plan entry."""
    skeleton = meta_skeleton(Checkpoint(model_dirs["mixtral"]).config, torch.bfloat16)
    with torch.device("meta"):
        skeleton.model.extra = torch.nn.Linear(2, 2, dtype=torch.float32)
    dtype_of = loaded_dtypes(skeleton, torch.bfloat16)
    assert dtype_of("model.extra.weight") == torch.float32
    assert dtype_of("model.embed_tokens.weight") == torch.bfloat16
