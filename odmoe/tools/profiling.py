"""Offline expert profiling for the lossy miss policies (BuddyMoE §3.2): run the model over
calibration text and count, per MoE layer, what its routers chose.

Contract: `profile_model(model, windows, num_experts)` runs transformers' own model (experts
included, in this process) over token windows [n] and returns an `ExpertProfile`; `save_profile`
writes it as one `.npz` (what `odmoe.lossy.substitution.load_profile` reads) plus a readable JSON
summary beside it. Per layer:
- `activations` [E]: tokens that routed to each expert (A_l(i));
- `coact_bin` [E, E]: tokens that routed to both i and j (M_l(i, j); the diagonal is A_l(i));
- `coact_prob` [E, E]: the same, each token weighted by min(p̃_i, p̃_j) of its renormalised top-k;
- `tae_pct` [101]: the 0th..100th percentile of the layer's Token Activating Entropy;
- the buddy lists for the α and K_max asked (the run-time policy recomputes them from `coact_bin`
  for whatever α / K_max it is given, so one profile serves a sweep).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from odmoe.lossy.miss_policy import buddy_lists
from odmoe.shadow.shadow_model import router_modules, router_output


@dataclass
class LayerCounts:
    activations: np.ndarray  # [E] int64
    coact_bin: np.ndarray  # [E, E] int64
    coact_prob: np.ndarray  # [E, E] float64
    tae: list[np.ndarray] = field(default_factory=list)  # per batch [T]

    @classmethod
    def empty(cls, num_experts: int) -> LayerCounts:
        e = num_experts
        return cls(np.zeros(e, np.int64), np.zeros((e, e), np.int64), np.zeros((e, e), np.float64))

    def add(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """One batch of routing decisions: [T, k] ids and their gate weights."""
        e = self.activations.shape[0]
        idx = top_k_index.reshape(-1, top_k_index.shape[-1]).long()
        w = top_k_weights.reshape(idx.shape).float().clamp(min=0)
        p = w / w.sum(-1, keepdim=True).clamp(min=1e-12)  # renormalised top-k [T, k]
        hot = torch.zeros(idx.shape[0], e).scatter_(1, idx, 1.0)  # [T, E]
        prob = torch.zeros(idx.shape[0], e).scatter_(1, idx, p)  # [T, E]
        self.activations += hot.sum(0).long().numpy()
        self.coact_bin += (hot.T @ hot).long().numpy()
        self.coact_prob += torch.minimum(prob.unsqueeze(2), prob.unsqueeze(1)).sum(0).double().numpy()
        k = idx.shape[1]
        if k > 1:
            ent = -(p * p.clamp(min=1e-12).log()).sum(-1) / np.log(k)
        else:
            ent = torch.zeros(idx.shape[0])
        self.tae.append(ent.numpy())

    @property
    def tae_percentiles(self) -> np.ndarray:
        values = np.concatenate(self.tae) if self.tae else np.zeros(1)
        return np.percentile(values, np.arange(101))


@dataclass
class ExpertProfile:
    layers: dict[int, LayerCounts]
    tokens: int

    def buddies(self, alpha: float, k_max: int) -> dict[int, list[list[int]]]:
        return {layer: buddy_lists(c.coact_bin, alpha, k_max) for layer, c in self.layers.items()}


@torch.inference_mode()
def profile_model(
    model: torch.nn.Module,
    windows: Iterable[list[int]],
    num_experts: int,
    progress: Callable[[int, int], None] | None = None,
) -> ExpertProfile:
    """Run each window through the model (one forward each) and count every router's choices."""
    counts = {layer: LayerCounts.empty(num_experts) for layer, _ in router_modules(model, num_experts)}
    handles = []
    for layer, router in router_modules(model, num_experts):

        def hook(module, _inputs, output, layer=layer):
            _logits, weights, index = router_output(module, output)
            counts[layer].add(index, weights)

        handles.append(router.register_forward_hook(hook))
    windows, tokens = list(windows), 0
    try:
        for i, ids in enumerate(windows):
            x = torch.tensor([ids])
            model(input_ids=x, attention_mask=torch.ones_like(x))
            tokens += len(ids)
            if progress is not None:
                progress(i + 1, len(windows))
    finally:
        for handle in handles:
            handle.remove()
    return ExpertProfile(counts, tokens)


def save_profile(profile: ExpertProfile, path: Path, alpha: float, k_max: int) -> Path:
    """`path` (.npz) with every layer's arrays, and `path` with .json: a readable summary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for layer, c in profile.layers.items():
        arrays[f"activations_{layer}"] = c.activations
        arrays[f"coact_bin_{layer}"] = c.coact_bin
        arrays[f"coact_prob_{layer}"] = c.coact_prob
        arrays[f"tae_pct_{layer}"] = c.tae_percentiles
    np.savez(path, **arrays)
    buddies = profile.buddies(alpha, k_max)
    summary = {
        "tokens": profile.tokens,
        "alpha": alpha,
        "k_max": k_max,
        "layers": {
            str(layer): {
                "activations": c.activations.tolist(),
                "buddies": buddies[layer],
                "buddy_list_sizes": [len(b) for b in buddies[layer]],
                "tae_percentiles": {f"p{p}": float(c.tae_percentiles[p]) for p in (10, 20, 50, 80, 90)},
            }
            for layer, c in profile.layers.items()
        },
    }
    path.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    return path


def draw_heatmap(profile: ExpertProfile, layer: int, out: Path) -> Path:
    """The papers' figure: a layer's binary co-activation matrix (diagonal: activations)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = profile.layers[layer]
    m = c.coact_bin.astype(float)
    np.fill_diagonal(m, np.nan)  # the diagonal (A_l(i)) would drown the pairs
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    image = ax.imshow(m, cmap="viridis")
    ax.set_title(f"Expert co-activation, layer {layer} ({profile.tokens} tokens)")
    ax.set_xlabel("expert j")
    ax.set_ylabel("expert i")
    fig.colorbar(image, ax=ax, label="tokens routed to both")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
