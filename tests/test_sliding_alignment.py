"""Aligning a shadow whose model has sliding-window layers (gpt-oss: every other layer attends to its
last `sliding_window` tokens and its cache keeps only those; Llama 4's chunked-attention layers are
kept the same way): main's newest rows, and a prompt's rows
longer than the window, land where each layer stores them, and the next step is then bit-identical
to main's. Before odmoe.models.kv_rows knew windows, stacking a prompt's rows failed on the shorter
sliding layers and writing at absolute positions missed the window's offset."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe.models.kv_rows import croppable, newest_rows, overwrite_newest_rows, overwrite_rows

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


@pytest.fixture(scope="module", params=["gpt_oss", "llama4_text"])
def model(model_dirs, request):
    """gpt-oss's sliding windows; Llama 4's chunked attention, whose cache layers transformers keeps
    as sliding windows of the chunk size (only the mask differs)."""
    m = AutoModelForCausalLM.from_pretrained(model_dirs[request.param]).eval()
    window = getattr(m.config, "sliding_window", None) or m.config.attention_chunk_size
    assert window == 8
    return m


def _cache(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=True).past_key_values


def _next_logits(model, cache, token: int):
    with torch.no_grad():
        return model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]


PROMPT = [5, 17, 300, 42, 9, 77, 860, 511, 130, 187, 956, 953]  # 12 tokens: past the window of 8


def test_the_newest_row_aligns_a_cache_past_its_window(model):
    # one decode step each from the same prefill (a prefill's earlier rows may differ in the last
    # bits with its length: the experts' grouped rows), the shadow's with another token
    main, shadow = _cache(model, PROMPT[:-1]), _cache(model, PROMPT[:-1])
    _next_logits(model, main, PROMPT[-1])
    _next_logits(model, shadow, 3)
    assert not croppable(shadow)
    keys, values = newest_rows(main, 1)
    overwrite_newest_rows(shadow, keys, values)
    assert torch.equal(_next_logits(model, shadow, 44), _next_logits(model, main, 44))


def test_a_prompt_longer_than_the_window_aligns_at_its_positions(model):
    main = _cache(model, PROMPT)
    shadow = _cache(model, [4] * len(PROMPT))  # every row wrong
    keys, values = newest_rows(main, len(PROMPT))  # a full layer's 12 rows, a window's 7 padded
    assert keys.shape[2] == len(PROMPT)
    overwrite_rows(shadow, 0, keys, values)
    assert torch.equal(_next_logits(model, shadow, 44), _next_logits(model, main, 44))
