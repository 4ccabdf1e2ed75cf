"""Hedged prefetch: also preload the expert that nearly tied with a predicted one. Pure.

Nearly every wrong prediction is a near-tie: the shadow's k-th and (k+1)-th router scores are
within a hair, and the quantized copy's rounding picks the other one. Where the gap is at most
`shadow.hedge_margin`, the shadow names the (k+1)-th candidate as a *hedge* in its prediction.
If main's router swaps the two, the hedge is the expert main asks for, so it should sit where
main will send that expert's rows: on the worker that preloaded the k-th (the one it would
replace). Main places a missed expert that was hedged there (`Topology.repair_placement`).

A hedge is a low-priority preload on the worker (nodes/worker.py): it takes a slot only when no
confident preload is waiting for one, and a confident preload that finds no free slot evicts it.
So hedging needs a slot that would otherwise sit idle (`worker.slots` above what lookahead fills),
and every hedge load is counted: the bytes it costs are reported beside the bytes it saved.
"""

from __future__ import annotations


def hedges_of(candidates: list[int], probs: list[float], top_k: int, margin: float) -> list[int]:
    """The (k+1)-th candidate when its score is within `margin` of the k-th ([] when off)."""
    if margin <= 0 or len(candidates) <= top_k or len(probs) <= top_k:
        return []
    if probs[top_k - 1] - probs[top_k] <= margin:
        return [candidates[top_k]]
    return []
