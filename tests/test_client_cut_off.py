"""A client cut off from main mid-stream (issue 47): its link black-holes (no FIN, no RST: every byte
either way is held), so nothing tells main the client is gone but main's own pings
(server.client_ping_s, nodes/main.py: server_options). Main must let the connection go within
about ping + timeout, cancel the request so its place and K/V are freed, and the other clients'
streams must go on with the reference tokens.

Real processes and sockets: a LocalCluster, one client reaching main through a link relay
(odmoe/tools/link_relay.py) whose black hole holds that client's bytes, another client straight to
main. The detection time is printed (`-s`) and only loosely bounded: tests never assert timings.
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from odmoe import Client, LocalCluster
from odmoe.tools.link_relay import Relay
from tests.test_batching import PROMPTS, alone

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # a cluster: ~1 min here


def _metric(cluster: LocalCluster, name: str) -> float:
    page = httpx.get(f"{cluster.http_url}/metrics", **cluster.http_auth).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", page, re.M)
    return float(found.group(1)) if found else 0.0


CANCELLED = 'odmoe:requests_total{finish_reason="cancelled"}'


def test_a_client_black_holed_mid_stream_is_cancelled_and_the_others_stay_exact(model_dirs, reap_children):
    path, other_tokens = model_dirs["mixtral"], 120
    want = list(alone(path, PROMPTS[1], other_tokens, 0))
    # pings every 0.5 s, 1 s to answer: let go well before the cut-off request could end by itself;
    # worker.cache=0 (experts loaded at every use) slows decoding down to make sure of that
    words = ["server.client_ping_s=0.5", "server.client_ping_timeout_s=1.0", "worker.cache=0"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        cluster.client.generate(PROMPTS[0], max_new_tokens=2)  # warm
        relay = Relay(f"tcp://{cluster.address}")
        # keepalive_s long: this client does nothing about the black hole in the test's time, so
        # whatever ends its request is main's doing
        cut = Client(relay.address.removeprefix("tcp://"), keepalive_s=120, credentials=cluster.credentials)
        other: dict[str, object] = {}
        try:
            # as long as the model allows (256 positions): seconds of decoding if nobody stops it
            stream = cut.stream(PROMPTS[0], max_new_tokens=240, ignore_eos=True)
            got = [next(stream).token_id for _ in range(3)]
            assert got == list(alone(path, PROMPTS[0], 3, 0))
            runner = threading.Thread(
                target=lambda: other.update(
                    result=cluster.client.generate(PROMPTS[1], max_new_tokens=other_tokens)
                ),
                daemon=True,
            )
            runner.start()
            cancelled = _metric(cluster, CANCELLED)
            holed = time.monotonic()
            relay.black_hole(True)
            while _metric(cluster, CANCELLED) == cancelled:
                # not cancelled by now: main never noticed, and the request ran to its end or still runs
                assert time.monotonic() - holed < 15, "main never cancelled the cut-off client's request"
                time.sleep(0.05)
            detect_s = time.monotonic() - holed
            running_then = runner.is_alive()
            runner.join(timeout=120)
            assert other["result"].token_ids == want, "the other client's stream differs from the reference"
            deadline = time.monotonic() + 10
            while _metric(cluster, "odmoe:num_requests_running") != 0:  # its place is free
                assert time.monotonic() < deadline, "the cut-off request kept its place"
                time.sleep(0.05)
            log = cluster.node("main").log_file.read_text()
            assert "cancelled by its client" in log
            print(
                f"\nclient black-holed mid-stream: request cancelled {detect_s:.2f}s later "
                f"(server.client_ping_s + client_ping_timeout_s = 0.5 + 1 s); the other stream "
                f"{'still running then, ' if running_then else ''}exact ({other_tokens} tokens)"
            )
        finally:
            relay.close()
            cut.close()
