"""Both front doors answer a failure from one table (odmoe/serving/error_status.py)."""

from __future__ import annotations

import grpc
import pytest

from odmoe.main.engine import InvalidRequest, ShuttingDown
from odmoe.main.remote_experts import WorkerFailed, WorkerUnavailable
from odmoe.main.request_queue import DeadlineExceeded, QueueClosed, QueueFull
from odmoe.serving.error_status import message_of, status_of
from odmoe.serving.http_api import _error_of

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

C = grpc.StatusCode


@pytest.mark.parametrize(
    "error, code, http, kind",
    [
        (InvalidRequest("bad"), C.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (QueueFull("full"), C.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (QueueClosed("closing"), C.UNAVAILABLE, 503, "service_unavailable"),
        (DeadlineExceeded("late"), C.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (WorkerUnavailable("no worker"), C.UNAVAILABLE, 503, "service_unavailable"),
        (ShuttingDown("main stops"), C.UNAVAILABLE, 503, "service_unavailable"),  # a subclass
        (WorkerFailed("worker said no"), C.FAILED_PRECONDITION, 500, "server_error"),
        (KeyError("a bug"), C.INTERNAL, 500, "server_error"),
    ],
)
def test_each_error_reads_the_same_on_both_doors(error, code, http, kind):
    status = status_of(error)
    assert (status.grpc, status.http, status.kind) == (code, http, kind)
    api = _error_of(error)  # what the HTTP door sends
    assert (api.status, api.kind, api.message) == (http, kind, message_of(error))


def test_only_an_unexpected_error_is_named_by_its_class():
    assert message_of(QueueFull("12 requests wait")) == "12 requests wait"
    assert message_of(KeyError("a bug")) == "KeyError: 'a bug'"
