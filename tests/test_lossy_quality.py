"""The in-process perplexity of suite `lossy`: reload (or no miss) is the model's own perplexity;
a lossy policy with its gate open substitutes within its budget and changes it."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe.lossy.miss_policy import MissConfig
from odmoe_bench.lossy_quality import inject_wrong, perplexity, score_window, shadow_predictions
from odmoe_bench.suites.lossy import agreement

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

PROMPT = 8


@pytest.fixture(scope="module")
def setup(model_dirs):
    path = model_dirs["mixtral"]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    experts = model.config.num_local_experts
    return path, model, ids, experts, shadow_predictions(model, ids, experts)


def _plain_ppl(model, ids):
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0, PROMPT:-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[PROMPT + 1 :])).item())


def test_reload_and_perfect_predictions_are_the_models_own(setup):
    path, model, ids, experts, exact = setup
    wrong = inject_wrong(exact, 1.0, experts, seed=0)
    reload = score_window(model, ids, PROMPT, wrong, MissConfig(), path, experts)
    assert reload.substitutions == 0 and reload.misses == reload.activated  # every expert missed
    assert perplexity([reload]) == pytest.approx(_plain_ppl(model, ids), rel=1e-5)
    important = MissConfig("importance", importance_alpha=50.0, budget=8)
    hit = score_window(model, ids, PROMPT, exact, important, path, experts)  # an fp32 shadow: no miss
    assert hit.misses == 0 and hit.substitutions == 0


def test_open_gate_substitutes_within_budget_and_changes_perplexity(setup):
    path, model, ids, experts, exact = setup
    wrong = inject_wrong(exact, 1.0, experts, seed=0)
    result = score_window(
        model, ids, PROMPT, wrong, MissConfig("importance", importance_alpha=50.0, budget=1), path, experts
    )
    decode_tokens = len(ids) - PROMPT
    assert 0 < result.substitutions <= decode_tokens  # at most one per token
    assert perplexity([result]) != pytest.approx(_plain_ppl(model, ids), rel=1e-6)


def test_agreement_is_positionwise():
    assert agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert agreement([[1, 9, 3], [4]], [[1, 2, 3], [4, 5]]) == pytest.approx(3 / 5)
