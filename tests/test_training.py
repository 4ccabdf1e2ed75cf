import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe.models.checkpoint import Checkpoint
from odmoe.tools.model_factory import ModelSpec
from odmoe.tools.training import TrainSettings, code_only, train_model


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_brief_training_lowers_held_out_loss_and_saves_a_loadable_model(tmp_path):
    spec = ModelSpec(family="mixtral", layers=2, hidden=64, intermediate=128, vocab=512, max_positions=128)
    settings = TrainSettings(steps=40, batch=4, seq_len=64, corpus_bytes=300_000, held_out_batches=2, lr=3e-3)
    out = train_model(tmp_path / "m", spec, settings)
    report = json.loads((out / "odmoe_training.json").read_text())
    assert report["held_out_loss_after"] < report["held_out_loss_before"]
    assert set(report["expert_load_per_layer"]) == {"0", "1"}
    assert 0 <= report["topk_gap_median"] <= 1
    assert Checkpoint(out).moe_layers == [0, 1]
    AutoModelForCausalLM.from_pretrained(out)  # loads offline through the ordinary path


def test_deepseek_training_learns_its_correction_bias(tmp_path):
    """DeepSeek-V3's balancing is the router bias nudged every step (it starts at zero), not a loss."""
    spec = ModelSpec(
        family="deepseek_v3", layers=2, hidden=64, intermediate=32, experts=8, top_k=2, heads=4, kv_heads=4,
        vocab=512, max_positions=128,
    )  # fmt: skip
    settings = TrainSettings(steps=20, batch=4, seq_len=64, corpus_bytes=300_000, held_out_batches=2, lr=3e-3)
    out = train_model(tmp_path / "m", spec, settings)
    report = json.loads((out / "odmoe_training.json").read_text())
    assert report["held_out_loss_after"] < report["held_out_loss_before"]
    assert set(report["expert_load_per_layer"]) == {"1"}  # layer 0 is dense
    router = AutoModelForCausalLM.from_pretrained(out).model.layers[1].mlp.gate
    bias = router.e_score_correction_bias
    assert bias.abs().max() > 0 and bias.abs().max() <= 20 * settings.bias_update_rate + 1e-6
    assert Checkpoint(out).moe_layers == [1]


def test_code_only_drops_comments_and_docstrings_and_keeps_the_code():
    source = '''"""Module docstring."""
import os  # a comment


class Stack:
    """A stack."""

    def push(self, item):
        """Push."""
        # why
        self.items.append(item)
        return "not a docstring"


def empty():
    """Only a docstring."""
'''
    assert code_only(source) == (
        "import os\n\nclass Stack:\n\n    def push(self, item):\n        self.items.append(item)\n"
        "        return 'not a docstring'\n\ndef empty():\n    pass\n"
    )
    assert code_only("def broken(:\n") == ""


def test_training_settings_threads_apply_only_while_training(tmp_path):
    spec = ModelSpec(
        family="mixtral", layers=1, hidden=32, intermediate=32, experts=4, vocab=300, max_positions=64
    )
    settings = TrainSettings(
        steps=2, batch=2, seq_len=32, corpus_bytes=100_000, held_out_batches=1, threads=1, code_only=True
    )
    before = torch.get_num_threads()
    train_model(tmp_path / "m", spec, settings)
    assert torch.get_num_threads() == before
