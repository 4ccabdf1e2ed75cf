"""The dtype `from_pretrained(dtype=...)` gives each tensor, read from the model class itself.

Contract: `loaded_dtypes(skeleton, dtype)` returns a function from a tensor's name (as in the model's
state dict) to the dtype transformers would load it in; `expert_dtype(checkpoint, dtype)` is that
dtype for the routed experts, which is what a worker's store must hold. Main and the workers never
call `from_pretrained` (main reads no expert tensor, a worker reads only its experts), so they must
reproduce its casting rule; any difference changes the routers' logits and so the tokens (issue 27:
transformers 5.24 keeps DeepSeek's `gate.weight` in float32 at bf16).

How: the rule is *asked of the model class*, not copied per family, so the next transformers release
that changes it is followed without code changes. `from_pretrained` decides a tensor's dtype in two
steps (`core_model_loading.convert_and_load_state_dict_in_model` in transformers 5.23-5.24):
1. the model's dtype plan (`PreTrainedModel._get_dtype_plan(dtype)`: `_keep_in_fp32_modules` at fp16,
   `_keep_in_fp32_modules_strict` at fp16 and bf16, merged over sub-models), matched against the name
   with transformers' own glob matcher; a match takes the plan's dtype;
2. otherwise the dtype the class itself created the tensor in under `from_config(dtype=...)` (a class
   may build a parameter in a fixed dtype, e.g. DeepSeek-V2's router weight in float32).
Both steps use transformers' own functions where it has them; if a release renames them, the
documented rule of step 1 is applied from the class attributes instead (with a warning), and
`tests/test_load_dtypes.py` compares every tensor with a real `from_pretrained` for every family and
dtype, so a release that changes the rule in another way fails the tests instead of the tokens.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, PreTrainedModel

log = logging.getLogger("odmoe.models.load_dtypes")


def loaded_dtypes(skeleton: PreTrainedModel, dtype: torch.dtype) -> Callable[[str], torch.dtype]:
    """name -> the dtype `from_pretrained(dtype=dtype)` loads that tensor in.

    `skeleton` is the model built with `from_config(config, dtype=dtype)` (on `meta` or not): its
    tensors' own dtypes are step 2 of the rule."""
    plan = _dtype_plan(skeleton, dtype)
    match = _plan_matcher(plan)
    created = {name: t.dtype for name, t in (*skeleton.named_parameters(), *skeleton.named_buffers())}

    def dtype_of(name: str) -> torch.dtype:
        planned = match(name)
        if planned is not None:
            return planned
        return created.get(name, dtype)

    return dtype_of


def expert_dtype(config, dtype: torch.dtype) -> torch.dtype:
    """The dtype `from_pretrained(dtype=dtype)` gives the routed experts of a model with `config`
    (a worker's store holds them in it). Refuses a model whose two expert tensors would differ."""
    skeleton = meta_skeleton(config, dtype)
    dtype_of = loaded_dtypes(skeleton, dtype)
    found = {
        dtype_of(f"{name}.{p}")
        for name, module in skeleton.named_modules()
        if name.endswith(".experts")
        for p in ("gate_up_proj", "down_proj")
        if hasattr(module, p)
    }
    if len(found) > 1:
        names = sorted(map(str, found))
        raise ValueError(f"transformers loads this model's experts in several dtypes ({names})")
    return found.pop() if found else dtype


def meta_skeleton(config, dtype: torch.dtype) -> PreTrainedModel:
    """The model class built from `config` at `dtype` with every tensor on `meta` (no memory)."""
    with init_empty_weights(include_buffers=True):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _dtype_plan(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, torch.dtype]:
    get_plan = getattr(model, "_get_dtype_plan", None)
    if callable(get_plan):
        return dict(get_plan(dtype))
    log.warning("transformers has no _get_dtype_plan: applying its documented keep-in-fp32 rule")
    plan: dict[str, torch.dtype] = {}
    if dtype == torch.float16:
        plan.update(dict.fromkeys(model._keep_in_fp32_modules or (), torch.float32))
    if dtype in (torch.float16, torch.bfloat16):
        plan.update(dict.fromkeys(model._keep_in_fp32_modules_strict or (), torch.float32))
    return plan


def _plan_matcher(plan: dict[str, torch.dtype]) -> Callable[[str], torch.dtype | None]:
    """The first plan entry whose glob is found in a name, as transformers searches it."""
    if not plan:
        return lambda name: None
    try:
        from transformers.core_model_loading import build_glob_alternation

        pattern, group_to_glob, _ = build_glob_alternation(list(plan))
    except ImportError:  # the same construction: one named alternative per glob, "*" as ".*"
        group_to_glob = {f"g{i}": glob for i, glob in enumerate(plan)}
        branches = (f"(?P<{g}>{glob.replace('*', '.*')})" for g, glob in group_to_glob.items())
        pattern = re.compile("|".join(branches))

    def match(name: str) -> torch.dtype | None:
        found = pattern.search(name)
        return plan[group_to_glob[found.lastgroup]] if found else None

    return match
