"""Requests waiting for main's engine thread: arrival order, bounded, with deadlines.

Contract: a front door (gRPC or HTTP) calls `submit(request, timeout_s)` and gets a `Ticket` at once,
or `QueueFull` when `max_waiting` requests already wait beyond the ones the engine will take at its
next iteration (the caller answers 429 / RESOURCE_EXHAUSTED: a queue that grows without bound only
turns into timeouts later; a request handed straight to an idle engine thread, or arriving while the
engine has room to run it (`capacity`), does not wait), or `QueueClosed` once main shuts down
(UNAVAILABLE / 503: clients fail over). The engine thread calls `take()` at every iteration boundary
for as many tickets as it can run together (continuous batching), putting each event in its ticket;
the front door reads them with `Ticket.next()`. A ticket is cancelled by its front door when the
client goes away (`Ticket.cancel()`): the engine stops it at the next iteration boundary, or skips
it if it had not started. A ticket past its deadline (counted from arrival, queueing included) fails
with `DeadlineExceeded` the same way. The queue knows nothing about the engine or either protocol.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

END = object()  # the last item of every ticket's events


class QueueFull(RuntimeError):
    """Too many requests wait already."""


class QueueClosed(RuntimeError):
    """Main is shutting down: no new request is taken (clients fail over: UNAVAILABLE / 503)."""


class DeadlineExceeded(RuntimeError):
    """The request did not finish within its deadline."""


@dataclass(eq=False)  # a ticket is itself, not its fields (the running set holds them)
class Ticket:
    request: object
    deadline: float  # time.monotonic() by which it must be done
    arrived: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    events: queue.Queue = field(default_factory=queue.Queue)
    # the request's token ids as its validation made them (None: not checked yet): the prompt is
    # tokenized once, where it is submitted, not again each time the engine looks at the ticket
    prompt_ids: list[int] | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def put(self, event) -> None:
        self.events.put(event)

    def next(self, timeout: float | None = None):
        """The next event, `END` once the request is over, None if nothing came within timeout."""
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None


class RequestQueue:
    def __init__(self, max_waiting: int, default_timeout_s: float):
        if max_waiting < 1 or default_timeout_s <= 0:
            raise ValueError("max_waiting must be >= 1 and the default timeout > 0")
        self.max_waiting, self.default_timeout_s = max_waiting, default_timeout_s
        self._waiting: deque[Ticket] = deque()
        self._ready = threading.Condition()
        # A request that arrives while the engine thread is idle in take() is handed to it, not
        # queued: it does not wait, so it does not count against max_waiting before that thread
        # wakes (a second request right behind it may wait; a third is refused).
        self._idle_takers = 0
        self._handed: Ticket | None = None
        self.running: set[Ticket] = set()
        self.capacity = 0  # requests the engine would start at its next iteration (set by the engine)
        self.closed = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, request, timeout_s: float | None = None, prompt_ids: list[int] | None = None) -> Ticket:
        """`timeout_s` may shorten the server's default deadline, never lengthen it; `prompt_ids`:
        the request's token ids, validated (they travel with its ticket)."""
        limit = self.default_timeout_s if not timeout_s else min(timeout_s, self.default_timeout_s)
        ticket = Ticket(request, deadline=time.monotonic() + limit, prompt_ids=prompt_ids)
        with self._ready:
            if self.closed:
                raise QueueClosed("main is shutting down")
            if self._idle_takers and self._handed is None and not self._waiting:
                self._handed = ticket
            elif len(self._waiting) >= self.max_waiting + self.capacity:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (server.max_waiting)")
            else:
                self._waiting.append(ticket)
            self._ready.notify()
        return ticket

    def take(self, timeout: float, fits=None) -> Ticket | None:
        """The engine thread's next ticket to serve (None when none came within timeout, or when
        `fits(ticket)` says the first in line does not fit yet: it stays first). Tickets cancelled
        or expired while waiting are ended here and never served."""
        end = time.monotonic() + timeout
        with self._ready:
            while True:
                while self._handed is not None or self._waiting:
                    ticket = self._handed or self._waiting[0]
                    if not (ticket.cancelled.is_set() or ticket.expired()) and fits and not fits(ticket):
                        return None
                    if self._handed is ticket:
                        self._handed = None
                    else:
                        self._waiting.popleft()
                    if ticket.cancelled.is_set():
                        ticket.put(END)
                    elif ticket.expired():
                        ticket.put(DeadlineExceeded("the request's deadline passed while it waited"))
                        ticket.put(END)
                    else:
                        self.running.add(ticket)
                        return ticket
                left = end - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                self._idle_takers += 1
                try:
                    self._ready.wait(left)
                finally:
                    self._idle_takers -= 1

    def done(self, ticket: Ticket) -> None:
        ticket.put(END)
        self.running.discard(ticket)

    def close(self, reason: Exception) -> None:
        """Shutting down: every waiting ticket ends with `reason`."""
        with self._ready:
            self.closed = True
            if self._handed is not None:
                self._waiting.appendleft(self._handed)
                self._handed = None
            while self._waiting:
                ticket = self._waiting.popleft()
                ticket.put(reason)
                ticket.put(END)
            self._ready.notify_all()
