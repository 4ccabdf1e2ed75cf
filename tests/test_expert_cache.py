"""The expert cache's pure parts (odmoe/worker/expert_cache.py): capacity, next use, the victim; and a
worker keeping what it computed (real WorkerNode, no sockets driven)."""

from __future__ import annotations

import pytest
import torch

from odmoe.launch.settings import compose
from odmoe.models.expert_math import expert_forward
from odmoe.placement import Topology
from odmoe.transport.messages import ComputeExperts, Prediction, Step, from_frames
from odmoe.worker.expert_cache import CacheBook, cache_capacity, complete, expected_distance, next_use

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

GIB = 1 << 30


@pytest.mark.parametrize(
    "spec,want",
    [("0", 0), (0, 0), ("", 0), ("all", 16), ("3000", 3), ("1KiB", 1), ("100GiB", 16), ("auto", 5)],
)
def test_capacity_in_experts(spec, want):
    # 1000-byte experts, 16 of them this worker's; "auto": the free memory less its 1 GiB margin
    free = lambda: 5 * 1000 + GIB  # noqa: E731
    assert cache_capacity(spec, 1000, 16, free) == want


def test_a_bad_cache_spec_is_refused_by_the_config():
    with pytest.raises(ValueError, match="worker.cache"):
        compose(["worker.cache=lots"])
    with pytest.raises(ValueError, match="cache_policy"):
        compose(["worker.cache_policy=fifo"])


def test_caches_are_complete_only_when_every_live_worker_holds_all_it_is_home_for():
    full, partial, idle = [8, 8, 0, 0, 0, 0, 8, 8], [4, 4, 0, 0, 0, 0, 8, 4], [8, 0, 0, 0, 0, 0, 0, 0]
    assert complete({0: full, 1: full}, [0, 1])
    assert not complete({0: full, 1: partial}, [0, 1])
    assert complete({0: full, 1: partial}, [0])  # worker 1 is gone: its experts are 0's now
    assert not complete({0: full}, [0, 1])  # nothing heard from worker 1 yet
    assert complete({0: full, 1: idle}, [0, 1])  # home for nothing: nothing missing
    assert not complete({0: idle}, [0])  # no cache holds anything
    assert not complete({0: full[:6]}, [0])  # an older worker's report says nothing of homes


def test_next_use_follows_the_predictions():
    done = (3, 1)  # main finished layer 1 of iteration 3
    upcoming = {(2, 5): (3, 2)}
    predicted = {2: 3, 3: 4}  # layer 2 predicted through iteration 3, layer 3 through iteration 4
    assert next_use((2, 5), done, upcoming, predicted) == ((3, 2), True)  # predicted: needed then
    assert next_use((2, 6), done, upcoming, predicted) == ((4, 2), False)  # predicted without it
    assert next_use((3, 0), done, upcoming, predicted) == ((5, 3), False)  # covered through 4
    assert next_use((0, 0), done, upcoming, predicted) == ((4, 0), False)  # nothing known: next visit
    assert next_use((5, 0), done, upcoming, predicted) == ((3, 5), False)
    assert next_use((2, 5), (3, 2), upcoming, predicted) == ((4, 2), False)  # that use is past
    assert next_use((2, 5), done, upcoming, predicted, serves=False)[0][0] > 10**9


def test_expected_distance_counts_the_visits_an_expert_is_expected_to_skip():
    rank = {0: 0, 1: 1, 2: 2, 3: 3}  # 4 MoE layers
    done, upcoming, predicted = (3, 1), {(2, 5): (3, 2)}, {2: 3}
    # predicted for the next layer: 1 layer away, whatever its rate
    assert expected_distance((2, 5), done, upcoming, predicted, rank, 0.01) == 1
    # layer 3's next visit is 2 layers away; used every other visit: one round (4 layers) more
    assert expected_distance((3, 0), done, upcoming, predicted, rank, 0.5) == 2 + 4
    # layer 2's next visit was predicted without it: the visit after (5 layers), used every time
    assert expected_distance((2, 6), done, upcoming, predicted, rank, 1.0) == 5
    assert expected_distance((2, 6), done, upcoming, predicted, rank, 1.0, serves=False) == float("inf")


