"""A worker applying its preload schedule (odmoe.worker.preload_schedule, tested alone in
test_preload_schedule.py) to real slots: what main already asked for is never preloaded (again).
The worker node's `ExpertExecutor` (odmoe.worker.executor) is driven directly, the sockets only where
they matter (main's releasing call)."""

import pytest
import torch

from odmoe.launch.settings import compose
from odmoe.nodes.worker import WorkerNode
from odmoe.transport.messages import ComputeExperts, Prediction, Step

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


@pytest.fixture
def node(model_dirs):
    words = ["role=worker", "worker.index=0", f"model.path={model_dirs['mixtral']}", "security.enabled=false"]
    words.append("worker.cache=0")  # the paper's cacheless worker (a cache keeps what it computed)
    cfg = compose(words)
    node = WorkerNode(cfg, model_dirs["mixtral"])
    yield node
    node.close()


@pytest.fixture
def worker(node):
    return node.executor


def _compute(worker, layer, expert, iteration=1):
    hidden = torch.randn(1, worker.store.gate_up_shape[1])
    return worker.compute(ComputeExperts.single(Step("r", iteration, layer), expert, "eager", 1), [hidden])


def test_an_expert_main_asked_for_is_not_preloaded_afterwards(worker):
    # layer 0 belongs to group 0 = workers 0 and 1; of experts [3, 5] worker 0 gets 3
    prediction = Prediction(Step("r", 1, 0), experts=[3, 5], candidates=[3, 5, 1], probs=[0.5, 0.3, 0.2])
    worker.queue_preloads(prediction)
    assert worker.schedule.preloads == [(1, 0, 3)]
    assert _compute(worker, 0, 3) is not None  # main got there before the loader: loaded on demand
    assert worker.schedule.preloads == []  # the queued preload would load it a second time, for nothing
    worker.queue_preloads(prediction)  # the same prediction, arriving late
    assert worker.schedule.preloads == []


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
        message = ComputeExperts.single(Step("r", 0, 0), 3, "eager", 1, part=part, parts=parts)
        frames = worker.compute(message, [hidden])
    from odmoe.transport.messages import from_frames

    result, _ = from_frames(frames)
    assert "checksum" in result.error
    assert worker.slots.free == 2


def test_a_later_prediction_for_the_same_step_supersedes_the_earlier(worker):
    """A speculative shadow that rolled back republishes a step: only the new experts are wanted."""
    worker.queue_preloads(Prediction(Step("r", 1, 0), [3, 5], [3, 5, 1], [0.5, 0.3, 0.2]))
    worker.preload_next()  # expert 3 loading
    worker.queue_preloads(Prediction(Step("r", 1, 2), [0, 5], [0, 5, 1], [0.5, 0.3, 0.2]))
    assert worker.schedule.preloads == [(1, 2, 0)]
    worker.queue_preloads(Prediction(Step("r", 1, 0), [4, 6], [4, 6, 1], [0.5, 0.3, 0.2]))
    assert worker.schedule.preloads == [(1, 0, 4), (1, 2, 0)]  # 4 replaces 3 ...
    assert all(slot.holds != (0, 3) for slot in worker.slots.held())  # ... which is evicted


def _hedged(worker):
    # layer 0 -> workers 0, 1. Predicted [5, 3] by score: 3 is the k-th, dealt to worker 0, so
    # worker 0 also preloads the hedge 6 - at low priority.
    worker.queue_preloads(Prediction(Step("r", 1, 0), [5, 3], [5, 3, 6], [0.5, 0.26, 0.24], hedges=[6]))
    assert worker.schedule.preloads == [(1, 0, 3)] and worker.schedule.hedge_queue == [(1, 0, 6)]
    worker.preload_next()  # the confident one first
    assert worker.schedule.hedge_queue == [(1, 0, 6)]
    assert worker.schedule.can_preload(worker.slots)
    worker.preload_next()  # then the hedge, into the slot nobody needs
    assert {slot.holds for slot in worker.slots.held()} == {(0, 3), (0, 6)}
    assert worker.schedule.hedge_counts[0] == 1


