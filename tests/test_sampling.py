"""`TokenChooser` picks the same tokens as transformers' `generate()` for every family and several
parameter sets (pure: one process, the real models' logits; the clusters are checked in
tests/test_cluster_fidelity.py and tests/test_http_api.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from odmoe.main.sampling import InvalidSampling, SamplingParams, TokenChooser
from tests.conftest import FAMILY_NAMES

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

PARAMETER_SETS = {
    "temperature": SamplingParams(do_sample=True, temperature=0.7),
    "top_p+top_k": SamplingParams(do_sample=True, top_p=0.85, top_k=12),
    "min_p": SamplingParams(do_sample=True, temperature=1.4, min_p=0.08),
    "repetition_penalty": SamplingParams(do_sample=True, repetition_penalty=1.6),
    "transformers_defaults": SamplingParams(do_sample=True),  # top_k=50 from transformers
    "greedy+repetition_penalty": SamplingParams(repetition_penalty=1.3),
}
PROMPT = [5, 17, 300, 42, 9, 77]
NEW = 24


def chooser_tokens(model, params: SamplingParams) -> list[int]:
    chooser = TokenChooser(model, params, PROMPT)
    cache, step, out = DynamicCache(config=model.config), torch.tensor([PROMPT]), []
    eos = model.generation_config.eos_token_id
    for _ in range(NEW):
        logits = model(
            input_ids=step,
            attention_mask=torch.ones(1, len(PROMPT) + len(out), dtype=torch.long),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]
        token = chooser.choose(logits.float())
        out.append(token)
        if token == eos:
            break
        step = torch.tensor([[token]])
    return out


@pytest.mark.parametrize("family", FAMILY_NAMES)
@torch.inference_mode()
def test_chooser_equals_generate(model_dirs, family):
    model = AutoModelForCausalLM.from_pretrained(model_dirs[family]).eval()
    ids = torch.tensor([PROMPT])
    for seed, (label, params) in enumerate(PARAMETER_SETS.items()):
        params = SamplingParams(**{**params.__dict__, "seed": seed})
        torch.manual_seed(seed)
        want = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, **params.generate_kwargs()
        )[0, len(PROMPT) :].tolist()
        assert chooser_tokens(model, params) == want, f"{family}: {label}"


def test_draws_of_one_request_do_not_touch_the_global_generator(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["mixtral"]).eval()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with torch.inference_mode():
        chooser_tokens(model, SamplingParams(do_sample=True, seed=1))
    assert torch.equal(torch.get_rng_state(), before)


def test_sampling_without_a_seed_draws_and_reports_one(model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["mixtral"]).eval()
    seeds = {TokenChooser(model, SamplingParams(do_sample=True), PROMPT).seed for _ in range(3)}
    assert len(seeds) == 3


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": 0},
        {"top_p": 0},
        {"top_p": 1.2},
        {"top_k": -1},
        {"min_p": 2},
        {"repetition_penalty": 0},
        {"seed": -1},
    ],
)
def test_out_of_range_parameters_are_refused(bad):
    with pytest.raises(InvalidSampling):
        SamplingParams(do_sample=True, **bad).validate()