def test_the_victim_is_the_one_needed_farthest_ahead_and_lru_the_oldest():
    book = CacheBook(3, "prediction")
    for key in [(0, 1), (0, 2), (1, 1)]:
        book.admit(key)
    book.used((0, 1), hit=True, nbytes=10)
    distance = {(0, 1): 9.0, (0, 2): 9.0, (1, 1): 2.0, (1, 2): 3.0}
    # (0, 1) and (0, 2) are both needed farthest ahead; (0, 2) was used longer ago
    assert book.victim(list(distance), distance.__getitem__) == (0, 2)
    distance[(1, 2)] = 20.0  # the newcomer itself may be the one left out
    assert book.victim(list(distance), distance.__getitem__) == (1, 2)
    lru = CacheBook(3, "lru")
    for key in [(0, 1), (0, 2), (1, 1)]:
        lru.admit(key)
        lru.used(key, hit=False)
    lru.used((0, 1), hit=True)
    assert lru.victim([(0, 1), (0, 2), (1, 1)], distance.__getitem__) == (0, 2)  # least recently used
    assert book.hits == 1 and book.bytes_saved == 10
    book.drop((0, 2))
    assert book.report(5, 2) == [3, 2, 1, 0, 10, 1, 5, 2, 0, 1] and book.evictions == {0: 1}


def test_use_rate_is_uses_per_visit_of_the_layer():
    book = CacheBook(2)
    assert book.use_rate((0, 1)) == 0.5  # nothing known
    for _ in range(8):
        book.visit(0)
    for _ in range(2):
        book.used((0, 1), hit=False)
    book.used((0, 2), hit=False, decode=False)  # a prompt's use says nothing of decode
    assert book.use_rate((0, 1)) == 3 / 10 and book.use_rate((0, 2)) == 1 / 10


def test_a_profile_orders_experts_before_any_traffic_and_the_traffic_takes_over():
    book = CacheBook(2, prior={(0, 1): 0.9, (0, 2): 0.1})
    assert book.use_rate((0, 1)) == pytest.approx((1 + 16 * 0.9) / 18)
    assert book.use_rate((0, 1)) > book.use_rate((0, 3)) > book.use_rate((0, 2))  # (0, 3): unprofiled
    for _ in range(200):  # this cluster's traffic: expert 2 every visit, expert 1 never
        book.visit(0)
        book.used((0, 2), hit=False)
    assert book.use_rate((0, 2)) > 0.9 > 0.1 > book.use_rate((0, 1))


def test_use_rates_read_what_odmoe_profile_writes(tmp_path):
    import numpy as np

    from odmoe.lossy.substitution import use_rates
    from odmoe.tools.profiling import ExpertProfile, LayerCounts, save_profile

    counts = LayerCounts.empty(4)
    counts.add(torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]]), torch.ones(4, 2))
    path = save_profile(ExpertProfile({5: counts}, tokens=4), tmp_path / "profile.npz", 0.9, 2)
    assert use_rates(path) == {(5, 0): 1.0, (5, 1): 0.5, (5, 2): 0.25, (5, 3): 0.25}
    assert use_rates(tmp_path / "none.npz") == {}
    assert np.load(path)["activations_5"].tolist() == [4, 2, 1, 1]


def test_a_worker_starts_its_cache_from_the_models_profile_unless_told_off(model_dirs, tmp_path):
    from odmoe.nodes.worker import WorkerNode
    from odmoe.tools.profiling import ExpertProfile, LayerCounts, save_profile

    model = model_dirs["mixtral"]
    counts = LayerCounts.empty(8)
    counts.add(torch.tensor([[0, 1]]), torch.ones(1, 2))
    profile = save_profile(ExpertProfile({0: counts}, tokens=1), tmp_path / "p.npz", 0.9, 2)
    words = ["role=worker", "worker.index=0", f"model.path={model}", "security.enabled=false"]
    words.append("worker.cache=all")
    for setting, want in ((str(profile), {(0, 1): 1.0, (0, 5): 0.0}), ("off", {})):
        node = WorkerNode(compose([*words, f"worker.cache_profile={setting}"]), model)
        try:
            prior = node.executor.cache.prior
            assert {k: prior[k] for k in want} == want and bool(prior) == bool(want)
        finally:
            node.close()


def test_homes_send_every_expert_of_a_layer_to_one_worker_each():
    topo = Topology(4, 2, homes=True)
    # layer 0 -> group 0 (workers 0, 1): even experts at 0, odd at 1, predicted, hedged or missed
    assert topo.decode_placement(0, [3, 4, 6]) == {3: 1, 4: 0, 6: 0}
    assert topo.hedge_placement(0, [3, 4], [5, 6]) == {5: 1, 6: 0}
    assert topo.repair_placement(0, [3, 4], [4, 7], hedges=[6]) == {4: 0, 7: 1}
    assert topo.home(1, 3) == 3 and topo.home(1, 3, live=[0, 1, 2]) == 2  # a lost worker's go to the rest
    homes = {topo.home(0, e) for e in range(8)}
    assert homes == {0, 1}


@pytest.fixture
def worker(model_dirs):
    from odmoe.nodes.worker import WorkerNode

    path = model_dirs["mixtral"]
    words = ["role=worker", "worker.index=0", f"model.path={path}", "security.enabled=false"]
    node = WorkerNode(compose([*words, "worker.cache=all"]), path)  # 2 workers: 16 experts are its
    yield node.executor
    node.close()


