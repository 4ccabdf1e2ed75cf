"""Aligning a shadow of a hybrid model (Qwen3-Next: gated-DeltaNet linear-attention layers with a
recurrent state, every 4th layer full attention). Alignment copies the attention layers' K/V rows
and leaves each linear-attention layer's recurrent state to the shadow (odmoe/models/kv_rows.py); a
speculative shadow that must roll back rebuilds its cache from the tokens that held, since a
recurrent state cannot be cut back to an earlier position (odmoe/shadow/predictor.py `_refilled`)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from odmoe import LocalCluster
from odmoe.models.kv_rows import has_recurrent_state, newest_rows, overwrite_newest_rows, row_layers
from odmoe.shadow.shadow_batch import RowCache
from tests.test_cluster_fidelity import PROMPTS, reference

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def _cache(model, ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


def test_alignment_copies_the_attention_rows_and_leaves_the_recurrent_states(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["qwen3_next"]).eval()
    kinds = model.config.layer_types
    main, shadow = _cache(model, [5, 9, 200, 31, 7]), _cache(model, [5, 9, 200, 31, 8])  # the last differs
    assert len(row_layers(main)) == kinds.count("full_attention") == 1 and has_recurrent_state(main)
    keys, values = newest_rows(main, 2)
    assert keys.shape[:3] == (1, model.config.num_key_value_heads, 2)
    linear = kinds.index("linear_attention")
    state_before = shadow.layers[linear].recurrent_states[0].clone()
    overwrite_newest_rows(shadow, keys, values)
    assert torch.equal(row_layers(shadow)[0].keys[0, :, -2:], keys[0])
    assert torch.equal(row_layers(shadow)[0].values[0, :, -2:], values[0])
    assert torch.equal(shadow.layers[linear].recurrent_states[0], state_before)  # the shadow's own
    assert not RowCache(shadow).croppable  # a rollback must rebuild it


def test_a_cache_without_recurrent_states_is_cut_back_as_before(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["mixtral"]).eval()
    cache = RowCache(_cache(model, [5, 9, 200, 31, 7]))
    assert cache.croppable and cache.layers == model.config.num_hidden_layers
    cache.crop_to(3)
    assert cache.length == 3


@pytest.mark.integration
@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_a_speculative_shadow_that_rolls_back_changes_no_token(model_dirs, reap_children):
    """The defaults (speculative alignment) with 30 % of the shadow's own tokens made wrong: it
    rolls back often, rebuilding its hybrid cache each time; main's tokens are the reference's."""
    path = model_dirs["qwen3_next"]
    # cacheless: every prediction is used; each load takes 3 ms more (an emulated link), so main is
    # the slower and the shadow runs ahead of it even on a loaded box (it rolled back nothing when
    # the box was so busy that the shadow never got ahead: a flaky test, not a wrong token)
    words = ["lab=on", "emulation.inject_wrong_token=0.3", "worker.cache=0", "emulation.link.latency_ms=3"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        for prompt in PROMPTS[:2]:
            want_ids, want_logits = reference(path, prompt, new_tokens=16)
            got = cluster.client.generate(prompt, max_new_tokens=16, return_logits=True)
            assert got.token_ids == want_ids and torch.equal(got.final_logits, want_logits)
            ahead = {
                k: got.stats.get(k)
                for k in ("shadow_rollbacks", "shadow_ahead_mean", "lookahead_layers_mean")
            }
            assert got.stats["shadow_rollbacks"] > 0, ahead
            assert got.stats["recall"]["overall"] > 0.5, got.stats["recall"]  # it still predicts
