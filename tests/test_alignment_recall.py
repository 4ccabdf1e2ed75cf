import pytest

from odmoe.main.alignment import AlignmentSchedule
from odmoe.main.recall import RecallCounter

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_periods_pick_iterations():
    s = AlignmentSchedule(token_period=2, kv_period=3)
    assert [n for n in range(1, 10) if s.align_token(n)] == [2, 4, 6, 8]
    assert [n for n in range(1, 10) if s.align_kv(n)] == [3, 6, 9]
    assert not s.align_token(0) and not s.align_kv(0)
    off = AlignmentSchedule(0, 0)
    assert not any(off.waits(n) for n in range(20))
    every = AlignmentSchedule(1, 1)
    assert all(every.waits(n) for n in range(1, 20))


def test_negative_period_rejected():
    with pytest.raises(ValueError, match="token_period"):
        AlignmentSchedule(token_period=-1)


def test_recall_follows_eq_2_and_3():
    r = RecallCounter()
    r.add(0, 0, None, [1, 2])  # prefill: not counted
    r.add(1, 0, [1, 2], [1, 2])
    r.add(1, 1, [1, 3], [1, 2])
    r.add(2, 0, None, [4, 5])  # late: predicted nothing
    r.add(2, 1, [4, 5], [4, 5])
    rep = r.report()
    assert rep["per_token"] == {1: 0.75, 2: 0.5}
    assert rep["per_layer"] == {0: 0.5, 1: 0.75}
    assert rep["overall"] == 5 / 8
    assert rep["late_layers"] == 1 and rep["activated"] == 8