def test_a_hedge_never_keeps_a_slot_from_a_confident_preload_needed_sooner(worker):
    # worker 0 serves layers 0 and 2 (2 slots). Layer 2's prediction comes first, with a hedge.
    worker.queue_preloads(Prediction(Step("r", 1, 2), [5, 3], [5, 3, 6], [0.5, 0.26, 0.24], hedges=[6]))
    worker.preload_next()
    worker.preload_next()
    assert {slot.holds for slot in worker.slots.held()} == {(2, 3), (2, 6)}
    # then layer 0's (a speculative shadow rolled back, say): needed before the hedge's layer
    worker.queue_preloads(Prediction(Step("r", 1, 0), [1, 7], [1, 7, 2], [0.5, 0.3, 0.2]))
    assert worker.schedule.can_preload(worker.slots)  # no free slot, but the hedge's is taken back
    worker.preload_next()
    assert {slot.holds for slot in worker.slots.held()} == {(2, 3), (0, 1)}
    loads, used, nbytes = worker.schedule.hedge_counts
    assert (loads, used) == (1, 0) and nbytes > 0  # the extra bytes are counted


def test_a_hedged_expert_main_asks_for_is_a_hit(worker):
    _hedged(worker)
    frames = _compute(worker, 0, 6)  # main's router chose the hedge
    from odmoe.transport.messages import from_frames

    result, _ = from_frames(frames)
    assert result.preloaded == [True] and result.bytes_loaded[0] > 0
    assert result.hedges[:2] == [1, 1]  # one hedge loaded, one used


def test_main_s_releasing_call_drops_the_layer_s_unused_preloads_once_answered(node, worker):
    """Main's last call to a worker in a decode layer stands for the Release message it no longer
    sends: what the worker preloaded for that layer and was not asked for goes (over real sockets)."""
    import zmq

    from odmoe.transport.messages import ExpertsResult, from_frames, to_frames

    worker.queue_preloads(Prediction(Step("r", 1, 0), [3, 5], [3, 5, 1], [0.5, 0.3, 0.2]))
    worker.preload_next()  # expert 3 of layer 0 loading for iteration 1
    assert [slot.holds for slot in worker.slots.held()] == [(0, 3)]
    assert node.sock is None and node.address == ""  # built: no socket until it starts
    node.start()
    main = zmq.Context.instance().socket(zmq.DEALER)
    main.setsockopt(zmq.LINGER, 0)
    main.connect(node.address)
    try:
        hidden = torch.randn(1, worker.store.gate_up_shape[1])
        # the router chose 6, not 3 (a misprediction): main's only call to worker 0 in this layer
        call = ComputeExperts.single(Step("r", 1, 0), 6, "eager", 1, release=True)
        main.send_multipart(to_frames(call, [hidden]))
        assert node.sock.poll(5000)
        node._serve_request()
        assert main.poll(5000)
        result, (rows,) = from_frames(main.recv_multipart())
        assert isinstance(result, ExpertsResult) and not result.error and rows.shape == hidden.shape
    finally:
        main.close(0)
    assert worker.slots.held() == []  # the unused preload of expert 3 is gone
    assert worker.schedule.done == (1, 0)


# -- one message per decode layer, every running request's rows (continuous batching) -------------
def _alone(worker, layer, expert, rows, iteration):
    """What the worker answers for these rows as one request's only segment."""
    from odmoe.transport.messages import ComputeExperts, from_frames

    message = ComputeExperts(Step("r", iteration, layer), [expert], [[rows.shape[0]]], "eager")
    result, (y,) = from_frames(worker.compute(message, [rows.clone()]))
    assert not result.error
    return y


