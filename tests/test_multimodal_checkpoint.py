"""A vision-language checkpoint as published (Qwen3.5 MoE: `qwen3_5_moe`, the language model under
`model.language_model.`, a vision tower beside it): odmoe serves its language model, as
transformers' AutoModelForCausalLM loads that checkpoint, and says the vision tower is skipped.
Its cluster tests are tests/test_focused_families.py's (the family `qwen3_5_moe`)."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM

from odmoe.models.checkpoint import Checkpoint


def test_its_language_model_is_served_and_the_vision_tower_skipped(model_dirs, caplog):
    path = model_dirs["qwen3_5_moe"]
    with caplog.at_level(logging.INFO, logger="odmoe.models.checkpoint"):
        checkpoint = Checkpoint(path)
    assert checkpoint.config.model_type == "qwen3_5_moe_text"
    assert "serving its language model (qwen3_5_moe_text); the vision tower is skipped (model.visual)" in (
        caplog.text
    )
    reference = AutoModelForCausalLM.from_pretrained(path).state_dict()
    main = checkpoint.non_expert_state_dict()
    assert main.keys() == {k for k in reference if ".experts." not in k}
    assert all(torch.equal(main[k], reference[k]) for k in main)
    fused = reference["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(checkpoint.expert(2, 5).gate_up, fused[5])
    assert not any("visual" in k for k in checkpoint.weight_map)
