"""Two expert predictors from the literature, to compare with the shadow on the same tokens.

Both are pure functions of what main has computed, so they run inside the reference replay:
- next-layer gate (Mixtral-Offloading / AdapMoE style): layer l's router applied to the residual
  stream *entering* layer l (the output of layer l-1, or the embeddings for layer 0), normed as the
  router's own input is. It is available one layer ahead, no earlier.
- frequency (MoE-Infinity style): per layer, the k experts this request has activated most often so
  far (prompt tokens included); ties go to the lower expert id.
"""

from __future__ import annotations

from collections import Counter

import torch


def next_layer_gate(layer_module: torch.nn.Module, residual_in: torch.Tensor) -> list[int]:
    """Predict a decoder layer's experts from the hidden state entering it ([1, H] or [H])."""
    mlp = layer_module.mlp
    normed = layer_module.post_attention_layernorm(residual_in.reshape(1, -1))
    _logits, _weights, top_k_index = mlp.gate(normed)
    return sorted(int(e) for e in top_k_index[0].tolist())


class FrequencyPredictor:
    """Counts each layer's activations; predicts the top-k most frequent (ties: lower id)."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.counts: dict[int, Counter] = {}

    def observe(self, layer: int, experts: list[int]) -> None:
        self.counts.setdefault(layer, Counter()).update(experts)

    def predict(self, layer: int) -> list[int]:
        ranked = sorted(self.counts.get(layer, Counter()).items(), key=lambda kv: (-kv[1], kv[0]))
        return sorted(e for e, _ in ranked[: self.top_k])
