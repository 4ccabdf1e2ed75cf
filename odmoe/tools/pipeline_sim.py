"""A model of OD-MoE's round-robin decode pipeline: tokens/s from measured or given timings.

Pure function of `PipelineParams`. One decode iteration walks the MoE layers in order. For layer l,
main spends `t_main` (attention, router), sends the hidden state to group l mod G (`net` one way),
and waits until that group's worker has the expert loaded and has computed it (`t_compute`), plus
the reply (`net`). A worker's load starts as soon as (a) it knows the expert -- when the shadow's
prediction arrives, or, for a miss, when main's request does -- and (b) its loader is free: with
two slots it may load the next expert while computing (one computing, one loading).

The first layers of an aligned iteration cannot be predicted before main has chosen the previous
token, so their lead is short. With predictions early enough and perfect, a one-slot worker (load
only after evicting) has (G-1)(t_main + t_w) + t_main to load its next expert without stalling --
the paper's Eq. 1, t_w = worker time incl. communication -- and this model reproduces that bound
(see tests); a second slot lets loading overlap computing and stretches the window to
G(t_main + t_w). Misses are mixed in by expectation: a fraction `recall` of layers takes the
predicted path, the rest the load-after-routing path.

A worker's expert cache (worker.cache) is mixed in the same way: a fraction `cache_hit` of layers
finds its expert already on the device and neither loads nor occupies the loader; the rest load as
above. What fraction a cache of a given size hits is the caller's estimate (benchmarks/simulate.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineParams:
    layers: int
    groups: int
    t_main_s: float  # main's own work per layer
    t_compute_s: float  # a worker's expert computation per layer
    t_load_s: float  # loading one expert into a worker's device slot
    t_net_s: float = 0.0  # one-way main<->worker message (latency + size / bandwidth)
    recall: float = 1.0
    t_head_s: float = 0.0  # per iteration: embedding, final norm, lm_head on main
    # When the shadow starts an iteration, relative to main: > 0 a late departure (it waited for
    # alignment), < 0 running ahead (a free-running shadow predicts iterations before main gets there).
    shadow_offset_s: float = 0.0
    t_shadow_layer_s: float = 0.0  # the shadow's time per layer (its prediction lead depends on it)
    slots: int = 2
    cache_hit: float = 0.0  # fraction of experts found in a worker's cache (no load)

    def eq1_window_s(self) -> float:
        """Paper Eq. 1: time a group has to load its next expert without stalling."""
        t_w = self.t_compute_s + 2 * self.t_net_s
        return (self.groups - 1) * (self.t_main_s + t_w) + self.t_main_s


@dataclass(frozen=True)
class PipelineResult:
    seconds_per_token: float
    tokens_per_s: float
    stall_s_per_token: float


def simulate(p: PipelineParams, iterations: int = 64) -> PipelineResult:
    load_free = [0.0] * p.groups  # when each group's loader can start its next load
    busy_until = [0.0] * p.groups  # when each group's compute slot is free
    now, stall_total, start = 0.0, 0.0, 0.0
    for it in range(iterations):
        if it == 1:
            start, stall_total = now, 0.0  # the first iteration fills the pipeline
        shadow_start = now + p.shadow_offset_s
        now += p.t_head_s / 2
        for layer in range(p.layers):
            g = layer % p.groups
            routed = now + p.t_main_s
            arrives = routed + p.t_net_s
            predicted_at = shadow_start + (layer + 1) * p.t_shadow_layer_s + p.t_net_s
            hit_loaded = max(predicted_at, load_free[g]) + p.t_load_s
            miss_loaded = max(arrives, load_free[g]) + p.t_load_s
            ready = {"hit": max(hit_loaded, arrives, busy_until[g]), "miss": max(miss_loaded, busy_until[g])}
            done = {k: v + p.t_compute_s + p.t_net_s for k, v in ready.items()}
            no_stall = max(arrives, busy_until[g]) + p.t_compute_s + p.t_net_s
            loading = p.recall * done["hit"] + (1 - p.recall) * done["miss"]
            layer_done = p.cache_hit * no_stall + (1 - p.cache_hit) * loading
            stall_total += layer_done - no_stall
            loaded = p.recall * hit_loaded + (1 - p.recall) * miss_loaded
            loaded = p.cache_hit * load_free[g] + (1 - p.cache_hit) * loaded
            load_free[g] = loaded if p.slots >= 2 else layer_done
            busy_until[g] = layer_done - p.t_net_s
            now = layer_done
        now += p.t_head_s / 2
    per_token = (now - start) / (iterations - 1)
    return PipelineResult(per_token, 1.0 / per_token, stall_total / (iterations - 1))
