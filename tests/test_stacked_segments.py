"""A worker's stacked call for several requests' rows of one expert gives each request's rows the
bits of its own call (odmoe.worker.stacked_segments), and falls back where it would not."""

import pytest
import torch

from odmoe.models.expert_math import ExpertMLP, expert_forward
from odmoe.worker import stacked_segments
from odmoe.worker.stacked_segments import StackedSegments

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

STANDARD = ExpertMLP("silu")


def _weights(hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    down = (torch.randn(hidden, inter, generator=g) * inter**-0.5).to(dtype)
    return gate_up, down


def _alone(x, segments, gate_up, down, mlp, kernel):
    """What each request's own ComputeExperts call computes: its rows in a fresh tensor, one call each."""
    parts = torch.split(x, segments)
    return torch.cat([expert_forward(p.clone(), gate_up, down, mlp, kernel) for p in parts])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kernel,segments",
    [
        ("grouped_mm", [1, 1]),
        ("grouped_mm", [1, 1, 1, 1, 1, 1, 1, 1]),
        ("grouped_mm", [3, 1, 2]),
        ("eager", [1, 1, 1]),
        ("eager", [1] * 8),
    ],
)
@pytest.mark.parametrize(
    "hidden,inter", [(256, 512), (48, 40), (40, 24)]
)  # 16-byte bf16 rows, as grouped_mm needs
def test_each_segment_gets_its_own_calls_bits(dtype, kernel, segments, hidden, inter):
    gate_up, down = _weights(hidden, inter, dtype)
    stacked = StackedSegments()
    for seed in range(4):  # the verdict's input, then inputs that only the verdict's shape decides
        x = torch.randn(sum(segments), hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
        y = stacked.forward(x, segments, gate_up, down, STANDARD, kernel)
        assert torch.equal(y, _alone(x, segments, gate_up, down, STANDARD, kernel))


def test_the_trained_models_decode_shapes_are_stacked():
    """What it is for: the benchmark model's expert (256 -> 512, fp32, grouped_mm) with one row per
    request is computed in one call on this CPU (if this fails, the speed is gone, not the bits)."""
    gate_up, down = _weights(256, 512, torch.float32)
    stacked = StackedSegments()
    for rows in (2, 4, 8):
        stacked.forward(torch.randn(rows, 256), [1] * rows, gate_up, down, STANDARD, "grouped_mm")
    assert stacked.verdicts and all(stacked.verdicts.values())


def test_a_stacked_call_that_differs_is_not_used(monkeypatch):
    """A build whose one call computes other bits (faked: one ulp off) costs speed, never bits."""
    real = stacked_segments._stacked_call

    def off_by_an_ulp(*args):
        call = real(*args)
        return lambda x, g, d: torch.nextafter(call(x, g, d), torch.tensor(float("inf")))

    monkeypatch.setattr(stacked_segments, "_stacked_call", off_by_an_ulp)
    gate_up, down = _weights(64, 32, torch.float32)
    stacked = StackedSegments()
    for _ in range(3):
        x = torch.randn(3, 64)
        y = stacked.forward(x, [1, 1, 1], gate_up, down, STANDARD, "grouped_mm")
        assert torch.equal(y, _alone(x, [1, 1, 1], gate_up, down, STANDARD, "grouped_mm"))
    assert list(stacked.verdicts.values()) == [False]


def test_a_first_input_that_happens_to_agree_proves_nothing(monkeypatch):
    """The verdict is taken on random inputs of the shape too: a stacked call right on the first
    input only (faked) is never used."""
    real = stacked_segments._stacked_call
    seen = []

    def right_once(*args):
        call = real(*args)

        def maybe(x, g, d):
            seen.append(1)
            y = call(x, g, d)
            return y if len(seen) == 1 else y + 1

        return maybe

    monkeypatch.setattr(stacked_segments, "_stacked_call", right_once)
    gate_up, down = _weights(64, 32, torch.float32)
    stacked = StackedSegments()
    x = torch.randn(2, 64)
    assert torch.equal(
        stacked.forward(x, [1, 1], gate_up, down, STANDARD, "grouped_mm"),
        _alone(x, [1, 1], gate_up, down, STANDARD, "grouped_mm"),
    )
    assert list(stacked.verdicts.values()) == [False]


def test_layouts_without_a_stacked_call_go_apart():
    gpt_oss = ExpertMLP("silu", "gpt_oss")
    assert stacked_segments._stacked_call([1, 1], gpt_oss, "grouped_mm", torch.device("cpu"), None) is None
    assert stacked_segments._stacked_call([2, 1], STANDARD, "eager", torch.device("cpu"), None) is None
    assert stacked_segments._stacked_call([1, 1], STANDARD, "bmm", torch.device("cpu"), None) is None
