"""Stragglers: main's watch (odmoe.main.stragglers, pure) and placement steering away from them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odmoe.launch.settings import compose
from odmoe.main.stragglers import StragglerWatch
from odmoe.placement import Topology
from odmoe.validation import straggler_watch

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

GROUP = [2, 3]  # the second group of a 4-worker cluster, groups of 2


def feed(watch: StragglerWatch, seconds: dict[int, float], rounds: int) -> list[frozenset[int]]:
    """`rounds` decode layers in which each worker of `seconds` answers one expert; `slow` after each."""
    seen = []
    for _ in range(rounds):
        for worker, s in seconds.items():
            watch.observe(worker, s, GROUP)
        seen.append(watch.slow)
    return seen


def test_a_consistently_slow_worker_becomes_a_straggler_after_enough_answers():
    watch = StragglerWatch(factor=3.0, window=8)
    seen = feed(watch, {2: 0.002, 3: 0.020}, 12)
    # judged once its window of 8 answers is full
    assert seen[6] == frozenset() and seen[7] == {3} and seen[-1] == {3}
    assert watch.report()["slow"] == [3] and watch.changes == 1


def test_one_late_answer_or_a_bit_slower_is_no_straggler():
    watch = StragglerWatch(factor=3.0, window=8)
    feed(watch, {2: 0.002, 3: 0.002}, 20)
    for _ in range(3):  # three answers held up by a busy core: a median does not move
        watch.observe(3, 0.5, GROUP)
    feed(watch, {2: 0.002, 3: 0.002}, 20)
    feed(watch, {2: 0.002, 3: 0.005}, 50)  # 2.5x: slower, not a straggler
    assert watch.slow == frozenset() and watch.changes == 0


def test_a_straggler_recovers_after_two_fine_probe_answers():
    watch = StragglerWatch(factor=3.0, window=4, leave_after=2)
    feed(watch, {2: 0.002, 3: 0.020}, 20)
    assert watch.slow == {3}
    assert not watch.observe(3, 0.020, GROUP)  # a probe: still slow
    assert not watch.observe(3, 0.002, GROUP)  # one fine probe answer is not enough
    assert watch.observe(3, 0.0025, GROUP)
    assert watch.slow == frozenset() and list(watch.recent[3]) == [0.002, 0.0025]  # restarted from them


def test_no_peer_no_judgement_and_a_lost_worker_is_forgotten():
    watch = StragglerWatch(factor=3.0, window=2)
    for _ in range(10):
        watch.observe(3, 1.0, [3])  # alone in its group: nothing to compare with
    assert watch.slow == frozenset()
    feed(watch, {2: 0.002, 3: 0.020}, 10)
    assert watch.slow == {3}
    # the only fast peer, itself judged against a straggler: never a straggler (its peers are none)
    feed(watch, {2: 0.5}, 10)
    assert watch.slow == {3}
    assert watch.forget(3) and watch.slow == frozenset() and 3 not in watch.recent


@pytest.mark.parametrize("kwargs", [{"factor": 1.0}, {"window": 0}, {"leave_after": 0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        StragglerWatch(**kwargs)


@settings(max_examples=200, deadline=None)
@given(
    times=st.lists(st.tuples(st.sampled_from(GROUP), st.floats(0.0005, 0.01)), min_size=1, max_size=300),
)
def test_workers_within_the_factor_of_each_other_are_never_stragglers(times):
    """Whatever their order, answers that all lie within 3x of each other are never a straggler's,
    even judged on one answer."""
    watch = StragglerWatch(factor=3.0, window=1)
    for worker, s in times:
        watch.observe(worker, min(s, 0.0014), GROUP)  # every answer in [0.5, 1.4] ms: within 2.8x
    assert watch.slow == frozenset()


@settings(max_examples=200, deadline=None)
@given(
    fast=st.floats(0.001, 0.01),
    ratio=st.floats(5.0, 50.0),  # beyond 3x the widest the noise makes (1.25 / 0.8)
    noise=st.lists(st.floats(0.8, 1.25), min_size=40, max_size=40),
    spikes=st.sets(st.integers(0, 39), max_size=3),
)
def test_a_worker_slower_by_more_than_the_factor_is_caught_and_its_peer_never(fast, ratio, noise, spikes):
    """Noise of +-25 % and a few answers of the fast peer held up 100x change nothing."""
    watch = StragglerWatch(factor=3.0, window=8)
    for i, n in enumerate(noise):
        watch.observe(2, fast * n * (100 if i in spikes else 1), GROUP)
        watch.observe(3, fast * ratio * n, GROUP)
    assert watch.slow == {3}


@pytest.mark.parametrize(
    "word", ["failover.straggler_factor=1", "failover.straggler_after=0", "failover.straggler_probe_every=0"]
)
def test_bad_straggler_keys_fail_with_a_readable_message(word):
    with pytest.raises(ValueError, match=word.split("=")[0]):
        compose([word])


def test_main_watches_for_stragglers_only_with_cacheless_workers_and_steering_on():
    watch = straggler_watch(compose(["worker.cache=0", "failover.straggler_factor=2.5"]))
    assert watch is not None and watch.factor == 2.5 and watch.window == 32
    assert straggler_watch(compose(["worker.cache=0", "failover.steer_stragglers=false"])) is None
    assert straggler_watch(compose(["worker.cache=4"])) is None  # homes never move


# -- placement ---------------------------------------------------------------------------------
def test_decode_placement_deals_a_group_over_its_members_less_the_straggler():
    topo = Topology(workers=4, group_size=2).with_slow([3], probe_every=16)
    assert topo.decode_placement(1, [7, 2], iteration=5) == {2: 2, 7: 2}
    assert topo.decode_placement(0, [7, 2], iteration=5) == {2: 0, 7: 1}  # the other group: as ever
    # a probe: its share again, so its recovery can be seen; the group's layers take turns
    assert topo.decode_placement(1, [7, 2], iteration=16) == {2: 2, 7: 3}
    assert topo.decode_placement(3, [7, 2], iteration=16) == {2: 2, 7: 2}
    assert topo.decode_placement(3, [7, 2], iteration=15) == {2: 2, 7: 3}
    probed = [(i, layer) for i in range(1, 33) for layer in (1, 3, 5, 7) if topo.probe(i, layer)]
    assert probed == [(13, 7), (14, 5), (15, 3), (16, 1), (29, 7), (30, 5), (31, 3), (32, 1)]
    # its group's other member lost: the straggler is all there is, and serves
    assert topo.decode_placement(1, [7, 2], live=[0, 1, 3], iteration=5) == {2: 3, 7: 3}


def test_repair_and_hedges_follow_the_steered_placement():
    topo = Topology(workers=4, group_size=2).with_slow([3], probe_every=16)
    # predicted [2, 5] both preloaded on worker 2; the activated 7 replaces 5 there
    assert topo.repair_placement(1, [2, 5], [2, 7], iteration=3) == {2: 2, 7: 2}
    assert topo.hedge_placement(1, [2, 5], [6], iteration=3) == {6: 2}
    assert topo.replace_lost(1, {4: 2}, live=[0, 1, 3], spread=False, iteration=3) == {4: 3}


def test_homes_never_move_for_a_straggler():
    topo = Topology(workers=4, group_size=2, homes=True).with_slow([3], probe_every=16)
    assert topo.decode_placement(1, [7, 2], iteration=5) == {2: 2, 7: 3}
    assert topo.steered([2, 3], 5) == [2, 3]


@settings(max_examples=300, deadline=None)
@given(
    slow=st.sets(st.integers(0, 3)),
    live=st.sets(st.integers(0, 3), min_size=1),
    layer=st.integers(0, 7),
    experts=st.sets(st.integers(0, 7), min_size=1, max_size=4),
    iteration=st.integers(0, 40),
    predicted=st.lists(st.integers(0, 7), max_size=3, unique=True),
)
def test_every_expert_is_placed_on_a_live_member_of_its_group(
    slow, live, layer, experts, iteration, predicted
):
    """Steering only narrows the serving group: every expert still lands on a live worker of the
    layer's serving group, never on a straggler while that group has another member (probes aside)."""
    topo = Topology(workers=4, group_size=2).with_slow(slow, probe_every=8)
    members = topo.serving_group(layer, live)
    placed = topo.repair_placement(layer, predicted, sorted(experts), live, iteration=iteration)
    assert set(placed) == experts and set(placed.values()) <= set(members)
    fast = [w for w in members if w not in slow]
    if fast and not topo.probe(iteration, layer):
        assert set(placed.values()) <= set(fast)
