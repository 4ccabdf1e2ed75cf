"""Main's run-time side of a lossy miss policy: which resident expert stands in for a missed one.

Contract: `Substituter.decide(layer, top_k_index[T, k], top_k_weights[T, k], predicted)` returns
{missing expert: resident expert} for a decode step, applying `odmoe.lossy.miss_policy` with this
request's per-token budget (main's data path counts them and starts each token's). Only
single-token steps (decode, batch 1) are ever substituted: rows of one expert are never split
between two experts, and prefill has no prediction.

Inputs the gates need: the buddy lists and TAE percentiles from `odmoe-profile` (loaded here), and
for `importance` the router's scores over all experts, read by `odmoe.shadow.router_tap.RouterTap` from the
routers' own outputs in main's model (no second router computation).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from odmoe.lossy.miss_policy import MissConfig, Profile, TokenBudget, choose_substitutes

if TYPE_CHECKING:
    from odmoe.shadow.router_tap import RouterTap

log = logging.getLogger("odmoe.main")
PROFILE_FILE = "odmoe-profile/profile.npz"


class ProfileMissing(FileNotFoundError):
    """miss.policy=buddy without a profile: run odmoe-profile first."""


def profile_path(model_path: str, given: str = "") -> Path:
    return Path(given) if given else Path(model_path) / PROFILE_FILE


def use_rates(path: Path) -> dict[tuple[int, int], float]:
    """{(layer, expert): activations per token} from odmoe-profile's files (`path` and its .json
    beside it, which says how many tokens were profiled); {} when either is missing."""
    summary = path.with_suffix(".json")
    if not (path.is_file() and summary.is_file()):
        return {}
    tokens = json.loads(summary.read_text()).get("tokens", 0)
    data = np.load(path)
    rates = {}
    for name in data.files:
        if name.startswith("activations_") and tokens > 0:
            layer = int(name.rsplit("_", 1)[1])
            rates.update({(layer, e): float(n) / tokens for e, n in enumerate(data[name])})
    return rates


def load_profile(path: Path) -> Profile:
    """Read what odmoe.tools.profiling.save_profile wrote (keys `coact_bin_<layer>`, `tae_pct_<layer>`)."""
    if not path.is_file():
        raise ProfileMissing(f"no expert profile at {path}: run `odmoe-profile MODEL` (miss.policy=buddy)")
    data = np.load(path)
    layers = sorted(int(k.rsplit("_", 1)[1]) for k in data.files if k.startswith("coact_bin_"))
    return Profile(
        coactivation={layer: data[f"coact_bin_{layer}"] for layer in layers},
        tae_percentiles={layer: data[f"tae_pct_{layer}"] for layer in layers},
    )


class Substituter:
    def __init__(self, cfg: MissConfig, profile: Profile | None = None, tap: RouterTap | None = None):
        cfg.validate()
        if cfg.policy == "buddy" and profile is None:
            raise ProfileMissing("miss.policy=buddy needs the profile odmoe-profile writes")
        if cfg.policy == "importance" and tap is None:
            raise ValueError("miss.policy=importance needs the router scores (a RouterTap)")
        self.cfg, self.profile, self.tap = cfg, profile, tap
        self.buddies = profile.buddies(cfg.alpha, cfg.k_max) if profile is not None else {}
        self.budget = TokenBudget(cfg.budget)

    @classmethod
    def build(cls, cfg: MissConfig, model_path: str, model: torch.nn.Module, num_experts: int):
        """The substituter main runs with, or None for the lossless default."""
        if not cfg.lossy:
            return None
        log.warning("miss.policy=%s: outputs may differ from the model's own (lossy, opt-in)", cfg.policy)
        return cls.for_model(cfg, model_path, model, num_experts)

    @classmethod
    def for_model(cls, cfg: MissConfig, model_path: str, model: torch.nn.Module, num_experts: int):
        profile = load_profile(profile_path(model_path, cfg.profile)) if cfg.policy == "buddy" else None
        from odmoe.shadow.router_tap import RouterTap  # the router hooks: only for the importance policy

        tap = RouterTap(model, num_experts) if cfg.policy == "importance" else None
        return cls(cfg, profile, tap)

    def tau(self, layer: int) -> float:
        if self.cfg.tae_percentile >= 0 and self.profile is not None:
            return self.profile.tau(layer, self.cfg.tae_percentile)
        return self.cfg.tae_threshold

    def decide(
        self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, predicted: list[int] | None
    ) -> dict[int, int]:
        """A decode step of main (one token row): missing expert -> stand-in; {} to reload them all."""
        if not predicted or top_k_index.shape[0] != 1:
            return {}
        return self.decide_row(layer, top_k_index[0].tolist(), top_k_weights[0].tolist(), predicted, row=0)

    def decide_row(
        self, layer: int, activated: list[int], weights: list[float], predicted: list[int], row: int
    ) -> dict[int, int]:
        """One token (`row` of the current forward pass, its budget's key) at one layer."""
        scores = None
        if self.tap is not None and layer in self.tap.logits:
            scores = self.tap.scores(layer)[row].tolist()
        chosen = choose_substitutes(
            self.cfg,
            [e for e in activated if e not in predicted],
            activated,
            weights,
            [p for p in predicted if p not in activated],
            self.budget.left(row),
            tau=self.tau(layer),
            buddies=self.buddies.get(layer),
            scores=scores,
        )
        for _ in chosen:
            self.budget.spend(row)
        return chosen
