"""An error nobody expected (a bug) inside main fails loudly and keeps what it can.

- In one request's forward pass (`fault.action=raise` at main): that request ends with INTERNAL
  naming the error, and main goes on serving the next request exactly.
- In the decode loop itself, outside any request: main's requests get an error, /health says why,
  and main stops with exit status 1 (so clients fail over to a standby), rather than a main that
  answers health checks while requests wait for a loop that is gone (seen: a hybrid model's
  alignment raised there, and the client waited forever).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import grpc
import pytest

from odmoe import LocalCluster
from odmoe.nodes.main import MainNode
from tests.test_cluster_fidelity import PROMPTS, reference

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


@pytest.mark.integration
@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_an_error_in_one_request_fails_it_and_main_serves_the_next(model_dirs, reap_children):
    path = model_dirs["mixtral"]
    words = ["lab=on", "fault.node=main", "fault.action=raise", "fault.iteration=3"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        with pytest.raises(grpc.RpcError) as failed:
            cluster.client.generate(PROMPTS[0], max_new_tokens=8)
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert "InjectedFault" in failed.value.details()
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=8)  # the fault fires once
    assert got.token_ids == reference(path, PROMPTS[0], new_tokens=8)[0]


def test_a_failed_decode_loop_stops_main_and_says_why():
    def serve(*_args, **_kwargs):
        raise KeyError("a bug")

    node = SimpleNamespace(
        engine=SimpleNamespace(serve=serve),
        engine_started=threading.Event(),
        engine_failed=None,
        requests=None,
        stopped=threading.Event(),
        _maintain=lambda: None,
    )
    stop = threading.Event()
    MainNode.run_engine(node, stop.set)
    assert stop.is_set()  # main's serve() wakes up, shuts down and exits with status 1
    assert isinstance(node.engine_failed, KeyError)
    assert MainNode.health(node) == "main's decode loop failed: 'a bug'"
