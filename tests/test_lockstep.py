"""The lockstep driver (pure: no model) and the request queue's room for a batching engine."""

from __future__ import annotations

import threading

import pytest

from odmoe.lockstep import Failed, Finished, Lockstep, NotInTask, Parked, in_task, park
from odmoe.main.request_queue import QueueFull, RequestQueue

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def _layers(name: str, layers: int, log: list):
    """A forward pass that parks at every layer with (name, layer) and adds what it is resumed with."""
    total = 0
    for layer in range(layers):
        log.append((name, layer, in_task()))
        total += park((name, layer))
    return total


def test_tasks_run_one_at_a_time_until_they_park_and_resume_with_the_drivers_value():
    log: list = []
    steps = Lockstep()
    a, b = steps.start("a", _layers, "a", 2, log), steps.start("b", _layers, "b", 2, log)
    assert a == Parked("a", ("a", 0)) and b == Parked("b", ("b", 0))
    assert log == [("a", 0, True), ("b", 0, True)]  # each ran only up to its first park
    assert steps.resume("a", 10) == Parked("a", ("a", 1))
    assert steps.resume("b", 1) == Parked("b", ("b", 1))
    assert steps.resume("a", 5) == Finished("a", 15)
    assert "a" not in steps and len(steps) == 1
    assert steps.resume("b", 2) == Finished("b", 3)


def test_an_exception_inside_a_task_comes_back_as_failed_and_ends_it():
    def boom():
        park(1)
        raise ValueError("no live worker holds layer 3")

    steps = Lockstep()
    steps.start("x", boom)
    out = steps.resume("x")
    assert isinstance(out, Failed) and isinstance(out.error, ValueError) and "x" not in steps


def test_cancel_ends_a_parked_task_running_its_finally_blocks():
    cleaned = threading.Event()

    def task():
        try:
            park("waiting")
        finally:
            cleaned.set()

    steps = Lockstep()
    steps.start("t", task)
    steps.cancel("t")
    assert cleaned.is_set() and "t" not in steps
    steps.cancel("t")  # twice: nothing


def test_park_outside_a_task_is_refused():
    assert not in_task()
    with pytest.raises(NotInTask):
        park(1)


def test_a_task_key_runs_once_at_a_time():
    steps = Lockstep()
    steps.start("k", park, 1)
    with pytest.raises(ValueError):
        steps.start("k", park, 2)


def test_room_in_the_running_batch_is_not_waiting():
    """With capacity for 2 more running requests, 2 arrivals beyond max_waiting are still taken."""
    q = RequestQueue(max_waiting=1, default_timeout_s=60)
    q.capacity = 2
    tickets = [q.submit(i) for i in range(3)]
    with pytest.raises(QueueFull):
        q.submit(3)
    assert [q.take(0).request for _ in range(3)] == [0, 1, 2]
    assert len(q.running) == 3
    q.done(tickets[0])
    assert len(q.running) == 2


def test_a_ticket_that_does_not_fit_stays_first_in_line():
    q = RequestQueue(max_waiting=4, default_timeout_s=60)
    q.submit("big")
    q.submit("small")
    assert q.take(0, fits=lambda t: t.request != "big") is None
    assert q.waiting == 2  # "small" did not overtake it: no request starves behind smaller ones
    assert q.take(0, fits=lambda t: True).request == "big"
