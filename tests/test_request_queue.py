"""The bounded arrival-order queue in front of main's engine thread (pure logic, real threads)."""

import threading
import time

import pytest

from odmoe.main.request_queue import END, DeadlineExceeded, QueueClosed, QueueFull, RequestQueue

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_arrival_order_and_a_bound():
    q = RequestQueue(max_waiting=2, default_timeout_s=60)
    a, b = q.submit("a"), q.submit("b")
    with pytest.raises(QueueFull):
        q.submit("c")
    assert q.take(0.1) is a and q.waiting == 1
    q.done(a)
    assert a.next(0) is END and q.take(0.1) is b


def test_cancelled_and_expired_tickets_are_skipped():
    q = RequestQueue(max_waiting=4, default_timeout_s=60)
    gone, late, ok = q.submit("gone"), q.submit("late", timeout_s=0.01), q.submit("ok")
    gone.cancel()
    time.sleep(0.05)
    assert q.take(0.1) is ok
    assert gone.next(0) is END
    assert isinstance(late.next(0), DeadlineExceeded) and late.next(0) is END


def test_a_request_may_shorten_the_deadline_never_lengthen_it():
    q = RequestQueue(max_waiting=4, default_timeout_s=10)
    assert q.submit("x", timeout_s=1000).deadline - time.monotonic() <= 10
    assert q.submit("y", timeout_s=1).deadline - time.monotonic() <= 1


def test_take_wakes_when_a_request_arrives_and_close_ends_the_waiting():
    q = RequestQueue(max_waiting=4, default_timeout_s=60)
    got = []
    taker = threading.Thread(target=lambda: got.append(q.take(5)))
    taker.start()
    time.sleep(0.05)
    first = q.submit("first")
    taker.join(2)
    assert got == [first]
    waiting = q.submit("second")
    q.close(RuntimeError("shutting down"))
    assert isinstance(waiting.next(0), RuntimeError) and waiting.next(0) is END
    with pytest.raises(QueueClosed):  # not QueueFull: a closing main sends clients elsewhere
        q.submit("third")


def test_a_request_handed_to_the_idle_engine_does_not_count_as_waiting():
    """Regression: with max_waiting=1 and the engine idle, two requests at once got a 429 when the
    second came before the engine thread woke for the first (seen under load in test_http_api)."""
    q = RequestQueue(max_waiting=1, default_timeout_s=60)
    got = []
    taker = threading.Thread(target=lambda: got.append(q.take(5)))
    taker.start()
    time.sleep(0.05)  # the engine thread is idle in take()
    with q._ready:  # the engine thread cannot wake until both have arrived
        first, second = q.submit("first"), q.submit("second")
        with pytest.raises(QueueFull):
            q.submit("third")
    taker.join(2)
    assert got == [first] and q.waiting == 1 and q.take(0.1) is second
