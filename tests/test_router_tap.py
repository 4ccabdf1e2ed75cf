"""The one router tap (odmoe/shadow/router_tap.py) the shadow node, substitution, training and the
benchmarks share: what it keeps, the ranking the shadow publishes, the fault-injection rule."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe.models.checkpoint import Checkpoint
from odmoe.shadow.router_tap import RouterTap, rank, wrong_experts
from odmoe.shadow.shadow_model import choice_scores, router_modules

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_the_tap_keeps_each_routers_newest_call_and_lets_go(model_dirs):
    path = model_dirs["deepseek_v3"]  # group-limited sigmoid routing: the hardest ranking
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ckpt = Checkpoint(path)
    tap = RouterTap(model, ckpt.num_experts, rank_top_k=ckpt.top_k)
    assert tap.layers == list(ckpt.moe_layers)
    with torch.no_grad():
        model(torch.tensor([[5, 9, 200, 31]]))
    for layer, router in tap.routers:
        assert tap.chosen[layer].shape == (4, ckpt.top_k)
        scores = tap.scores(layer)
        assert torch.equal(scores, choice_scores(router, tap.logits[layer]))
        top = scores.topk(ckpt.top_k, dim=-1).indices.sort(-1).values
        assert torch.equal(top, tap.chosen[layer].sort(-1).values)  # the router chose by these scores
        ranked = tap.ranked[layer]  # the newest row's top-(k+1), as the shadow publishes it
        assert ranked.candidates[: ckpt.top_k] == scores[-1].topk(ckpt.top_k).indices.tolist()
        assert len(ranked.candidates) == ckpt.top_k + 1 and ranked.every is not None
        assert rank(router, tap.logits[layer][-1], ckpt.top_k, tap.limits[layer]) == ranked
    tap.close()
    before = {layer: t.clone() for layer, t in tap.chosen.items()}
    with torch.no_grad():
        model(torch.tensor([[7, 7, 7]]))
    assert all(torch.equal(before[layer], tap.chosen[layer]) for layer in before)  # unhooked


def test_with_a_callback_the_tap_hands_every_call_on_and_keeps_nothing(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["mixtral"]).eval()
    calls = []
    tap = RouterTap(model, 8, on_route=lambda layer, module, output: calls.append((layer, output[2].shape)))
    with torch.no_grad():
        model(torch.tensor([[5, 9, 200]]))
    assert calls == [(layer, (3, 2)) for layer, _ in router_modules(model, 8)]
    assert not tap.chosen and not tap.logits
    tap.close()


def test_wrong_experts_replaces_with_ones_not_predicted_and_is_seeded():
    experts = [1, 5, 6]
    assert wrong_experts(experts, 0.0, 8, random.Random(0)) == experts
    every = wrong_experts(experts, 1.0, 8, random.Random(0))
    assert len(set(every)) == 3 and not set(every) & set(experts)
    some = [wrong_experts(experts, 0.5, 8, random.Random(s)) for s in range(3)]
    assert some == [wrong_experts(experts, 0.5, 8, random.Random(s)) for s in range(3)]
    assert wrong_experts([0, 1], 1.0, 2, random.Random(0)) == [0, 1]  # nothing else to pick
