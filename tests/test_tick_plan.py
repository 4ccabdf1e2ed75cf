"""The engine's tick planner (odmoe/main/tick_plan.py): who runs how in a tick, pure rules."""

import pytest

from odmoe.main.tick_plan import (
    Admission,
    AdmitState,
    Arrival,
    RunView,
    TickPlan,
    admit,
    kv_fits,
    plan_tick,
    prefill_quota,
    prefill_tick,
    room,
)

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_one_request_alone_is_a_task_of_one():
    """One route for every request: alone, its forward pass is a lockstep task like any other."""
    assert plan_tick([RunView("a", decoding=True, iteration=3)], 3, True) == TickPlan(tasks=["a"])
    # a parked prefill of its own: it goes on as the task it is
    plan = plan_tick([RunView("a", decoding=False, parked=True)], 0, True)
    assert plan.tasks == ["a"] and plan.resume == {"a"}


def test_decoding_requests_go_in_one_batched_pass_after_the_prefills():
    runs = [
        RunView("d1", decoding=True, iteration=5),
        RunView("p", decoding=False, iteration=0, prefill_tick=7),
        RunView("d2", decoding=True, iteration=2),
    ]
    plan = plan_tick(runs, 7, batched=True)
    assert plan.together == ["d1", "d2"] and plan.tasks == ["p"] and not plan.resume
    # without batched decode every one is a task, in running order
    assert plan_tick(runs, 7, batched=False).tasks == ["d1", "p", "d2"]
    # one decoding request is no batch: it is a task beside the prefill
    alone_decoding = plan_tick(runs[:2], 7, batched=True)
    assert alone_decoding.together == [] and alone_decoding.tasks == ["d1", "p"]


def test_followers_and_staggered_prefills_wait_and_parked_prefills_keep_their_turn():
    runs = [
        RunView("parked", decoding=False, parked=True),
        RunView("later", decoding=False, prefill_tick=9),
        RunView("follower", decoding=False, follows=True),
        RunView("now", decoding=False, prefill_tick=8),
        RunView("parked2", decoding=False, parked=True),
    ]
    plan = plan_tick(runs, 8, batched=True)
    assert plan.tasks == ["parked", "now", "parked2"] and plan.resume == {"parked", "parked2"}
    assert set(plan.runs) == {"parked", "now", "parked2"}
    # a decoding request whose forward pass is parked (never both, but the rule says so) is a task
    assert plan_tick([RunView("x", decoding=True, parked=True), *runs[3:4]], 8, True).together == []


def test_a_prefill_is_cut_into_ticks_only_beside_running_requests():
    assert prefill_quota(1000, 24, chunk_tokens=0, others_running=True) == 24  # no chunking
    assert prefill_quota(1000, 24, chunk_tokens=256, others_running=False) == 24  # nobody waits
    assert prefill_quota(100, 24, chunk_tokens=256, others_running=True) == 24  # short prompt
    assert prefill_quota(1024, 24, chunk_tokens=256, others_running=True) == 6  # ~4 ticks
    assert prefill_quota(10**6, 24, chunk_tokens=1, others_running=True) == 1  # at least a layer


def test_prompts_arriving_together_prefill_a_tick_each():
    assert prefill_tick(5, free_tick=7, stagger=True, in_pass=False, plain=True) == 7
    assert prefill_tick(5, free_tick=3, stagger=True, in_pass=False, plain=True) == 5
    assert prefill_tick(5, free_tick=7, stagger=False, in_pass=False, plain=True) == 5
    # mid-pass: a plain prefill may go now, another waits for the next tick
    assert prefill_tick(5, free_tick=5, stagger=True, in_pass=True, plain=True) == 5
    assert prefill_tick(5, free_tick=5, stagger=True, in_pass=True, plain=False) == 6


def test_the_kv_budget_admits_while_it_holds_and_the_first_always():
    assert kv_fits(0, 0, 10**9, 10**9, first=False)  # no budget
    assert kv_fits(100, 0, 0, 10**6, first=True)  # the first request always fits
    assert not kv_fits(100, 0, 0, 1, first=False)  # not measured yet: one at a time
    assert kv_fits(100, 2, 30, 20, first=False) and not kv_fits(100, 2, 30, 21, first=False)


def test_admission_fixes_a_prefills_start_quota_and_first_decode_tick():
    state = AdmitState(
        tick=5, free_tick=7, moe_layers=24, chunk_tokens=256, stagger=True, others_running=True
    )
    # staggered to tick 7, cut into 4 ticks of 6 layers: it decodes from tick 11
    assert admit(Arrival(1024), state) == Admission(prefill_tick=7, quota=6, first_tick=11)
    # a scored prompt passes over its layers twice before it decodes
    assert admit(Arrival(100, scored=True), state) == Admission(7, 24, 9)
    # admitted mid-pass: a plain prefill goes this tick, a grouped one the next
    now = AdmitState(5, 5, 24, 0, True, True, in_pass=True)
    assert admit(Arrival(10), now).prefill_tick == 5
    assert admit(Arrival(10, grouped=True), now) == Admission(6, 24, 7)


def test_room_is_what_max_running_leaves():
    assert room(8, 3) == 5 and room(8, 8) == 0 and room(2, 5) == 0
