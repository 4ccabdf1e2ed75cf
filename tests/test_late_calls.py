"""Late decode calls sent again (odmoe.main.late_calls, failover.resend_late_*): the deadline's rule,
and a real cluster whose worker's link holds everything for a second at a time (a lost segment
waiting for TCP's retransmission) while its process lives: its experts are sent to its peer once the
call is late, the tokens stay the reference's, and no stream stalls for the hole's length."""

from __future__ import annotations

import threading
import time

import pytest

from odmoe import LocalCluster
from odmoe.main.exchange_records import BatchCall
from odmoe.main.late_calls import LateCalls
from odmoe.tools.link_relay import Relay
from tests.test_cluster_fidelity import PROMPTS, reference


def test_the_deadline_is_a_multiple_of_the_median_round_trip_never_under_the_minimum():
    late = LateCalls(factor=4.0, min_s=0.05)
    assert late.after_s() == 0.05  # nothing seen yet
    for seconds in [0.02] * 10 + [5.0]:  # one very late call does not lift the median
        late.observe(seconds)
    assert late.after_s() == pytest.approx(0.08)
    late.observe(-1.0)  # no round trip: ignored
    assert len(late.recent) == 11
    assert LateCalls(factor=0).after_s() is None
    with pytest.raises(ValueError):
        LateCalls(factor=-1)


def test_the_median_is_over_a_window_of_recent_calls():
    late = LateCalls(factor=2.0, min_s=0.0, window=4)
    for seconds in (1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1):
        late.observe(seconds)
    assert late.after_s() == pytest.approx(0.2)


def test_a_layers_calls_are_noted_and_a_re_send_that_came_first_counts_as_won():
    late = LateCalls()
    first = BatchCall(0, [1, 2], sent_at=1.0, answered_at=1.004)
    overtaken_for = BatchCall(3, [5], sent_at=1.0)  # never answered: its re-send below won
    again = BatchCall(2, [5], sent_at=1.05, answered_at=1.056, again=True)
    for call in (first, again):
        call.answers[0] = (object(), [])  # type: ignore[assignment]
    late.note([first, again])
    assert list(late.recent) == [pytest.approx(0.004)] and late.won == 1
    assert not overtaken_for.done


def test_prefill_waits_for_half_its_calls_then_gives_the_slowest_a_factors_grace():
    late = LateCalls(factor=4.0, min_s=0.02)
    assert late.prefill_late_at(10.0, [0.1], calls=4) is None  # one of four done: not known yet
    assert late.prefill_late_at(10.0, [0.1, 0.3], calls=4) == pytest.approx(11.2)
    assert late.prefill_late_at(10.0, [0.001, 0.002], calls=3) == pytest.approx(10.02)  # the minimum
    assert LateCalls(factor=0).prefill_late_at(10.0, [0.1, 0.2], calls=2) is None


@pytest.mark.integration
@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_a_worker_whose_link_holds_everything_for_a_second_costs_no_second(model_dirs, reap_children):
    path, new_tokens, hole_s = model_dirs["mixtral"], 60, 1.0
    want, _ = reference(path, PROMPTS[0], new_tokens=new_tokens)
    relays: list[Relay] = []

    def through(name: str, address: str) -> str:
        if name != "worker1":
            return address
        relays.append(Relay(address))
        return relays[-1].address

    # beats off: a second's silence would otherwise (rightly) count as a black hole and lose worker1
    words = ["failover.beat_interval_s=0", "failover.resend_late_min_s=0.05", "worker.cache=0"]
    stop, times, tokens = threading.Event(), [], []

    def holes() -> None:
        while not stop.wait(0.3):
            for relay in relays:
                relay.black_hole(True)
            stop.wait(hole_s)
            for relay in relays:
                relay.black_hole(False)

    try:
        with LocalCluster(path, workers=4, group_size=2, overrides=words, through=through) as cluster:
            cluster.client.generate(PROMPTS[0], max_new_tokens=2)  # warm
            holer = threading.Thread(target=holes, daemon=True)
            holer.start()
            try:
                for piece in cluster.client.stream(PROMPTS[0], max_new_tokens=new_tokens):
                    tokens.append(piece.token_id)
                    times.append(time.monotonic())
            finally:
                stop.set()
                holer.join()
            stats = cluster.client.generate(PROMPTS[0], max_new_tokens=1).stats
            lost = [e for e in cluster.client.info()["membership_events"] if e["event"] == "lost"]
    finally:
        for relay in relays:
            relay.close()
    assert tokens == want
    late = stats["late_calls"]
    assert late["resent"] > 0 and late["won"] > 0, late
    assert lost == [], lost
    stall = max(b - a for a, b in zip(times, times[1:], strict=False))
    print(f"\nholes of {hole_s}s on worker1's link: longest stall {stall:.3f}s, late calls {late}")
    assert stall < 0.6 * hole_s, stall