def _answer(frames):
    result, tensors = from_frames(frames)
    assert not result.error, result.error
    return result, tensors


def test_a_worker_keeps_what_it_computed_and_answers_the_same_from_its_cache(worker):
    # its room: every expert it stores (32); at start it read the 16 it is home for into the cache (a
    # CPU worker's cache is where its share rests), beside its free just-in-time slots
    assert worker.cache.capacity == 32 and len(worker.slots.cached()) == worker.slots.busy == 16
    assert {s.holds for s in worker.slots.cached()} == {
        (layer, e) for layer in range(4) for e in (0, 2, 4, 6)
    }
    assert len(worker.slots._slots) == worker.slots.jit_slots + 16
    hidden = torch.randn(3, worker.store.gate_up_shape[1])
    first, (y1,) = _answer(worker.compute(ComputeExperts.single(Step("a", 1, 0), 2, "eager", 3), [hidden]))
    assert first.bytes_loaded == [0] and first.cached[0] > 0  # no load: from the cache
    # an expert this worker is not home for (odd ones are worker 1's) is read, computed, not kept
    other, (y3,) = _answer(worker.compute(ComputeExperts.single(Step("b", 5, 1), 3, "eager", 3), [hidden]))
    assert other.bytes_loaded == first.cached and other.cached == [0]
    assert (1, 3) not in {s.holds for s in worker.slots.cached()} and len(worker.slots.cached()) == 16
    assert other.cache[:4] == [16, 16, 1, 1]  # what it can keep of its homes, cached, hits, misses
    assert other.cache[6:] == [16, 16]  # home for 16 experts, all of them cached
    # the same bits as the expert computed alone from the checkpoint
    again, (y2,) = _answer(worker.compute(ComputeExperts.single(Step("c", 6, 0), 2, "eager", 3), [hidden]))
    assert torch.equal(y1, y2)
    w = worker.store[(0, 2)]
    want = expert_forward(hidden, w.gate_up, w.down, worker.mlp, "eager")
    assert torch.equal(y1, want)


def test_a_full_cache_drops_the_expert_predicted_farthest_and_never_one_a_message_computes(model_dirs):
    from odmoe.nodes.worker import WorkerNode

    path = model_dirs["mixtral"]
    words = ["role=worker", "worker.index=0", f"model.path={path}", "security.enabled=false"]
    node = WorkerNode(compose(words), path)  # cacheless: only to learn an expert's size
    node.close()
    store = node.executor.store
    size = (store.gate_up_shape.numel() + store.down_shape.numel()) * store.dtype.itemsize
    node = WorkerNode(compose([*words, f"worker.cache={2 * size}"]), path)
    worker = node.executor
    try:
        assert worker.cache.capacity == 2
        rows = torch.randn(1, worker.store.gate_up_shape[1])
        for layer, expert in [(0, 0), (0, 2)]:
            _answer(worker.compute(ComputeExperts.single(Step("s", 1, layer), expert, "eager", 1), [rows]))
        # the shadow says layer 0's next visit needs expert 0, and layer 1 comes first
        worker.queue_preloads(Prediction(Step("s", 2, 0), [0, 1], [0, 1, 2], [0.5, 0.3, 0.2]))
        _answer(worker.compute(ComputeExperts.single(Step("s", 1, 1), 4, "eager", 1), [rows]))
        assert {s.holds for s in worker.slots.cached()} == {(0, 0), (1, 4)}  # (0, 2): predicted unused
        # a message computing both cached experts and a new one: neither cached one is dropped before use
        many = ComputeExperts(Step("s", 2, 0), [0, 6], [[1], [1]], "eager")
        result, _ = _answer(worker.compute(many, [rows, rows]))
        assert result.cached[0] > 0 and result.cached[1] == 0
    finally:
        node.close()


def test_cache_buffers_are_allocated_as_kept_experts_need_them(model_dirs):
    """A room beyond the buffers allocated at start (homes by room may give a worker more experts
    than an even deal): keeping one more expert adds a buffer, so the just-in-time slots stay free."""
    from odmoe.models.checkpoint import Checkpoint
    from odmoe.worker.expert_store import DeviceSlots, ExpertStore

    ckpt = Checkpoint(model_dirs["mixtral"])
    store = ExpertStore.build(ckpt, ckpt.moe_layers, torch.float32)
    slots = DeviceSlots(store, torch.device("cpu"), slots=2, cache=3, allocate=1)
    assert len(slots._slots) == 3
    for key in list(store.keys())[:3]:
        slots.keep(slots.load(key))
        assert slots.free == 2  # the slots' two, whatever the cache holds
    assert len(slots._slots) == 5 and len(slots.cached()) == 3 and not slots.free_for_cache
    assert torch.equal(slots.cached()[2].down, store[list(store.keys())[2]].down)
