"""A vision-language checkpoint as published (Qwen3.5 MoE: `qwen3_5_moe`, the language model under
`model.language_model.`; Llama 4: `llama4`, under `language_model.model.`; a vision tower beside
it): odmoe serves its language model, as transformers' AutoModelForCausalLM loads that checkpoint,
and says the vision tower is skipped. Their cluster tests are tests/test_focused_families.py's."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe.models.checkpoint import Checkpoint

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


@pytest.mark.parametrize(
    "family, text_type, skipped, layer",
    [
        ("qwen3_5_moe", "qwen3_5_moe_text", "model.visual", "model.layers.2.mlp"),
        ("llama4", "llama4_text", "multi_modal_projector.linear_1, vision_model.class_embedding", None),
    ],
)
def test_its_language_model_is_served_and_the_vision_tower_skipped(
    model_dirs, caplog, family, text_type, skipped, layer
):
    path = model_dirs[family]
    with caplog.at_level(logging.INFO, logger="odmoe.models.checkpoint"):
        checkpoint = Checkpoint(path)
    assert checkpoint.config.model_type == text_type
    assert f"serving its language model ({text_type}); the vision tower is skipped" in caplog.text
    assert skipped.split(",")[0] in caplog.text
    reference = AutoModelForCausalLM.from_pretrained(path).state_dict()
    main = checkpoint.non_expert_state_dict()
    assert main.keys() == {k for k in reference if ".experts." not in k}
    assert all(torch.equal(main[k], reference[k]) for k in main)
    moe = layer or f"model.layers.{checkpoint.moe_layers[-1]}.feed_forward"
    fused = reference[f"{moe}.experts.gate_up_proj"]
    assert torch.equal(checkpoint.expert(int(moe.split(".")[2]), 5).gate_up, fused[5])
    towers = ("model.visual", "vision_model", "multi_modal")
    assert not any(k.startswith(towers) for k in checkpoint.weight_map)
