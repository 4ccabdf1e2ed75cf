"""K/V alignment's tensors: main's newest cache rows out, the shadow's newest rows overwritten.

Both sides of the paper's KV alignment (§3.2) in one place, so the shadow node and the recall
replay do exactly the same thing. Shapes: [layers, kv_heads, rows, head_dim].
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def newest_rows(cache: DynamicCache, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last `rows` positions of every layer's keys and values (batch 0)."""
    keys = torch.stack([layer.keys[0, :, -rows:] for layer in cache.layers])
    values = torch.stack([layer.values[0, :, -rows:] for layer in cache.layers])
    return keys, values


def overwrite_newest_rows(cache: DynamicCache, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Replace the cache's last `rows` positions in every layer with main's K/V."""
    rows = keys.shape[2]
    for i, layer in enumerate(cache.layers):
        layer.keys[0, :, -rows:] = keys[i].to(layer.keys.dtype)
        layer.values[0, :, -rows:] = values[i].to(layer.values.dtype)
