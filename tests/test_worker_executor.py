"""The worker's expert work without its sockets (odmoe/worker/executor.py), driven with real messages
through the codec as a worker node receives them: every answer equals the expert computed alone by
`expert_math.expert_forward` on the checkpoint's own weights, to the bit, whether it is one call, a
prefill's mini-batches, one decode layer's experts for several requests, or a preloaded expert."""

from __future__ import annotations

import pytest
import torch

from odmoe.models.checkpoint import Checkpoint
from odmoe.models.expert_math import expert_forward, expert_mlp
from odmoe.placement import Topology
from odmoe.tools.trace import Tracer
from odmoe.transport.codec import CodecError
from odmoe.transport.messages import (
    ComputeExperts,
    ExpertsResult,
    Ping,
    Prediction,
    Step,
    from_frames,
    to_frames,
)
from odmoe.worker.executor import ExpertExecutor, SlotKeeper
from odmoe.worker.expert_cache import CacheBook
from odmoe.worker.expert_store import DeviceSlots, ExpertStore
from tests.conftest import FAMILY_NAMES
from tests.test_import_rooms import ROOT, _module_name, imported, module_edges, reachable

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def _executor(path: str, index: int = 0, workers: int = 2) -> tuple[ExpertExecutor, Checkpoint]:
    """A cacheless worker `index` of `workers` (one group) storing every MoE layer, 2 CPU slots."""
    ckpt = Checkpoint(path)
    store = ExpertStore.build(ckpt, ckpt.moe_layers, torch.float32)
    topology = Topology(workers, workers).for_model(ckpt.moe_layers)
    layer_rank = {layer: i for i, layer in enumerate(ckpt.moe_layers)}
    slots = DeviceSlots(store, torch.device("cpu"), slots=2)
    keeper = SlotKeeper(index, topology, store, slots, CacheBook(0), layer_rank, Tracer("worker0"))
    return ExpertExecutor(keeper, expert_mlp(ckpt.config, ckpt.family.expert_layout)), ckpt


def _reference(executor: ExpertExecutor, ckpt: Checkpoint, layer: int, expert: int, x: torch.Tensor):
    w = ckpt.expert(layer, expert)
    return expert_forward(x, w.gate_up, w.down, executor.mlp, "eager")


def _send(executor: ExpertExecutor, message, tensors: list[torch.Tensor]):
    """The message through the codec both ways, as a worker node receives and main reads it."""
    decoded, rows = from_frames([bytes(f) for f in to_frames(message, tensors)])
    answer = executor.answer(decoded, rows)
    return None if answer is None else from_frames([bytes(f) for f in answer])


@pytest.fixture
def mixtral(model_dirs):
    return _executor(model_dirs["mixtral"])


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_one_call_equals_the_expert_alone(model_dirs, family):
    executor, ckpt = _executor(model_dirs[family])
    torch.manual_seed(0)
    for n, layer in enumerate(ckpt.moe_layers):
        expert = n % ckpt.num_experts
        x = torch.randn(3, executor.hidden_size)
        result, (y,) = _send(executor, ComputeExperts.single(Step("r", 1, layer), expert, "eager", 3), [x])
        assert isinstance(result, ExpertsResult) and not result.error, result.error
        assert (result.worker, result.experts, result.preloaded) == (0, [expert], [False])
        assert result.bytes_loaded[0] > 0  # cacheless: loaded on demand
        assert torch.equal(y, _reference(executor, ckpt, layer, expert, x)), (layer, expert)
    assert executor.slots.held() == []  # evicted after use


@pytest.mark.parametrize("per_part", [False, True])
def test_prefill_mini_batches_answer_once_all_are_in_or_each(mixtral, per_part):
    executor, ckpt = mixtral
    layer, expert, parts = ckpt.moe_layers[1], 5, [torch.randn(n, executor.hidden_size) for n in (2, 3, 1)]
    answers = []
    for i, x in enumerate(parts):
        message = ComputeExperts.single(
            Step("p", 0, layer), expert, "eager", x.shape[0], part=i, parts=3, per_part=per_part
        )
        answers.append(_send(executor, message, [x]))
    if per_part:  # each part its own answer, computed on its own rows
        for i, (x, (result, (y,))) in enumerate(zip(parts, answers, strict=True)):
            assert result.part == i and torch.equal(y, _reference(executor, ckpt, layer, expert, x))
    else:  # one answer for the whole batch: its rows depend on how many rows the matmul sees
        assert answers[:2] == [None, None]
        result, (y,) = answers[2]
        assert not result.error and result.part == 0
        assert torch.equal(y, _reference(executor, ckpt, layer, expert, torch.cat(parts)))
    assert executor.slots.held() == [] and not executor.batches


