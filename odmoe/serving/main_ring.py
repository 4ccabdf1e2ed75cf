"""Which main a `Client` sends to, shared by every thread using that client: a small state machine.

Contract. `MainRing(addresses, connect, disconnect)` holds the mains in the order they are tried,
the one in use (`index`) and a counter of its changes (`epoch`). Every method takes one lock, so
any number of threads may call them at once; `connect(address)` and `disconnect(connection)` run
under it (the client's: open a gRPC channel and build its stubs / close it, both quick and never
blocking on the network), so nothing is ever built on a connection another thread closed.

- `turn()`: where an attempt goes now, as a `Turn(epoch, index, address, connection)`; the
  connection is opened on first use. A caller keeps its turn for the whole attempt.
- `lost(turn, reason)`: the attempt made on `turn` lost its main. The ring moves on to the next
  main only while `turn` is still current, so however many streams notice one loss, and in whatever
  order, it moves on once, and each of them resumes on that same next main. Moving on closes the
  lost main's connection: a stream still reading from it sees its call cancelled and reports a
  turn that is stale by then, which changes nothing. Returns whether this call moved the ring.
- `gives_up(failures)`: whether a stream whose last `failures` attempts all failed, with no new
  token in between, should stop: once it has failed more times than there are mains. Each of its
  failures was on a turn the ring has since left (by its own `lost` or another stream's), so by then
  every main has been tried and found lost since the stream's last token.
- `replace(old, new)`: a main came back at another address. Its connection is closed; if it is the
  current main the epoch moves without a failover, so streams on the old connection retry on the
  new address.
- `close()`: every connection closed; `turn()` raises `ClientClosed` from then on.

Why an epoch and not the index alone: with two mains, index 0 is current again after two losses,
and a stream still holding the first loss's turn must not move the ring on a second time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

C = TypeVar("C")  # a connection to one main (the client's: a grpc.Channel)


class ClientClosed(ValueError):
    """The client was closed: nothing more is sent through it (a closed gRPC channel's ValueError)."""


@dataclass(frozen=True)
class Turn(Generic[C]):
    epoch: int  # the ring's epoch when this turn was handed out
    index: int  # which main: an index into the ring's addresses
    address: str
    connection: C


class MainRing(Generic[C]):
    def __init__(
        self, addresses: list[str], connect: Callable[[str], C], disconnect: Callable[[C], None]
    ) -> None:
        if not addresses:
            raise ValueError("a client needs at least one main address")
        self._addresses = list(addresses)
        self._connect, self._disconnect = connect, disconnect
        self._lock = threading.Lock()
        self._connections: dict[int, C] = {}  # index -> the open connection to that main
        self._epoch = 0
        self._index = 0  # the main in use; moves on when it is lost
        self._closed = False
        self._log: list[dict] = []  # {at_us, lost, to, reason}: each move on, in order

    @property
    def addresses(self) -> list[str]:
        with self._lock:
            return list(self._addresses)

    @property
    def index(self) -> int:
        return self._index

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def log(self) -> list[dict]:
        with self._lock:
            return list(self._log)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failovers(self) -> int:
        return len(self._log)

    def turn(self) -> Turn[C]:
        with self._lock:
            if self._closed:
                raise ClientClosed("this odmoe.Client is closed")
            connection = self._connections.get(self._index)
            if connection is None:
                connection = self._connections[self._index] = self._connect(self._addresses[self._index])
            return Turn(self._epoch, self._index, self._addresses[self._index], connection)

    def lost(self, turn: Turn[C], reason: str) -> bool:
        with self._lock:
            if self._closed or turn.epoch != self._epoch:
                return False  # already moved on (or closed) since that turn: nothing to do
            connection = self._connections.pop(self._index, None)
            if connection is not None:
                self._disconnect(connection)
            self._index = (self._index + 1) % len(self._addresses)
            self._epoch += 1
            entry = {"at_us": time.time() * 1e6, "lost": turn.address, "to": self._addresses[self._index]}
            self._log.append({**entry, "reason": reason[:200]})
            return True

    def gives_up(self, failures: int) -> bool:
        return failures > len(self._addresses)

    def replace(self, old: str, new: str) -> None:
        with self._lock:
            i = self._addresses.index(old)
            self._addresses[i] = new
            connection = self._connections.pop(i, None)
            if connection is not None:
                self._disconnect(connection)
            if i == self._index:
                self._epoch += 1  # a turn on the old address is stale: its stream retries here

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for connection in self._connections.values():
                self._disconnect(connection)
            self._connections = {}
