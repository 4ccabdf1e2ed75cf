"""The one tap on a model's routers: what each MoE layer's router chose, for whoever predicts.

Contract: `RouterTap(model, num_experts)` hooks every router (`shadow_model.router_modules`) and
keeps, per layer, the newest call's `logits` [T, E] and `chosen` experts [T, k]; `scores(layer)` is
what the router ranks by (`choice_scores`: softmax, or DeepSeek-V3's sigmoid + bias within the
allowed groups), computed once per call. With `rank_top_k` it also keeps `ranked[layer]`, the newest
row's top-(k+1) as the shadow node publishes them (`rank`). With `on_route(layer, module, output)`
the hook hands each call to it and keeps nothing (the shadow node, which publishes as it goes).
Every family's router output is read as (logits, top_k_weights, top_k_index)
(`shadow_model.router_output`: Llama 4's router returns its scores and logits instead).
`close()` removes the hooks.

`rank` (the top-(k+1) candidates and their scores, group-limited where the router is, and every
expert's unmasked score for group hedging) and `wrong_experts` (fault injection: each predicted
expert replaced, with probability `rate`, by one the prediction does not hold) are the rules the
shadow node runs and the benchmarks that replay or emulate it share, so they cannot drift apart.

Users: odmoe/shadow/predictor.py (predictions, ranked by odmoe/shadow/choices.py),
odmoe/lossy/substitution.py (importance-driven substitution on main), odmoe/tools/training.py
(routing statistics, DeepSeek-V3's bias updates), benchmarks/replay.py (recall replays),
benchmarks/lossy_quality.py (quality of lossy policies).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from odmoe.shadow.hedging import GroupLimit
from odmoe.shadow.shadow_model import choice_scores, group_limit, mask_groups, router_modules, router_output
from odmoe.shadow.shadow_model import unmasked_choice_scores as _unmasked


@dataclass(frozen=True)
class Ranked:
    """A router's ranking for one row: the top-(k+1) experts and their scores, best first; for a
    group-limited router also every expert's unmasked score and the limit (group hedges)."""

    candidates: list[int]
    probs: list[float]
    every: list[float] | None
    limit: GroupLimit | None


def rank(router: nn.Module, logits_row: torch.Tensor, top_k: int, limit: GroupLimit | None) -> Ranked:
    """What the shadow publishes beside its choice, for one row of a router's logits [E]."""
    unmasked = _unmasked(router, logits_row)
    scores = mask_groups(unmasked, limit)  # what the router ranks by: its choice_scores
    probs, candidates = scores.topk(min(top_k + 1, scores.shape[-1]))
    every = unmasked.tolist() if limit else None
    return Ranked(candidates.tolist(), probs.tolist(), every, limit)


def wrong_experts(experts: list[int], rate: float, num_experts: int, rng: random.Random) -> list[int]:
    """Fault injection: each of `experts`, with probability `rate`, replaced by an expert neither
    predicted nor already put in (one rng.random() per expert, one rng.choice() per replacement)."""
    if rate <= 0:
        return experts
    out = list(experts)
    for i in range(len(out)):
        if rng.random() < rate:
            wrong = [e for e in range(num_experts) if e not in experts and e not in out]
            if wrong:
                out[i] = rng.choice(wrong)
    return out


class RouterTap:
    def __init__(
        self,
        model: nn.Module,
        num_experts: int,
        on_route: Callable[[int, nn.Module, tuple], None] | None = None,
        rank_top_k: int = 0,
    ):
        self.routers = router_modules(model, num_experts)
        self.limits = {layer: group_limit(router) for layer, router in self.routers}
        self.logits: dict[int, torch.Tensor] = {}
        self.chosen: dict[int, torch.Tensor] = {}
        self.ranked: dict[int, Ranked] = {}
        self._scores: dict[int, torch.Tensor] = {}
        self._modules = dict(self.routers)
        self._on_route, self._rank_top_k = on_route, rank_top_k
        self.handles = [router.register_forward_hook(self._hook(layer)) for layer, router in self.routers]

    @property
    def layers(self) -> list[int]:
        return [layer for layer, _ in self.routers]

    def _hook(self, layer: int):
        def hook(module, _inputs, output):
            output = router_output(module, output)  # (logits, top_k_weights, top_k_index), any family
            if self._on_route is not None:
                self._on_route(layer, module, output)
                return
            logits = output[0] if isinstance(output, tuple) else output
            self.logits[layer] = logits.detach()
            self._scores.pop(layer, None)
            if isinstance(output, tuple) and len(output) > 2:
                self.chosen[layer] = output[2].detach()
            if self._rank_top_k:
                self.ranked[layer] = rank(module, logits[-1], self._rank_top_k, self.limits[layer])

        return hook

    def scores(self, layer: int) -> torch.Tensor:
        """The router's choice scores [T, E] of its newest call (KeyError: not called yet)."""
        if layer not in self._scores:
            self._scores[layer] = choice_scores(self._modules[layer], self.logits[layer])
        return self._scores[layer]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
