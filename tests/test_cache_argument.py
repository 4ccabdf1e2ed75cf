"""odmoe/models/cache_argument.py: every forward pass hands the K/V cache under the name the installed
transformers takes (5.24 renamed `past_key_values` to `cache`, warns on every use of the old name and
removes it in 5.40)."""

from __future__ import annotations

import functools
import inspect
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe.main.alignment import AlignmentSchedule
from odmoe.main.engine import GenerateRequest, TokenEvent
from odmoe.main.inprocess import engine_in_process
from odmoe.models.cache_argument import with_cache
from odmoe.models.checkpoint import Checkpoint
from odmoe_bench.replay import load_shadow, reference_trajectory, replay_shadow

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


class _Old(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None): ...


class _New(torch.nn.Module):
    def forward(self, input_ids=None, cache=None): ...


def _renamed(f):  # as transformers' deprecate_kwarg wraps a forward
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)

    return wrapper


class _Wrapped(torch.nn.Module):
    forward = _renamed(_New.forward)


def test_the_cache_goes_under_the_name_the_forward_takes(model_dirs):
    cache = object()
    assert with_cache(_Old(), cache) == {"past_key_values": cache}
    assert with_cache(_New(), cache) == {"cache": cache}
    assert with_cache(_Wrapped(), cache) == {"cache": cache}
    model = AutoModelForCausalLM.from_pretrained(model_dirs["mixtral"])
    takes = inspect.signature(type(model).forward).parameters
    assert with_cache(model, cache) == {("cache" if "cache" in takes else "past_key_values"): cache}


def test_main_and_the_replayed_shadow_pass_no_deprecated_argument(model_dirs):
    """Fails with `past_key_values=` on transformers 5.24 (a FutureWarning per forward pass)."""
    path = model_dirs["mixtral"]
    engine, _ = engine_in_process(path, max_running=1)
    ckpt = Checkpoint(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        events = list(engine.generate(GenerateRequest("def f(x):", max_new_tokens=3)))
        reference = AutoModelForCausalLM.from_pretrained(path).eval()
        traj = reference_trajectory(reference, [5, 6, 7], 3, ckpt.num_experts, ckpt.top_k, set())
        replay_shadow(load_shadow(path, "fp32"), traj, AlignmentSchedule(0, 0), ckpt.num_experts)
    assert sum(isinstance(e, TokenEvent) for e in events) == 3
