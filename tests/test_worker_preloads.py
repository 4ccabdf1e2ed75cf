"""A worker's preload queue: what main already asked for is never preloaded (again)."""

import pytest
import torch

from odmoe.launch.settings import compose
from odmoe.messages import ComputeExpert, Prediction, Step
from odmoe.nodes.worker import WorkerNode


@pytest.fixture
def worker(model_dirs):
    cfg = compose(["role=worker", "worker.index=0", f"model.path={model_dirs['mixtral']}"])
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
