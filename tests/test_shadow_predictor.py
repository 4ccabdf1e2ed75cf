"""The shadow's predictor without its sockets (odmoe/shadow/predictor.py): main's messages in, what it
publishes out through one callback. Random mode (no model), speculation and rollback with the knobs
that make it wrong, requests stepped in lockstep each predicting what it predicts alone, untrusted
messages abandoning only their request; and the union of choices per step (odmoe/shadow/choices.py)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe.models.families import family_of
from odmoe.shadow.choices import Choice, StepChoices
from odmoe.shadow.predictor import PredictorSetup, ShadowPredictor
from odmoe.shadow.shadow_model import router_modules
from odmoe.transport.messages import (
    Align,
    BeginRequest,
    EndRequest,
    Prediction,
    ShadowEnded,
    ShadowIteration,
    Step,
)

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def _predictor(model=None, knobs=None, **settings) -> tuple[ShadowPredictor, list]:
    sent: list = []
    if model is None:
        shape = {"num_experts": 8, "top_k": 2, "vocab_size": 100, "moe_layers": (0, 1, 3)}
    else:
        family, config = family_of(model.config), model.config
        experts = int(getattr(config, family.num_experts_field))
        shape = {
            "num_experts": experts,
            "top_k": int(getattr(config, family.top_k_field)),
            "vocab_size": config.vocab_size,
            "moe_layers": tuple(sorted(layer for layer, _ in router_modules(model, experts))),
        }
    setup = PredictorSetup(device="cpu", max_positions=0, **shape, **settings)
    return ShadowPredictor(model, setup, sent.append, rng=random.Random(0), knobs=knobs), sent


def _of(sent: list, kind: type) -> list:
    return [m for m in sent if isinstance(m, kind)]


def _model(model_dirs, family: str):
    return AutoModelForCausalLM.from_pretrained(model_dirs[family]).eval()


def test_random_mode_is_paced_by_main_and_publishes_one_union_per_step():
    p, sent = _predictor()
    p.control(BeginRequest("a", [1, 2], 4, "s", 1), [])
    p.control(BeginRequest("b", [3], 4, "s", 1), [])
    assert p.runnable() == []  # no model: an iteration runs once main's Align for it is in
    p.control(Align("a", 1, 7), [])
    p.control(Align("b", 1, 8), [])
    p.step(p.runnable())
    assert [(m.request, m.iteration) for m in _of(sent, ShadowIteration)] == [("a", 1), ("b", 1)]
    predictions = _of(sent, Prediction)
    assert [m.step for m in predictions] == [Step("s", 1, layer) for layer in (0, 1, 3)]
    for m in predictions:
        assert m.requests == ["a", "b"] and [len(e) for e in m.request_experts] == [2, 2]
        assert m.experts == list(dict.fromkeys(m.request_experts[0] + m.request_experts[1]))
    assert p.runnable() == []
    sent.clear()
    p.control(EndRequest("a"), [])
    assert sent == [ShadowEnded("a")] and list(p.runs) == ["b"]


def test_a_bad_begin_is_dropped_and_a_new_stream_ends_the_old_requests():
    p, sent = _predictor()
    p.control(BeginRequest("a", [1], 4, "s1", 1), [])
    p.control(BeginRequest("bad", [100], 4, "s1", 1), [])  # a token outside the vocabulary
    assert list(p.runs) == ["a"] and p.dropped.count == 1
    p.control(BeginRequest("c", [1], 4, "s2", 1), [])  # main's next busy period
    assert sent == [ShadowEnded("a")] and list(p.runs) == ["c"]


class _Wrong:
    """Knobs that publish experts [0, 1] and make every own token another."""

    def __init__(self):
        self.seen: list[tuple[str, int, int]] = []

    def choice(self, request: str, iteration: int, layer: int, experts: list[int]) -> list[int]:
        self.seen.append((request, iteration, layer))
        return [0, 1]

    def own_token(self, token: int) -> int:
        return (token + 1) % 1024


@torch.inference_mode()
def test_speculation_runs_ahead_rolls_back_on_main_token_and_the_knobs_alter_its_output(model_dirs):
    knobs = _Wrong()
    p, sent = _predictor(_model(model_dirs, "mixtral"), knobs, speculative=True, max_ahead=2)
    p.control(BeginRequest("a", [5, 6, 7], 8, "s", 1), [])
    p.control(BeginRequest("b", [9], 8, "s", 1), [])
    for _ in range(2):  # at most max_ahead iterations ahead of main's newest report (none yet)
        p.step(p.runnable())
    assert p.runnable() == []
    layers = p.setup.moe_layers
    published = _of(sent, Prediction)
    assert [m.step for m in published] == [Step("s", t, layer) for t in (1, 2) for layer in layers]
    assert all(m.experts == [0, 1] and m.request_experts == [[0, 1], [0, 1]] for m in published)
    assert knobs.seen[: 2 * len(layers)] == [(r, 1, layer) for layer in layers for r in ("a", "b")]
    fed = p.runs["a"].spec.fed[1]
    sent.clear()
    p.control(Align("a", 1, (fed + 1) % 1024), [])  # main fed another token at iteration 1
    p.control(Align("b", 1, -1, True), [torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1)])  # no fit
    assert list(p.runs) == ["a"] and p.dropped.count == 1  # b abandoned, a goes on
    assert p.runs["a"].iteration == 1  # rolled back
    p.step(p.runnable())
    (report,) = _of(sent, ShadowIteration)
    assert (report.iteration, report.rollbacks) == (1, 1)
    assert [m.step for m in _of(sent, Prediction)] == [Step("s", 1, layer) for layer in layers]


@torch.inference_mode()
def test_requests_stepped_in_lockstep_predict_what_each_predicts_alone(model_dirs):
    """A hybrid model's caches are not batched: each request runs its own forward pass, the
    routers in step; each one's choices in the union equal those it makes alone."""
    model = _model(model_dirs, "qwen3_next")
    prompts = {"a": [5, 6, 7], "b": list(range(20, 31))}

    def predictions(requests: list[str]) -> list[Prediction]:
        p, sent = _predictor(model, speculative=True, max_ahead=3)
        for request in requests:
            p.control(BeginRequest(request, prompts[request], 8, "s", 1), [])
        for _ in range(3):
            p.step(p.runnable())
        return _of(sent, Prediction)

    together = predictions(["a", "b"])
    assert all(m.requests == ["a", "b"] for m in together)
    for i, request in enumerate(["a", "b"]):
        alone = predictions([request])
        assert [m.step for m in alone] == [m.step for m in together]
        assert [m.request_experts[0] for m in alone] == [m.request_experts[i] for m in together]


def test_a_steps_prediction_is_the_union_of_its_choices_and_old_steps_are_forgotten():
    choices = StepChoices()
    choices.choose(1, 0, "a", Choice(0, [3, 1], [3, 1, 2], [0.5, 0.3, 0.2], [2]))
    choices.choose(1, 0, "b", Choice(0, [1, 4], [1, 4, 3], [0.6, 0.2, 0.1], [3, 5]))
    m = choices.prediction("s", 1, 0)
    assert m is not None and m.step == Step("s", 1, 0)
    assert m.experts == [3, 1, 4] and m.hedges == [2, 5]  # a hedge another request chose is no hedge
    assert m.candidates == [3, 1, 2] and m.requests == ["a", "b"] and m.request_experts == [[3, 1], [1, 4]]
    choices.drop("a")
    assert choices.prediction("s", 1, 0).requests == ["b"]
    choices.forget_before(2)
    assert choices.prediction("s", 1, 0) is None
