"""What main does about a missed prediction: reload the right expert (lossless) or compute with one
that is already loaded (lossy, opt-in). Pure: no I/O, no processes; every decision is a function.

A decode miss in odmoe always leaves something on the device: the expert the shadow predicted
instead, preloaded on the group's worker and now unused ("resident"). Two papers compute with such
an expert rather than wait for the right one to load:

- `buddy` (BuddyMoE, §3): a missing expert i may be replaced by a resident j from i's *buddy list*,
  the peers that co-activate with i most often (found offline: `buddy_lists` over a co-activation
  matrix, Cumulative Frequency Threshold α, at most K_max each), best buddy first. A token whose
  routing is peaky is never substituted: Token Activating Entropy (`token_activating_entropy`, the
  entropy of its renormalised top-k weights / log k) must exceed τ (fixed, or a per-layer percentile
  of the profiled TAE distribution).
- `importance` (importance-driven scheduling, §5.1, Algorithm 1): only *low-score* activated experts
  may be replaced: with β the (k+1)-th router score of the token, an activated expert scoring below
  (1+α)β is low-score; it is replaced by a resident inactive expert scoring at least (1-α)β, the
  highest-scoring one first.

Both take at most `budget` substitutions per generated token over all its layers (BuddyMoE's ρ)
and use each resident expert once per token and layer. Whatever is not substituted is reloaded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

POLICIES = ("reload", "buddy", "importance")


@dataclass
class MissConfig:
    """The policy and its knobs (the `miss.*` keys). reload loads the right expert and waits for
    it: output identical to transformers. buddy (BuddyMoE) computes a resident buddy of the missing
    expert instead, when the token's Token Activating Entropy exceeds tau (needs `odmoe-profile MODEL`
    first). importance replaces a low-score activated expert by a resident inactive one of similar
    router score. Lossy policies are opt-in: a response that used a substitution says exact=false,
    substitutions=n."""

    policy: str = "reload"  # reload (lossless, the default) | buddy | importance
    budget: int = 2  # substitutions per generated token, over all its layers (0: none)
    tae_threshold: float = 0.0  # buddy: substitute only when TAE > this (used when tae_percentile < 0)
    tae_percentile: float = -1.0  # buddy: τ = this percentile of the layer's profiled TAE (-1: use threshold)
    alpha: float = 0.9  # buddy: Cumulative Frequency Threshold of the buddy lists
    k_max: int = 4  # buddy: at most this many buddies per expert
    importance_alpha: float = 0.3  # importance: low-score band (1±α)·β around the (k+1)-th score β
    profile: str = ""  # buddy: odmoe-profile's output file ("": MODEL/odmoe-profile/profile.npz)

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"miss.policy={self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.budget < 0 or self.k_max < 1:
            raise ValueError("miss.budget must be >= 0 and miss.k_max >= 1")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"miss.alpha must lie in (0, 1], got {self.alpha}")
        if not (self.tae_percentile == -1.0 or 0.0 <= self.tae_percentile <= 100.0):
            raise ValueError(f"miss.tae_percentile must be -1 or lie in [0, 100], got {self.tae_percentile}")
        if self.importance_alpha < 0:
            raise ValueError(f"miss.importance_alpha must be >= 0, got {self.importance_alpha}")

    @property
    def lossy(self) -> bool:
        return self.policy != "reload"


# -- offline: buddy lists ------------------------------------------------------------------------
def conditional_coactivation(matrix: np.ndarray) -> np.ndarray:
    """q[i, j] = M[i, j] / Σ_j' M[i, j'] with the diagonal zeroed (BuddyMoE Eq. 4); rows of an expert
    that never co-activated stay zero. [E, E] -> [E, E] float64."""
    m = np.array(matrix, dtype=np.float64)
    np.fill_diagonal(m, 0.0)
    totals = m.sum(axis=1, keepdims=True)
    return np.divide(m, totals, out=np.zeros_like(m), where=totals > 0)


def buddy_lists(matrix: np.ndarray, alpha: float, k_max: int) -> list[list[int]]:
    """Per pivot expert i: its peers by descending q[j|i], the shortest prefix whose cumulative q
    reaches α (at least one when i has any co-activation), capped at k_max. Ties: lower id first."""
    q = conditional_coactivation(matrix)
    lists = []
    for i in range(q.shape[0]):
        order = sorted((j for j in range(q.shape[1]) if q[i, j] > 0), key=lambda j: (-q[i, j], j))
        buddies: list[int] = []
        covered = 0.0
        for j in order:
            if len(buddies) == k_max or covered >= alpha - 1e-12:
                break
            buddies.append(j)
            covered += q[i, j]
        lists.append(buddies)
    return lists


# -- online: the gates ---------------------------------------------------------------------------
def token_activating_entropy(top_k_weights: Sequence[float]) -> float:
    """Entropy of the renormalised top-k weights / log k, in [0, 1]: 0 peaky, 1 flat (k=1: 0)."""
    w = [max(float(x), 0.0) for x in top_k_weights]
    total = sum(w)
    if len(w) < 2 or total <= 0:
        return 0.0
    p = [x / total for x in w]
    return -sum(x * math.log(x) for x in p if x > 0) / math.log(len(p))


def tae_allows(tae: float, tau: float) -> bool:
    """BuddyMoE forbids replacement when TAE <= τ."""
    return tae > tau


def importance_band(scores: Sequence[float], k: int, alpha: float) -> tuple[float, float, float]:
    """(low_below, beta, alt_at_least): an activated expert scoring below (1+α)β is low-score; an
    inactive one scoring at least (1-α)β may stand in for it. β = the (k+1)-th highest score."""
    ranked = sorted((float(s) for s in scores), reverse=True)
    beta = ranked[k] if len(ranked) > k else 0.0
    return (1 + alpha) * beta, beta, (1 - alpha) * beta


@dataclass
class TokenBudget:
    """Substitutions left to each token of the current forward pass, over its layers."""

    per_token: int
    used: dict[int, int] = field(default_factory=dict)  # token row -> substitutions so far

    def left(self, token: int) -> int:
        return self.per_token - self.used.get(token, 0)

    def spend(self, token: int) -> None:
        self.used[token] = self.used.get(token, 0) + 1

    def reset(self) -> None:
        self.used.clear()


@dataclass(frozen=True)
class Profile:
    """What odmoe-profile measured, as the run-time policy needs it (layer -> ...)."""

    coactivation: dict[int, np.ndarray]  # binary co-activation counts [E, E]
    tae_percentiles: dict[int, np.ndarray]  # [101]: the 0th..100th percentile of the layer's TAE

    def buddies(self, alpha: float, k_max: int) -> dict[int, list[list[int]]]:
        return {layer: buddy_lists(m, alpha, k_max) for layer, m in self.coactivation.items()}

    def tau(self, layer: int, percentile: float) -> float:
        table = self.tae_percentiles[layer]
        return float(np.interp(percentile, np.arange(len(table)), table))


def choose_substitutes(
    settings: MissConfig,
    missing: Sequence[int],
    activated: Sequence[int],
    weights: Sequence[float],
    resident: Sequence[int],
    budget_left: int,
    *,
    tau: float = 0.0,
    buddies: Sequence[Sequence[int]] | None = None,
    scores: Sequence[float] | None = None,
) -> dict[int, int]:
    """One token at one layer: missing expert -> the resident expert computed in its place.

    `activated`/`weights`: the token's top-k and their gate weights; `missing`: those not preloaded;
    `resident`: loaded and unused (predicted, not activated); `scores`: the router's scores over all
    experts (importance); `buddies[i]`: i's buddy list (buddy). Experts left out are reloaded.
    """
    if not settings.lossy or budget_left <= 0 or not missing or not resident:
        return {}
    free = [r for r in resident if r not in activated]
    chosen: dict[int, int] = {}
    if settings.policy == "buddy":
        if buddies is None or not tae_allows(token_activating_entropy(weights), tau):
            return {}
        for e in missing:  # in the token's top-k order: the heavier expert picks first
            pick = next((b for b in buddies[e] if b in free), None)
            if pick is not None and len(chosen) < budget_left:
                chosen[e] = pick
                free.remove(pick)
        return chosen
    if scores is None:
        return {}
    low_below, _, alt_at_least = importance_band(scores, len(activated), settings.importance_alpha)
    low = [e for e in missing if scores[e] < low_below]
    alternatives = sorted((r for r in free if scores[r] >= alt_at_least), key=lambda r: (-scores[r], r))
    for e in sorted(low, key=lambda e: (scores[e], e)):  # the least important first
        if not alternatives or len(chosen) >= budget_left:
            break
        chosen[e] = alternatives.pop(0)
    return chosen
