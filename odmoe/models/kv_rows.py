"""K/V alignment's tensors: main's newest cache rows out, the shadow's newest rows overwritten.

Both sides of the paper's KV alignment (§3.2) in one place, so the shadow node and the recall
replay do exactly the same thing. Shapes: [layers, kv_heads, rows, head_dim].

What a cache layer's "keys" and "values" are depends on the family's attention; these functions
hand over whatever transformers' DynamicCache holds, which is all the state the next step reads:
- Mixtral, Qwen, OLMoE: per-KV-head keys (after RoPE) and values, [kv_heads, rows, head_dim] each.
- DeepSeek-V2/V3 (MLA): the cache stores the *compressed* latent, not per-head K/V. "keys" are the
  normed KV latent `kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank])`, [1, rows, kv_lora_rank];
  "values" are the shared RoPE key part, after RoPE, [1, rows, qk_rope_head_dim]. Per-head keys and
  values are re-expanded from them by `kv_b_proj` at every step, so overwriting these two tensors
  aligns everything (tests/test_deepseek.py checks the next step is then bit-identical). The rows
  are MLA's small ones: (kv_lora_rank + qk_rope_head_dim) numbers per layer and token.
Dense first layers (DeepSeek's `first_k_dense_replace`) have attention and a cache like any other
layer, so every layer is aligned, MoE or not.

Hybrid models (Qwen3-Next: three gated-DeltaNet layers to one full-attention layer) have rows only
in their attention layers; a linear-attention layer holds a fixed-size recurrent state (a conv
window and a [heads, d_k, d_v] matrix) that every token updates. Alignment copies the attention
layers' rows (`row_layers`, in order) and leaves the recurrent states to the shadow, which builds
them from the tokens it is aligned with, at its own precision: copying them would cost the whole
state (MBs per layer for the published models) at every alignment, not a few rows per token.

Sliding-window layers (gpt-oss: every other layer attends to the last 128 tokens) keep only their
window's newest rows (`window - 1` of them once full), so only those matter: `newest_rows` sends a
layer's last min(rows, stored) rows, zero-padded on the left to the common row count (the padding
stands for positions neither side still stores), and writing rows at absolute positions places
each where that layer stores it, dropping what its window has left behind. Such a cache cannot be
cut back past its window (`croppable`): a shadow that must roll back rebuilds it from tokens, as
for the recurrent states.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def row_layers(cache: DynamicCache) -> list:
    """The cache's layers that hold K/V rows, in order: all of them but linear-attention layers."""
    return [layer for layer in cache.layers if not hasattr(layer, "recurrent_states")]


def has_recurrent_state(cache: DynamicCache) -> bool:
    """A linear-attention layer's state cannot be cut back to an earlier position (`crop`)."""
    return any(hasattr(layer, "recurrent_states") for layer in cache.layers)


def croppable(cache: DynamicCache) -> bool:
    """Whether `crop` can take the cache back to any earlier position: not with a recurrent state,
    nor with a sliding window (it keeps no rows older than its window)."""
    return not any(hasattr(layer, "recurrent_states") or _sliding(layer) for layer in cache.layers)


def _sliding(layer) -> bool:
    return getattr(layer, "sliding_window", None) is not None and hasattr(layer, "cumulative_length")


def first_position(layer) -> int:
    """The position of a row layer's first stored row: 0, or past what its sliding window dropped."""
    return layer.cumulative_length - layer.keys.shape[-2] if _sliding(layer) else 0


def newest_rows(cache: DynamicCache, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last `rows` positions of every row layer's keys and values (batch 0); a sliding-window
    layer's rows its window no longer holds are zeros."""
    layers = row_layers(cache)
    keys = torch.stack([_last(layer.keys[0], rows) for layer in layers])
    values = torch.stack([_last(layer.values[0], rows) for layer in layers])
    return keys, values


def _last(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [heads, stored, D]'s last `rows` rows, zero-padded on the left when it stores fewer."""
    held = t[:, -rows:]
    if held.shape[1] == rows:
        return held
    padded = t.new_zeros(t.shape[0], rows, t.shape[2])
    padded[:, rows - held.shape[1] :] = held
    return padded


def overwrite_newest_rows(cache: DynamicCache, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Replace the cache's last `rows` positions in every row layer with main's K/V."""
    rows = keys.shape[2]
    for i, layer in enumerate(row_layers(cache)):
        n = min(rows, layer.keys.shape[2])  # a sliding window may store fewer
        layer.keys[0, :, -n:] = keys[i][:, rows - n :].to(layer.keys.device, layer.keys.dtype)
        layer.values[0, :, -n:] = values[i][:, rows - n :].to(layer.values.device, layer.values.dtype)


def overwrite_rows(cache: DynamicCache, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Replace positions [start, start + rows) in every layer with main's K/V (a speculative shadow
    may be ahead of them: its newer rows stay); a sliding-window layer takes those it still stores."""
    end = start + keys.shape[2]
    for i, layer in enumerate(row_layers(cache)):
        first = first_position(layer)
        lo = max(start, first)
        if lo >= end:
            continue
        stored, given = slice(lo - first, end - first), slice(lo - start, end - start)
        layer.keys[0, :, stored] = keys[i][:, given].to(layer.keys.device, layer.keys.dtype)
        layer.values[0, :, stored] = values[i][:, given].to(layer.values.device, layer.values.dtype)