def test_a_decode_layer_s_experts_each_request_s_segment_as_alone(mixtral):
    """3 experts on 2 slots, every request's segment computed as that request alone computes it."""
    executor, ckpt = mixtral
    layer, experts, segments = ckpt.moe_layers[2], [6, 1, 3], [[1, 2], [1], [1, 1, 1]]
    rows = [torch.randn(sum(s), executor.hidden_size) for s in segments]
    result, outputs = _send(executor, ComputeExperts(Step("s", 4, layer), experts, segments, "eager"), rows)
    assert isinstance(result, ExpertsResult) and not result.error, result.error
    assert result.experts == experts and result.preloaded == [False] * 3
    for expert, seg, x, y in zip(experts, segments, rows, outputs, strict=True):
        want = torch.cat([_reference(executor, ckpt, layer, expert, part) for part in torch.split(x, seg)])
        assert torch.equal(y, want), expert
    assert executor.slots.held() == []


def test_a_preloaded_expert_is_a_hit_with_the_same_bits(mixtral):
    executor, ckpt = mixtral
    layer = ckpt.moe_layers[0]
    # one group of 2 workers: of the predicted [3, 4], worker 0 preloads its share
    executor.queue_preloads(Prediction(Step("r", 1, layer), [3, 4], [3, 4, 1], [0.5, 0.3, 0.2]))
    assert executor.can_preload()
    executor.preload_next()
    (held,) = [slot.holds for slot in executor.slots.held()]
    expert = held[1]
    x = torch.randn(1, executor.hidden_size)
    message = ComputeExperts(Step("r", 1, layer), [expert], [[1]], "eager", release=True)
    result, (y,) = _send(executor, message, [x])
    assert result.preloaded == [True] and torch.equal(y, _reference(executor, ckpt, layer, expert, x))
    executor.release(message.step)
    assert executor.slots.held() == [] and not executor.can_preload()


def test_a_request_that_does_not_fit_is_an_error_answer_and_a_foreign_kind_is_refused(mixtral):
    executor, ckpt = mixtral
    layer, h = ckpt.moe_layers[0], executor.hidden_size
    wrong = [
        (
            ComputeExperts.single(Step("r", 1, layer), 0, "nope", 1),
            torch.randn(1, h),
            "unknown experts kernel",
        ),
        (ComputeExperts.single(Step("r", 1, layer), 0, "eager", 1), torch.randn(1, h + 1), "rows of shape"),
        (
            ComputeExperts.single(Step("r", 1, layer), 0, "eager", 1),
            torch.randn(1, h).double(),
            "rows of torch.float64",
        ),
        (
            ComputeExperts.single(Step("r", 1, 99), 0, "eager", 1),
            torch.randn(1, h),
            "not in this worker's store",
        ),
    ]
    for message, x, problem in wrong:
        result, _ = _send(executor, message, [x])
        assert problem in result.error
    # mini-batches are one expert's
    parts = ComputeExperts(Step("r", 0, layer), [0, 1], [[1], [1]], "eager", parts=2)
    result, _ = _send(executor, parts, [torch.randn(1, h), torch.randn(1, h)])
    assert "part 0 of 2 for 2 experts" in result.error
    many = ComputeExperts(Step("r", 1, layer), [0], [[2]], "eager")
    result, outputs = _send(executor, many, [torch.randn(3, h)])
    assert "do not add up" in result.error and outputs == []
    assert executor.slots.held() == []
    with pytest.raises(CodecError, match="cannot handle ping"):
        executor.answer(Ping(), [])


def test_the_executor_reaches_no_socket():
    """Neither the executor nor any of our modules it imports imports zmq: the socket loop is the node's."""
    files = {_module_name(path): path for path in (ROOT / "odmoe").rglob("*.py")}
    here = "odmoe.worker.executor"
    for module in {here, *reachable(module_edges(), here)}:
        assert not [name for name in imported(files[module]) if name.split(".")[0] == "zmq"], module