def _many(worker, layer, experts, segments, iteration=1):
    from odmoe.transport.messages import ComputeExperts, from_frames

    h = worker.store.gate_up_shape[1]
    rows = [torch.randn(sum(seg), h) for seg in segments]
    message = ComputeExperts(Step("r", iteration, layer), list(experts), segments, "eager")
    result, outputs = from_frames(worker.compute(message, rows))
    return result, rows, outputs


@pytest.mark.parametrize("preload", [False, True])
def test_more_experts_than_slots_in_one_message_each_computed_with_its_own_weights(worker, preload):
    """3 experts on a 2-slot worker, every request's segment apart. A miss loaded in the background
    took the slot the first miss then evicted (a request got another expert's output)."""
    if preload:
        worker.queue_preloads(Prediction(Step("r", 1, 0), [2, 5], [2, 5, 1], [0.5, 0.3, 0.2]))
        worker.preload_next()
    sizes = [[1, 1], [1], [1, 1, 1]]
    result, rows, outputs = _many(worker, 0, [2, 4, 6], sizes)
    assert not result.error and result.experts == [2, 4, 6]
    assert result.preloaded == [preload, False, False]
    assert worker.slots.held() == []
    for n, (expert, x, y) in enumerate(zip([2, 4, 6], rows, outputs, strict=True)):
        # each request's rows as the worker computes them when that request runs alone (a later
        # iteration: the expert is loaded again, on its own)
        parts = torch.split(x, sizes[n])
        want = torch.cat(
            [_alone(worker, 0, expert, part, iteration=2 + n * 4 + i) for i, part in enumerate(parts)]
        )
        assert torch.equal(y, want), f"expert {expert}"


def test_a_segment_computes_as_its_request_alone_not_as_part_of_the_batch(worker):
    x = torch.randn(5, worker.store.gate_up_shape[1])
    _, _, (y,) = _many(worker, 0, [3], [[2, 3]])  # rows are random: only the split is checked here
    result, _, _ = _many(worker, 0, [3], [[2, 2]])  # 4 rows declared, 4 sent: fine
    assert not result.error
    from odmoe.transport.messages import ComputeExperts, from_frames

    bad = ComputeExperts(Step("r", 2, 0), [3], [[2, 2]], "eager")
    result, _ = from_frames(worker.compute(bad, [x]))
    assert "do not add up" in result.error


def test_a_prefill_call_of_another_request_does_not_end_the_decode_stream(worker):
    """Main prefills a new request between the stream's decode layers: the stream's preloads stay."""
    worker.queue_preloads(Prediction(Step("stream", 2, 0), [3, 5], [3, 5, 1], [0.5, 0.3, 0.2]))
    worker.preload_next()
    hidden = torch.randn(4, worker.store.gate_up_shape[1])
    worker.compute(ComputeExperts.single(Step("newcomer", 0, 2), 1, "eager", 4), [hidden])
    assert worker.schedule.request == "stream" and [s.holds for s in worker.slots.held()] == [(0, 3)]


def test_a_worker_whose_group_stores_no_layer_says_so(model_dirs):
    """More groups than MoE layers, each group storing only its own layers: the last group would hold
    nothing (the gpu suite at 1 layer met this as an IndexError deep in the store)."""
    from odmoe.models.checkpoint import Checkpoint

    layers = len(Checkpoint(model_dirs["mixtral"]).moe_layers)
    last = 2 * layers  # worker index of the first worker of group `layers` (groups of 2)
    words = [f"worker.index={last}", f"model.path={model_dirs['mixtral']}", "security.enabled=false"]
    words += [f"cluster.workers={last + 2}", "cluster.group_size=2", "worker.only_own_layers=true"]
    words += ["role=worker", "worker.replicas=1"]
    match = f"worker {last} would hold no experts.*{layers} MoE layer.*{layers + 1} groups"
    with pytest.raises(ValueError, match=match):
        WorkerNode(compose(words), model_dirs["mixtral"])
