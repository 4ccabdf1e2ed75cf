"""Several requests' forward passes on one thread, interleaved at their MoE layers.

Contract: `Lockstep.start(key, fn, *args)` runs `fn(*args)` as a task until it calls `park(payload)`
(from anywhere down its call stack, e.g. inside transformers' forward pass, in the experts call) or
returns; either way control comes back to the driver, which gets a `Parked(key, payload)` or a
`Finished(key, value)` (or `Failed(key, exc)` when the task raised). `resume(key, value)` makes that
`park` call return `value` and runs the task on to its next park. Nothing runs concurrently: a
task runs only between the driver's `start`/`resume` and its next `park`.

Why greenlets, not threads (odmoe's exactness depends on it): every task runs on the driver's own
OS thread, so each tensor op a request computes sees exactly the threading it sees when the request
runs alone (intra-op thread pools are per OS thread; a reduction split over another number of
threads can round differently). And why not restructure the forward pass: transformers' own model
classes (attention, cache, routers of every family) keep running unchanged; only the experts call
parks, which is what lets main step every running request through layer `l` before any goes on to
layer `l+1`, and send one message per worker for all of them.

Thread-local torch state (grad mode, inference mode) is shared by every task on the thread: the
driver runs them all under the same mode.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import greenlet


@dataclass(frozen=True)
class Parked:
    key: Hashable
    payload: Any


@dataclass(frozen=True)
class Finished:
    key: Hashable
    value: Any


@dataclass(frozen=True)
class Failed:
    key: Hashable
    error: BaseException


Outcome = Parked | Finished | Failed


class NotInTask(RuntimeError):
    """`park` was called outside a task started by a Lockstep."""


class Lockstep:
    def __init__(self):
        self._tasks: dict[Hashable, greenlet.greenlet] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, key: Hashable, fn: Callable, *args) -> Outcome:
        if key in self._tasks:
            raise ValueError(f"task {key!r} is already running")
        task = greenlet.greenlet(lambda: fn(*args))
        task.odmoe_key = key  # park() finds its driver through the running greenlet
        self._tasks[key] = task
        return self._run(key, task, ())

    def resume(self, key: Hashable, value: Any = None) -> Outcome:
        return self._run(key, self._tasks[key], (value,))

    def throw(self, key: Hashable, error: BaseException) -> Outcome:
        """Raise `error` at the task's `park` (it may catch it and go on)."""
        task = self._tasks[key]
        try:
            out = task.throw(error)
        except BaseException as exc:  # the task did not catch it
            del self._tasks[key]
            return Failed(key, exc)
        return self._outcome(key, task, out)

    def cancel(self, key: Hashable) -> None:
        """End a task where it is parked (its `finally` blocks run: GreenletExit is raised there)."""
        task = self._tasks.pop(key, None)
        if task is not None and not task.dead:
            task.throw(greenlet.GreenletExit())

    def _run(self, key: Hashable, task: greenlet.greenlet, args: tuple) -> Outcome:
        try:
            out = task.switch(*args)
        except BaseException as exc:  # raised inside the task
            del self._tasks[key]
            return Failed(key, exc)
        return self._outcome(key, task, out)

    def _outcome(self, key: Hashable, task: greenlet.greenlet, out: Any) -> Outcome:
        if task.dead:
            del self._tasks[key]
            return Finished(key, out)
        return out  # the Parked the task switched back with


def park(payload: Any) -> Any:
    """Hand `payload` to the driver and wait to be resumed; returns the value it resumes with."""
    task = greenlet.getcurrent()
    key = getattr(task, "odmoe_key", None)
    if key is None or task.parent is None:
        raise NotInTask("park() outside a Lockstep task")
    return task.parent.switch(Parked(key, payload))


def in_task() -> bool:
    """Whether the caller runs inside a Lockstep task (so it may park)."""
    return getattr(greenlet.getcurrent(), "odmoe_key", None) is not None
