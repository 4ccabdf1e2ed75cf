"""One table from the errors a request can end with to what each front door answers with.

Contract: `status_of(error)` returns the `Status` for an exception a request met (refused at once by
`submit`, or put in its ticket by the engine): the gRPC status code, the HTTP status and the
OpenAI-style error `type`. The first class in ERRORS the error is an instance of decides (the order
puts subclasses first); anything else is a bug's error: INTERNAL / 500 `server_error`, and
`message_of` then names the exception's class as well. Both front doors (nodes/main.py's gRPC
`Generate`, odmoe/serving/http_api.py) answer from this table, so the same failure reads the same on both.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from odmoe.main.engine import InvalidRequest
from odmoe.main.remote_experts import WorkerFailed, WorkerUnavailable
from odmoe.main.request_queue import DeadlineExceeded, QueueClosed, QueueFull


@dataclass(frozen=True)
class Status:
    grpc: grpc.StatusCode
    http: int
    kind: str  # the OpenAI error body's "type"


INTERNAL = Status(grpc.StatusCode.INTERNAL, 500, "server_error")
ERRORS: tuple[tuple[type[Exception], Status], ...] = (
    (InvalidRequest, Status(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")),
    # a bounded queue is full: come back later (clients back off)
    (QueueFull, Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")),
    # main shuts down, or (ShuttingDown, a WorkerUnavailable) its engine stopped: clients fail over
    (QueueClosed, Status(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable")),
    (DeadlineExceeded, Status(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error")),
    # no live worker holds a layer the request needs: the cluster may serve again once one joins
    (WorkerUnavailable, Status(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable")),
    # a worker answered with an error of its own: the request cannot be completed as asked
    (WorkerFailed, Status(grpc.StatusCode.FAILED_PRECONDITION, 500, "server_error")),
)


def status_of(error: BaseException) -> Status:
    for kind, status in ERRORS:
        if isinstance(error, kind):
            return status
    return INTERNAL


def message_of(error: BaseException) -> str:
    """What the client reads: the error's own words; for an unexpected one, its class too."""
    return f"{type(error).__name__}: {error}" if status_of(error) is INTERNAL else str(error)
