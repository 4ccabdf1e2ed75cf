"""Hedged prefetch: also preload the expert that nearly tied with a predicted one. Pure.

Nearly every wrong prediction is a near-tie: the shadow's k-th and (k+1)-th router scores are
within a hair, and the quantized copy's rounding picks the other one. Where the gap is at most
`shadow.hedge_margin`, the shadow names the (k+1)-th candidate as a *hedge* in its prediction.
If main's router swaps the two, the hedge is the expert main asks for, so it should sit where
main will send that expert's rows: on the worker that preloaded the k-th (the one it would
replace). Main places a missed expert that was hedged there (`Topology.repair_placement`).

A hedge is a low-priority preload on the worker (nodes/worker.py). It is ranked as if it were
needed `HEDGE_LAG` layers after its own: before the confident preloads of layers further ahead
(a slot holding one of those would only sit waiting), after the confident preloads of its own and
the next layer. A confident preload that finds no free slot takes the slot of a hedge ranked after
it, never the other way round. With speculative alignment the shadow runs iterations ahead, so
without that ranking every slot would always hold a far-ahead confident preload and no hedge would
ever load. Every hedge load is counted: the bytes it costs are reported beside the hits it made.
"""

from __future__ import annotations

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
