"""Pure parts of issue 13: the speculative shadow's rollback bookkeeping, the alignment period
tuner, the hedging decision and where hedges are placed."""

import pytest

from odmoe.config import AlignmentConfig
from odmoe.main.alignment import AlignmentPlan, AlignmentSchedule, PeriodTuner, make_plan
from odmoe.placement import Topology
from odmoe.shadow.hedging import hedges_of
from odmoe.shadow.speculation import Speculation

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


# -- speculation --------------------------------------------------------------------------------
def test_a_matching_token_changes_nothing_and_a_different_one_rolls_back_to_its_iteration():
    spec = Speculation(prompt_len=5, max_ahead=3)
    for token in (11, 12, 13):  # the shadow runs iterations 1..3 from its own tokens
        spec.ran(token)
    assert spec.next_iteration == 4
    assert spec.on_main(1, 11) is None  # main fed the same token: the speculation held
    assert spec.on_main(2, 99) == 2  # main fed another: roll back to iteration 2
    assert spec.keep_length(2) == 6  # prompt (5) + iteration 1's input: iteration 2's input goes
    spec.roll_back(2)
    assert spec.next_iteration == 2 and spec.fed == {1: 11}
    assert spec.token_for(own_token=12) == 99  # it goes on from main's token
    assert spec.rollbacks == 1 and spec.rolled_back_iterations == 2


def test_a_token_for_an_iteration_not_run_yet_is_used_when_it_comes():
    spec = Speculation(prompt_len=3)
    assert spec.on_main(1, 7) is None
    assert spec.token_for(own_token=8) == 7
    spec.ran(7)
    assert spec.token_for(own_token=8) == 8
    assert spec.on_main(2, -1) is None  # no token this iteration (token_period > 1): only progress
    assert spec.main_latest == 2


def test_kv_rows_land_on_their_own_positions():
    spec = Speculation(prompt_len=4)
    assert spec.rows_span(1, 4) == (0, 4)  # iteration 1 brings the prompt's rows
    assert spec.rows_span(3, 1) == (5, 6)  # iteration 3 brings the row of iteration 2's input


def test_the_shadow_stays_a_bounded_number_of_iterations_ahead():
    spec = Speculation(prompt_len=2, max_ahead=2)
    assert spec.may_run()  # iterations 1 and 2 before main reports anything
    spec.ran(1)
    assert spec.may_run()
    spec.ran(2)
    assert not spec.may_run() and spec.ahead == 3
    spec.on_main(1, 1)
    assert spec.may_run()
    with pytest.raises(ValueError):
        Speculation(prompt_len=2, max_ahead=0)


# -- alignment plans ----------------------------------------------------------------------------
@pytest.mark.parametrize("periods", [(2, 3), (1, 0), (0, 4), (0, 0), (3, 3)])
def test_the_static_plan_announces_exactly_the_iterations_it_aligns(periods):
    plan = AlignmentPlan(AlignmentSchedule(*periods))
    aligned = [n for n in range(1, 40) if any(plan.aligns(n))]
    announced, n = [], plan.next_after(0)
    while n and n < 40:
        announced.append(n)
        n = plan.next_after(n)
    assert announced == aligned


def test_prefill_kv_makes_iteration_1_aligned():
    plan = AlignmentPlan(AlignmentSchedule(4, 0, prefill_kv=True))
    assert plan.next_after(0) == 1 and plan.aligns(1) == (False, True)


def _drive(tuner, wrong_at, iterations=60):
    """Run a tuner as main does; wrong_at(n) -> wrong predictions (of 8) at iteration n."""
    aligned = []
    for n in range(1, iterations):
        tuner.observe(n - 1, wrong_at(n - 1), 8)
        token, kv = tuner.aligns(n)
        if token or kv:
            aligned.append(n)
            tuner.sent(n, token, kv)
    return aligned


