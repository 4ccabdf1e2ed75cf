"""Stragglers: main's watch (odmoe.main.stragglers, pure) and placement steering away from them."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odmoe.launch.settings import compose
from odmoe.main.stragglers import StragglerWatch, home_move, lost_hits, straggler_room
from odmoe.placement import Topology, home_counts, moved_homes
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
    "word",
    [
        "failover.straggler_factor=1",
        "failover.straggler_after=0",
        "failover.straggler_probe_every=0",
        "failover.straggler_move_horizon=-1",
    ],
)
def test_bad_straggler_keys_fail_with_a_readable_message(word):
    with pytest.raises(ValueError, match=word.split("=")[0]):
        compose([word])


def test_main_watches_for_stragglers_with_steering_on_and_homes_that_may_move():
    watch = straggler_watch(compose(["worker.cache=0", "failover.straggler_factor=2.5"]))
    assert watch is not None and watch.factor == 2.5 and watch.window == 32
    assert straggler_watch(compose(["worker.cache=0", "failover.steer_stragglers=false"])) is None
    assert straggler_watch(compose(["worker.cache=4"])) is not None  # homes move when it pays
    assert straggler_watch(compose(["worker.cache=4", "failover.straggler_move_horizon=0"])) is None


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


def test_homes_without_the_models_shape_stay_where_they_are():
    topo = Topology(workers=4, group_size=2, homes=True).with_slow([3], probe_every=16)
    assert topo.decode_placement(1, [7, 2], iteration=5) == {2: 2, 7: 3}
    assert topo.steered([2, 3], 5) == [2, 3]


def homes_count(topo: Topology, live=None) -> Counter:
    return Counter(topo.home(layer, e, live) for layer in range(8) for e in range(8))


CACHED = Topology(workers=4, group_size=2, homes=True).for_model(list(range(8)), 8).with_rooms([8] * 4)


def test_a_stragglers_homes_move_to_its_peer_and_come_back_on_probes():
    """8 layers of 8 experts, group 1 serves 32 (16 homes each): worker3 a straggler dealt room 0
    is home for none, worker2 for all 32; with room 5, for 5. Group 0 is untouched, and a probe
    iteration places by the unsteered homes (so the straggler's recovery can be seen)."""
    assert homes_count(CACHED) == {0: 16, 1: 16, 2: 16, 3: 16}
    moved = CACHED.with_slow([3], 16, [0])
    assert homes_count(moved) == {0: 16, 1: 16, 2: 32}
    assert homes_count(CACHED.with_slow([3], 16, [5])) == {0: 16, 1: 16, 2: 27, 3: 5}
    assert homes_count(CACHED.with_slow([3], 16, [100])) == homes_count(CACHED)  # never more than before
    assert set(moved.decode_placement(1, list(range(8)), iteration=3).values()) == {2}
    assert moved.decode_placement(1, list(range(8)), iteration=16) == CACHED.decode_placement(
        1, list(range(8)), iteration=16
    )
    assert moved.repair_placement(1, [0, 1], [0, 1], iteration=16) == CACHED.decode_placement(1, [0, 1])
    assert moved_homes(CACHED, moved) == 16 and moved_homes(CACHED, CACHED) == 0
    # every member of its group a straggler (or the peer lost): homes as without stragglers
    assert homes_count(CACHED.with_slow([2, 3], 16, [0, 0])) == homes_count(CACHED)
    assert homes_count(moved, live=[0, 1, 3]) == {0: 16, 1: 16, 3: 32}


@settings(max_examples=200, deadline=None)
@given(
    rooms=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    slow=st.sets(st.integers(0, 3)),
    kept=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    live=st.sets(st.integers(0, 3), min_size=1),
)
def test_a_straggler_is_never_home_for_more_and_every_expert_has_a_live_home(rooms, slow, kept, live):
    before = CACHED.with_rooms(rooms)
    after = before.with_slow(slow, 16, kept[: len(slow)])
    was, now = homes_count(before, live), homes_count(after, live)
    assert sum(now.values()) == 64 and set(now) <= live
    for w in live:
        peers = [p for p in live if p // 2 == w // 2]
        if w in slow and any(p not in slow for p in peers):
            assert now[w] <= max(was[w], 0) and now[w] <= kept[sorted(slow).index(w)] + 1
        elif w not in slow and any(p in slow for p in peers):
            assert now[w] >= was[w]  # its peers take the straggler's experts
        else:
            assert now[w] == was[w]


def test_a_move_is_made_only_when_its_saving_over_the_horizon_exceeds_its_reloads():
    # 15 reloads at 2 ms = 30 ms; 40 ms a token saved: worth it over 256 tokens, not over 0
    move = home_move(3, moved=15, reference_s=0.002, extra_s_per_token=0.04, horizon=256, room=0)
    assert move.worth and move.move_s == pytest.approx(0.03) and move.saving_s == pytest.approx(10.24)
    assert not home_move(3, 15, 0.002, 0.04, horizon=0, room=0).worth
    assert not home_move(3, 15, 0.002, 0.0001, horizon=100, room=0).worth  # 10 ms saved < 30 ms
    assert not home_move(3, 0, 0.002, 0.04, 256, 0).worth  # nothing would move
    # its hits that become loads at a peer with no room for them: 30 of its 40 ms a token saved
    assert home_move(3, 15, 0.002, 0.04, 256, 0, added_s_per_token=0.03).saving_s == pytest.approx(2.56)
    assert not home_move(3, 15, 0.002, 0.04, 256, 0, added_s_per_token=0.04).worth  # nothing saved
    assert move.report(True) == {
        "worker": 3,
        "reloads": 15,
        "move_s": 0.03,
        "extra_s_per_token": 0.04,
        "added_s_per_token": 0.0,
        "saving_s": 10.24,
        "horizon": 256,
        "room": 0,
        "moved": True,
    }


@given(
    moved=st.integers(0, 1000),
    reference=st.floats(1e-5, 1.0),
    extra=st.floats(0, 1.0),
    horizon=st.integers(0, 10_000),
)
def test_a_longer_horizon_or_a_costlier_straggler_never_turns_a_move_down(moved, reference, extra, horizon):
    move = home_move(0, moved, reference, extra, horizon, 0)
    assert move.worth == (moved > 0 and extra * horizon > moved * reference)
    if move.worth:
        assert home_move(0, moved, reference, extra, horizon + 1, 0).worth
        assert home_move(0, moved, reference, extra * 2, horizon, 0).worth


def test_the_hits_a_move_loses_are_the_cached_experts_that_leave_and_find_no_room():
    assert lost_hits(cached=8, room_after=0, peers_spare=0) == 1.0  # every hit a load at the peer
    assert lost_hits(cached=8, room_after=2, peers_spare=0) == 0.75  # it keeps 2 of its 8
    assert lost_hits(cached=8, room_after=0, peers_spare=6) == 0.25  # the peer keeps 6 of them
    assert lost_hits(cached=8, room_after=0, peers_spare=20) == 0.0
    assert lost_hits(cached=0, room_after=0, peers_spare=0) == 0.0  # it keeps nothing: nothing lost
    assert home_counts(CACHED) == {0: 16, 1: 16, 2: 16, 3: 16}


@given(cached=st.integers(0, 64), room_after=st.integers(0, 64), spare=st.integers(-8, 64))
def test_lost_hits_is_a_share_that_more_room_never_raises(cached, room_after, spare):
    share = lost_hits(cached, room_after, spare)
    assert 0.0 <= share <= 1.0
    assert lost_hits(cached, room_after + 1, spare) <= share
    assert lost_hits(cached, room_after, spare + 1) <= share


def test_a_straggler_keeps_its_room_times_its_speed():
    assert straggler_room(8, time=0.022, reference=0.0022) == 0  # 10x slower: 0.8 of an expert
    assert straggler_room(16, time=0.004, reference=0.001) == 4
    assert straggler_room(8, time=0.001, reference=0.002) == 8  # never more than its room
    assert straggler_room(8, time=0.0, reference=0.002) == 8


def test_a_stragglers_extra_seconds_a_token_are_its_excess_times_its_answers_a_token():
    watch = StragglerWatch(factor=3.0, window=8)
    for it in range(1, 9):  # worker3 loads twice an iteration at 22 ms, worker2 once at 2 ms
        watch.observe(2, 0.002, GROUP, at=it)
        watch.observe(3, 0.022, GROUP, at=it)
        watch.observe(3, 0.022, GROUP, at=it)
    assert watch.slow == {3}
    assert watch.per_token(3) == pytest.approx(8 / 4)  # its last 8 answers over iterations 5..8
    assert watch.extra_per_token(3, GROUP) == pytest.approx(0.040)
    assert watch.extra_per_token(2, GROUP) == 0.0  # its reference, worker3, is a straggler: none
    for it in (9, 11):
        watch.hit(3, at=it)
    assert watch.hits_per_token(3) == pytest.approx(2 / 3) and watch.hits_per_token(2) == 0.0


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
