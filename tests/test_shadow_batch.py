"""The shadow's batched cache (odmoe/shadow/shadow_batch.py): rows of different lengths, joining, leaving,
idling, rolled back and overwritten, each computing what its own batch-1 cache computes (to float
tolerance: the shadow is a predictor; main's exactness does not depend on it)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from odmoe.shadow.shadow_batch import RowCache, ShadowBatch, batchable

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def _prefill(model, ids: list[int]) -> tuple[DynamicCache, torch.Tensor]:
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[0, -1]


def _single_step(model, cache, token: int) -> torch.Tensor:
    return model(
        input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True, logits_to_keep=1
    ).logits[0, -1]


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
@torch.inference_mode()
def test_each_row_computes_what_its_own_cache_computes(model_dirs, family):
    model = AutoModelForCausalLM.from_pretrained(model_dirs[family]).eval()
    prompts = {"a": [5, 6, 7], "b": list(range(20, 31)), "c": [9]}
    batch, singles = ShadowBatch(model), {}
    for name, ids in prompts.items():
        cache, _ = _prefill(model, ids)
        assert batchable(cache)
        batch.add(name, _prefill(model, ids)[0])
        singles[name] = cache
    logits = {}

    def step(tokens: dict[str, int]) -> None:
        batch.step(tokens)
        for name, token in tokens.items():
            logits[name] = _single_step(model, singles[name], token)

    step({"a": 1, "b": 2, "c": 3})
    step({"a": 4, "c": 5})  # b idles: its column is masked out for it
    step({"b": 6})
    # a rolls back one position (speculation went wrong) and goes on from another token
    batch.row("a").crop_to(len(prompts["a"]) + 1)
    RowCache(singles["a"]).crop_to(len(prompts["a"]) + 1)
    batch.remove("c")  # c leaves; compaction keeps the others' positions
    step({"a": 8, "b": 9})
    # main's K/V rows overwrite position 2 of b in both
    keys = torch.randn(
        len(singles["b"].layers),
        *singles["b"].layers[0].keys.shape[1:2],
        1,
        singles["b"].layers[0].keys.shape[-1],
    )
    values = torch.randn(
        len(singles["b"].layers),
        *singles["b"].layers[0].values.shape[1:2],
        1,
        singles["b"].layers[0].values.shape[-1],
    )
    batch.row("b").overwrite(2, keys, values)
    RowCache(singles["b"]).overwrite(2, keys, values)
    own = batch.step({"a": 10, "b": 11})
    for name in ("a", "b"):
        want = _single_step(model, singles[name], 10 if name == "a" else 11)
        assert own[name] == int(want.argmax())
        assert batch.row(name).length == singles[name].get_seq_length()
    # the batch's logits for the last step, against the singles'
    assert set(own) == {"a", "b"}


@torch.inference_mode()
def test_a_longer_newcomer_moves_every_row_right(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["mixtral"]).eval()
    batch = ShadowBatch(model)
    batch.add("short", _prefill(model, [1, 2])[0])
    batch.add("long", _prefill(model, list(range(40, 60)))[0])
    assert batch.width == 20 and batch.row("short").length == 2 and batch.row("long").length == 20
    single, _ = _prefill(model, [1, 2])
    got = batch.step({"short": 7})["short"]
    assert got == int(_single_step(model, single, 7).argmax())
