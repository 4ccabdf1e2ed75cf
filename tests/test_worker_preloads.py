"""A worker's preload queue: what main already asked for is never preloaded (again)."""

import pytest
import torch

from odmoe.launch.settings import compose
from odmoe.messages import ComputeExpert, Prediction, Step
from odmoe.nodes.worker import WorkerNode


@pytest.fixture
def worker(model_dirs):
    words = ["role=worker", "worker.index=0", f"model.path={model_dirs['mixtral']}", "security.enabled=false"]
    cfg = compose(words)
    node = WorkerNode(cfg, model_dirs["mixtral"])
    yield node
    node.sock.close(0)


def _compute(worker, layer, expert, iteration=1):
    hidden = torch.randn(1, worker.store.gate_up_shape[1])
    return worker.compute(
        ComputeExpert(step=Step("r", iteration, layer), expert=expert, kernel="eager"), hidden
    )


def test_an_expert_main_asked_for_is_not_preloaded_afterwards(worker):
    # layer 0 belongs to group 0 = workers 0 and 1; of experts [3, 5] worker 0 gets 3
    prediction = Prediction(Step("r", 1, 0), experts=[3, 5], candidates=[3, 5, 1], probs=[0.5, 0.3, 0.2])
    worker.queue_preloads(prediction)
    assert worker.preloads == [(1, 0, 3)]
    assert _compute(worker, 0, 3) is not None  # main got there before the loader: loaded on demand
    assert worker.preloads == []  # the queued preload would load it a second time, for nothing
    worker.queue_preloads(prediction)  # the same prediction, arriving late
    assert worker.preloads == []


def test_asking_for_a_layer_ends_every_earlier_one(worker):
    worker.queue_preloads(Prediction(Step("r", 1, 0), [3, 5], [3, 5, 1], [0.5, 0.3, 0.2]))
    worker.queue_preloads(Prediction(Step("r", 2, 0), [1, 2], [1, 2, 4], [0.5, 0.3, 0.2]))
    _compute(worker, 2, 6)  # main is at iteration 1, layer 2: layer 0 of iteration 1 is over
    assert worker.preloads == [(2, 0, 1)]
    assert worker.done == (1, 1)


@pytest.mark.parametrize("parts", [1, 2])
def test_a_load_that_fails_is_an_error_answer_and_frees_its_slot(worker, monkeypatch, parts):
    """A corrupt stored chunk used to escape the compute (dropped: main waited for its deadline)
    and to keep its slot forever."""

    def corrupt(key, gate_up, down):
        raise ValueError(f"chunk 0 of expert {key} fails its checksum")

    monkeypatch.setattr(worker.store, "load_into", corrupt)
    hidden = torch.randn(1, worker.store.gate_up_shape[1])
    frames = None
    for part in range(parts):
        message = ComputeExpert(step=Step("r", 0, 0), expert=3, kernel="eager", part=part, parts=parts)
        frames = worker.compute(message, hidden)
    from odmoe.messages import from_frames

    result, _ = from_frames(frames)
    assert "checksum" in result.error
    assert worker.slots.free == 2
