"""Main's link to the shadow over real ZeroMQ sockets: the end of a request waits for late
predictions only until the shadow says it stopped (it used to wait its whole deadline whenever the
shadow was behind at the end, delaying the request's last reply, and the next request, by 1 s)."""

from __future__ import annotations

import time

import pytest
import zmq

from odmoe.main.shadow_link import ShadowLink
from odmoe.transport.messages import (
    BeginRequest,
    EndRequest,
    Prediction,
    ShadowEnded,
    Step,
    from_frames,
    to_frames,
)

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


class _FakeShadow:
    """The shadow's two sockets, driven by the test: a PULL for main's control, a PUB for predictions."""

    def __init__(self):
        ctx = zmq.Context.instance()
        self.control, self.pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
        for sock in (self.control, self.pub):
            sock.setsockopt(zmq.LINGER, 0)
        self.control_address = f"tcp://127.0.0.1:{self.control.bind_to_random_port('tcp://127.0.0.1')}"
        self.pub_address = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"

    def publish(self, message) -> None:
        self.pub.send_multipart([b"main", *to_frames(message)])

    def received(self):
        assert self.control.poll(5000), "main sent nothing"
        return from_frames(self.control.recv_multipart())[0]

    def close(self) -> None:
        self.control.close(0)
        self.pub.close(0)


def _link_with_a_request(shadow: _FakeShadow) -> ShadowLink:
    link = ShadowLink(shadow.control_address, shadow.pub_address, moe_layers=[0, 1])
    assert link.wait_up(5.0)
    link.begin("r", [1, 2, 3], 8)
    assert isinstance(shadow.received(), BeginRequest)
    # a PUB drops what it sends before the SUB has joined: publish until the link has one
    first = Prediction(Step("r", 1, 0), [1, 2], [1, 2, 3], [0.5, 0.3, 0.2])
    deadline = time.monotonic() + 5
    while link.prediction(Step("r", 1, 0)) is None:
        assert time.monotonic() < deadline, "the prediction never reached main"
        shadow.publish(first)
        time.sleep(0.01)
    return link


def test_collecting_stops_once_the_shadow_says_it_ended_the_request():
    shadow = _FakeShadow()
    link = _link_with_a_request(shadow)
    try:
        link.end("r")
        assert isinstance(shadow.received(), EndRequest)
        # the shadow was behind: one more prediction was in flight, the rest never comes
        shadow.publish(Prediction(Step("r", 1, 1), [0, 3], [0, 3, 4], [0.5, 0.3, 0.2]))
        shadow.publish(ShadowEnded("r"))
        start = time.monotonic()
        got = link.collect("r", [(1, 0), (1, 1), (2, 0), (2, 1)], wait_s=10.0)
        assert time.monotonic() - start < 5.0  # without the word: the whole 10 s
        assert sorted(got) == [(1, 0), (1, 1)]  # what was published before the word is all in
    finally:
        link.close()
        shadow.close()


def test_another_requests_end_does_not_stop_the_wait():
    shadow = _FakeShadow()
    link = _link_with_a_request(shadow)
    try:
        shadow.publish(ShadowEnded("an earlier request"))
        start = time.monotonic()
        link.collect("r", [(1, 0), (1, 1)], wait_s=0.5)
        assert time.monotonic() - start >= 0.45  # still waited: that word was not about this request
        assert not link.ended("r")
    finally:
        link.close()
        shadow.close()


def test_two_requests_of_one_stream_each_get_their_own_choice_by_their_own_iteration():
    """Several requests: one prediction per (stream, tick, layer), the union, each request's own
    choice listed; main maps a request's iteration n to tick first_tick + n - 1."""
    shadow = _FakeShadow()
    link = _link_with_a_request(shadow)  # "r": stream "r", iteration n = tick n
    try:
        link.begin("q", [4, 5], 8, stream="r", first_tick=3)  # joined later: its iteration 1 is tick 3
        assert isinstance(shadow.received(), BeginRequest)
        union = Prediction(
            Step("r", 3, 0), [1, 2, 5], [1, 2, 3], [0.5, 0.3, 0.2], [], ["r", "q"], [[1, 2], [2, 5]]
        )
        shadow.publish(union)
        shadow.publish(ShadowEnded("q"))
        deadline = time.monotonic() + 5
        while link.prediction(Step("r", 3, 0)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert link.prediction(Step("r", 3, 0)).experts == [1, 2, 5]
        assert link.collect("q", [(1, 0)], wait_s=1.0) == {(1, 0): [2, 5]}
        assert link.collect("r", [(3, 0)], wait_s=0.0) == {(3, 0): [1, 2]}
        link.forget("r")  # q's ticks stay: its recall still needs them
        assert link.collect("q", [(1, 0)], wait_s=0.0) == {(1, 0): [2, 5]}
    finally:
        link.close()
        shadow.close()


def test_a_request_that_lost_the_shadow_resumes_with_it_once_its_beats_answer_again():
    """Its beats stop (the link went black): the request runs on without it. They answer again: the
    request resumes at main's next iteration with a Begin holding the tokens main fed since, and its
    Aligns and reports are shifted by that offset on the wire (it failed before: never used again)."""
    from odmoe.transport.beats import BeatEcho, BeatWatch
    from odmoe.transport.messages import Align, ShadowIteration
    from odmoe.transport.suspicion import SuspicionSettings

    shadow = _FakeShadow()
    port = int(shadow.control_address.rsplit(":", 1)[1])
    echo = BeatEcho("127.0.0.1", port)
    beats = BeatWatch(SuspicionSettings(interval_s=0.05))
    link = ShadowLink(shadow.control_address, shadow.pub_address, moe_layers=[0, 1], beats=beats)
    try:
        assert link.wait_up(5.0)
        link.begin("r", [1, 2, 3], 40)
        assert isinstance(shadow.received(), BeginRequest)
        time.sleep(0.3)  # answers learnt
        link.align("r", 1, 7, None, None)
        assert shadow.received().iteration == 1
        echo.close()  # black: beats go unanswered
        deadline = time.monotonic() + 3
        while link.up:
            assert time.monotonic() < deadline, "the shadow was never lost"
            time.sleep(0.02)
        link.align("r", 2, 8, None, None)  # the request runs on without it
        assert not link.was_active("r") and not link.resumable("r") and link.lost_at_us > 0
        echo = BeatEcho("127.0.0.1", port)  # the link heals
        deadline = time.monotonic() + 3
        while not link.resumable("r"):
            assert time.monotonic() < deadline, "the shadow never came back"
            time.sleep(0.02)
        fed = list(range(10, 21))  # main's iterations 1..11 fed these
        link.resume("r", 12, fed)
        begin = shadow.received()
        assert isinstance(begin, BeginRequest)
        assert begin.prompt_ids == [1, 2, 3, *fed] and begin.first_tick == 12 and begin.max_new_tokens == 29
        link.align("r", 12, 21, None, None, next_align=14)
        align = shadow.received()
        assert isinstance(align, Align) and (align.iteration, align.token, align.next_align) == (1, 21, 3)
        shadow.publish(ShadowIteration("r", 2, late_departure_s=0.5))
        deadline = time.monotonic() + 5
        while 13 not in link.observations("r").late_departure_s:
            assert time.monotonic() < deadline, "the report never arrived as main's iteration 13"
            shadow.publish(ShadowIteration("r", 2, late_departure_s=0.5))
            link.ended("r")  # drains
            time.sleep(0.02)
    finally:
        link.close()
        beats.close()
        echo.close()
        shadow.close()