def test_the_tuner_widens_while_predictions_hold_and_stays_within_bounds():
    tuner = PeriodTuner(token_period=1, kv_period=1, max_period=5, grow_after=1)
    aligned = _drive(tuner, lambda n: 0)
    gaps = [b - a for a, b in zip(aligned, aligned[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] == 5 and max(gaps) == 5
    assert tuner.report()["token_period"] == 5 and len(tuner.report()["changes"]) > 1


def test_the_tuner_halves_after_misses():
    tuner = PeriodTuner(token_period=8, kv_period=4, min_period=2, tolerance=0.1)
    _drive(tuner, lambda n: 4, iterations=30)  # half the predictions wrong, all the time
    assert (tuner.token_period, tuner.kv_period) == (2, 2)


def test_halving_a_period_of_one_keeps_it_on():
    """1 // 2 is 0, which means "off": a tuner that halved to it stopped aligning for good."""
    tuner = PeriodTuner(token_period=1, kv_period=2, tolerance=0.1)
    _drive(tuner, lambda n: 4, iterations=20)
    assert (tuner.token_period, tuner.kv_period) == (1, 1)


def test_the_tuner_announces_where_it_will_align():
    """A waiting shadow waits at the announced iteration: main must align exactly there."""
    tuner = PeriodTuner(token_period=2, kv_period=3, grow_after=1)
    announced = tuner.next_after(0)
    for n in range(1, 80):
        tuner.observe(n - 1, 3 if 20 < n < 30 else 0, 8)
        token, kv = tuner.aligns(n)
        assert (token or kv) == (n == announced)
        if token or kv:
            tuner.sent(n, token, kv)
            announced = tuner.next_after(n)


def test_a_disabled_period_stays_disabled_when_tuned():
    tuner = PeriodTuner(token_period=1, kv_period=0, grow_after=1)
    _drive(tuner, lambda n: 0)
    assert tuner.kv_period == 0 and tuner.next_kv == 0


def test_make_plan_checks_its_config():
    assert isinstance(make_plan(AlignmentConfig(tune=True)), PeriodTuner)
    with pytest.raises(ValueError, match="mode"):
        make_plan(AlignmentConfig(mode="eager"))
    with pytest.raises(ValueError, match="min_period"):
        make_plan(AlignmentConfig(tune=True, min_period=4, max_period=2))


# -- hedging ------------------------------------------------------------------------------------
def test_hedge_only_a_near_tie():
    assert hedges_of([4, 1, 6], [0.5, 0.26, 0.24], top_k=2, margin=0.05) == [6]
    assert hedges_of([4, 1, 6], [0.5, 0.36, 0.14], top_k=2, margin=0.05) == []
    assert hedges_of([4, 1, 6], [0.5, 0.26, 0.24], top_k=2, margin=0.0) == []  # off
    assert hedges_of([4, 1], [0.6, 0.4], top_k=2, margin=0.5) == []  # no (k+1)-th candidate


def test_group_hedge_only_for_a_near_tied_group_left_out():
    from odmoe.shadow.hedging import GroupLimit, group_hedges

    # 4 groups of 2 experts, keep 2, ranked by their best two summed (V3): group ranks 1.0, 0.9, 0.88, 0.1
    scores = [0.6, 0.4, 0.5, 0.4, 0.3, 0.58, 0.05, 0.05]
    v3 = GroupLimit(groups=4, keep=2, by_top2=True)
    assert group_hedges(scores, v3, margin=0.05) == [5]  # group 2 (0.88) within 0.05 of group 1 (0.9)
    assert group_hedges(scores, v3, margin=0.01) == []
    assert group_hedges(scores, v3, margin=0.0) == []  # off
    assert group_hedges(scores, None, margin=0.05) == []  # not group-limited
    assert group_hedges(scores, GroupLimit(4, 4, True), margin=0.05) == []  # keeps every group
    # V2 ranks a group by its best: 0.6, 0.5, 0.58, 0.05 -> keep groups 0 and 2; group 1 (0.5) is out
    assert group_hedges(scores, GroupLimit(4, 2, False), margin=0.1) == [2]
    assert group_hedges(scores, GroupLimit(4, 2, False), margin=0.05) == []
    # a swapped group brings its experts in together: its best ones, best first
    assert group_hedges(scores, v3, margin=0.05, per_group=2) == [5, 4]


def test_shadow_hedges_join_both_rules_without_repeats():
    from odmoe.shadow.hedging import GroupLimit, shadow_hedges

    scores = [0.6, 0.4, 0.5, 0.4, 0.3, 0.58, 0.05, 0.05]
    limit = GroupLimit(groups=4, keep=2, by_top2=True)
    # top-2 of the kept groups: 0 and 2; the (k+1)-th candidate, 1, is within 0.1 of the k-th
    assert shadow_hedges([0, 2, 1], [0.6, 0.5, 0.4], 2, 0.1, scores, limit) == [1, 5]
    assert shadow_hedges([0, 2, 1], [0.6, 0.5, 0.4], 2, 0.05, scores, limit) == [5]
    assert shadow_hedges([0, 2, 1], [0.6, 0.5, 0.4], 2, 0.1) == [1]  # no scores: (k+1)-th rule only
    # top-4 from 2 kept groups: a kept group gives 2 on average, so 2 from the group left out
    assert shadow_hedges([0, 2, 1, 3, 5], [0.6, 0.5, 0.4, 0.4, 0.1], 4, 0.05, scores, limit) == [5, 4]
    # a group hedge that is already predicted is not named again
    assert shadow_hedges([5, 0, 2], [0.58, 0.6, 0.5], 2, 0.05, scores, limit) == []


def test_a_hedge_sits_with_the_kth_expert_and_main_sends_it_there():
    topo = Topology(workers=4, group_size=2)
    # layer 1 -> workers 2, 3; predicted [7, 2] by score: 2 (the k-th) -> worker 2, 7 -> worker 3
    assert topo.hedge_placement(1, [7, 2], [5]) == {5: 2}
    # main's router swapped 2 for the hedge 5: 7 where it was preloaded, 5 where it was hedged
    assert topo.repair_placement(1, [7, 2], [7, 5], hedges=[5]) == {7: 3, 5: 2}
    # two misses, one hedged: the other goes to the worker whose preload went unused (not the hedger)
    assert topo.repair_placement(1, [7, 2], [5, 9], hedges=[5]) == {5: 2, 9: 3}
    # no hedges: as before
    assert topo.repair_placement(1, [7, 2], [7, 5]) == {7: 3, 5: 2}
    assert topo.repair_placement(1, [2, 7], [2, 5], hedges=[5]) == {2: 2, 5: 3}
