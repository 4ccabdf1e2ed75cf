"""Hedged prefetch: also preload the expert that nearly tied with a predicted one. Pure.

Nearly every wrong prediction is a near-tie: the shadow's k-th and (k+1)-th router scores are
within a hair, and the quantized copy's rounding picks the other one. Where the gap is at most
`shadow.hedge_margin`, the shadow names the (k+1)-th candidate as a *hedge* in its prediction.
If main's router swaps the two, the hedge is the expert main asks for, so it should sit where
main will send that expert's rows: on the worker that preloaded the k-th (the one it would
replace). Main places a missed expert that was hedged there (`Topology.repair_placement`).

A hedge is a low-priority preload on the worker (odmoe/worker/executor.py). It is ranked as if it were
needed `HEDGE_LAG` layers after its own: before the confident preloads of layers further ahead
(a slot holding one of those would only sit waiting), after the confident preloads of its own and
the next layer. A confident preload that finds no free slot takes the slot of a hedge ranked after
it, never the other way round. With speculative alignment the shadow runs iterations ahead, so
without that ranking every slot would always hold a far-ahead confident preload and no hedge would
ever load. Every hedge load is counted: the bytes it costs are reported beside the hits it made.

Group-limited routers (DeepSeek-V3; V2 with `group_limited_greedy`) pick their experts only from
their best `keep` of `groups` expert groups, so a near-tie can also be between two *groups*: when
the best group left out ranks within the margin of the last group kept, the router may take that
group instead, and experts the shadow scored -inf become main's choice. No (k+1)-th candidate can
cover that; `group_hedges` then also names that group's best experts, as many as a kept group
gives the router on average (top_k / keep, rounded up: 2 for V3's top-4 from 2 groups): a swapped
group brings its experts in together.
"""

from __future__ import annotations

from typing import NamedTuple

HEDGE_LAG = 1  # layers


def hedge_rank(position: tuple[int, int]) -> tuple[int, int]:
    """The (iteration, layer) a hedge for `position` competes for a slot as."""
    return position[0], position[1] + HEDGE_LAG


def hedges_of(candidates: list[int], probs: list[float], top_k: int, margin: float) -> list[int]:
    """The (k+1)-th candidate when its score is within `margin` of the k-th ([] when off)."""
    if margin <= 0 or len(candidates) <= top_k or len(probs) <= top_k:
        return []
    if probs[top_k - 1] - probs[top_k] <= margin:
        return [candidates[top_k]]
    return []


class GroupLimit(NamedTuple):
    """How a router limits its choice to expert groups (odmoe.shadow.shadow_model.group_limit)."""

    groups: int  # expert groups, equal in size, experts numbered group by group
    keep: int  # groups the router picks its experts from
    by_top2: bool  # a group ranks by its best two scores summed (V3), else by its best (V2)


def group_ranks(scores: list[float], limit: GroupLimit) -> list[float]:
    size = len(scores) // limit.groups
    best = [sorted(scores[g * size : (g + 1) * size], reverse=True) for g in range(limit.groups)]
    return [b[0] + b[1] if limit.by_top2 else b[0] for b in best]


def group_hedges(
    scores: list[float], limit: GroupLimit | None, margin: float, per_group: int = 1
) -> list[int]:
    """The best `per_group` experts of the best group left out, best first, when that group ranks
    within `margin` of the last group kept ([] when off, the router is not group-limited, or it
    keeps every group). `scores`: the router's choice scores for every expert, no group masked."""
    if margin <= 0 or limit is None or limit.groups <= 1 or limit.keep >= limit.groups:
        return []
    ranks = group_ranks(scores, limit)
    order = sorted(range(limit.groups), key=lambda g: -ranks[g])
    kept, out = order[limit.keep - 1], order[limit.keep]
    if ranks[kept] - ranks[out] > margin:
        return []
    size = len(scores) // limit.groups
    return sorted(range(out * size, (out + 1) * size), key=lambda e: -scores[e])[:per_group]


def shadow_hedges(
    candidates: list[int],
    probs: list[float],
    top_k: int,
    margin: float,
    scores: list[float] | None = None,
    limit: GroupLimit | None = None,
) -> list[int]:
    """Every hedge the shadow names for one layer: the near-tied (k+1)-th candidate, and for a
    group-limited router the best experts of a near-tied group left out (`scores`: all experts'
    unmasked choice scores). The shadow node and the hedging benchmark both decide through this."""
    hedges = hedges_of(candidates, probs, top_k, margin)
    if scores is not None and limit is not None:
        chosen = set(candidates[:top_k])
        per_group = -(-top_k // limit.keep)  # what a kept group gives the router, on average
        swapped_in = group_hedges(scores, limit, margin, per_group)
        hedges += [h for h in swapped_in if h not in chosen and h not in hedges]
    return hedges
