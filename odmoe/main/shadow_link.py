"""Main's side of the shadow: tell it what main did, collect what it predicts.

Contract: `begin` / `align` / `end` push one request's control messages to the shadow (PUSH -> its
PULL); several requests may run at once (`odmoe.main.engine`). `prediction(step)` returns the shadow's
prediction for that (stream, tick, layer) if it has arrived (SUB to its PUB, drained without
blocking), else None: main never waits for the shadow. With several requests a prediction is the
union of their choices, each request's own listed in it (`Prediction.requests`). While draining it
notes, per request, how many MoE layers ahead of main each prediction arrived, and the shadow's
late departure per iteration. `collect(request, ...)` gives one request's predictions by its own
(iteration, layer), for the paper's recall, once the shadow has said it is done with it.

Losing the shadow costs speed, never tokens: the control connection is heartbeated, and with a
`BeatWatch` (odmoe/transport/beats.py) the shadow is beaten over UDP too, so a link that drops
everything is noticed in ~1 s; every send is non-blocking (dropped when the shadow is gone or too
far behind), and a request that begins while the shadow is unreachable runs without it (`active`
is False: no predictions, loads after routing). With security on (a `Curve` identity) both
connections only complete a CURVE handshake with the holder of the cluster's "shadow" key.

Coming back: when the shadow is reachable again (its beats answer, or its connection is back), a
running request that lost it is `resume`d at main's next iteration n: the link reconnects both
sockets afresh (a TCP connection that lived through a partition may sit in a retransmission
backoff of many seconds, and hold stale messages) and sends a new Begin whose prompt is the
request's prompt and the n-1 tokens main fed since, so the shadow re-prefills and predicts from
iteration n on; from then on the request's iterations are shifted by `offset` on the wire (the
shadow's iteration 1 is main's n; ticks, which name predictions, stay main's). A shadow restarted
elsewhere announces itself and main `replace`s the link; its requests resume the same way.
Prediction frames are untrusted and dropped when they do not decode or name a layer that does not exist.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import zmq

from odmoe.main.exchange_observers import own_experts
from odmoe.tools.trace import now_us
from odmoe.transport.beats import BeatWatch
from odmoe.transport.codec import CodecError
from odmoe.transport.dropped import DropLog
from odmoe.transport.heartbeat import CONNECT_TIMEOUT_MS, Heartbeat, WatchedSocket
from odmoe.transport.messages import (
    Align,
    BeginRequest,
    EndRequest,
    Prediction,
    ShadowEnded,
    ShadowIteration,
    Step,
    from_frames,
    to_frames,
)
from odmoe.transport.security import Curve, secure_client

log = logging.getLogger("odmoe.main")


@dataclass
class ShadowObservations:
    lookahead_layers: list[int] = field(default_factory=list)
    late_departure_s: dict[int, float] = field(default_factory=dict)  # iteration -> seconds
    forward_s: dict[int, float] = field(default_factory=dict)  # iteration -> its forward pass, seconds
    device_peak_bytes: int = 0  # the shadow process's CUDA max_memory_allocated, as last reported
    alignment_wait_s: dict[int, float] = field(default_factory=dict)  # iteration -> idle for alignment
    ahead: dict[int, int] = field(default_factory=dict)  # speculative: iteration -> iterations ahead of main
    rollbacks: int = 0  # speculative: how often the shadow rolled back in this request


@dataclass
class _Request:
    """What main knows of one request at the shadow."""

    stream: str
    first_tick: int  # main's tick of its decode iteration 1
    active: bool  # it runs with the shadow (the shadow was up when it began, or since it resumed)
    prompt_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 0
    offset: int = 0  # resumed at main's iteration offset+1: the shadow's iteration i is main's i+offset
    resumes: int = 0
    ended: bool = False  # the shadow said it works on it no more (ShadowEnded)
    seen: ShadowObservations = field(default_factory=ShadowObservations)

    def tick(self, iteration: int) -> int:
        return self.first_tick + iteration - 1


class ShadowLink:
    def __init__(
        self,
        control_address: str,
        pub_address: str,
        moe_layers: list[int],
        heartbeat: Heartbeat | None = None,
        curve: Curve | None = None,
        beats: BeatWatch | None = None,
    ):
        self.ctx = zmq.Context.instance()
        self.beats = beats  # UDP beats to the shadow's control port (None: heartbeats alone)
        self.beat_lost = False  # its beats say it is unreachable
        self.stale = False  # lost since the sockets were made: a resume reconnects them first
        self.fresh = False  # sockets just made: sends queue until the handshake completes
        self.lost_at_us = 0.0  # when it was last lost (stats: while the running requests ran)
        self.curve = curve  # security on: both connections are CURVE clients of the key "shadow"
        self.heartbeat = heartbeat or Heartbeat()
        self.order = {layer: i for i, layer in enumerate(moe_layers)}
        self.requests: dict[str, _Request] = {}
        self.stream = ""
        self.predictions: dict[tuple[int, int], Prediction] = {}  # the stream's, by (tick, layer)
        self.dropped = DropLog(log, "main (predictions)")
        self._connect(control_address, pub_address)

    def _connect(self, control_address: str, pub_address: str) -> None:
        self.control = WatchedSocket(
            self.ctx,
            zmq.PUSH,
            control_address,
            self.heartbeat,
            sndhwm=10_000,
            curve=self.curve,
            server="shadow",
        )
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
        secure_client(self.sub, self.curve, "shadow")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub_address)
        self.address, self.pub_address = control_address, pub_address
        if self.beats is not None:
            self.beats.watch("shadow", control_address)
        self.beat_lost = False

    def replace(self, control_address: str, pub_address: str) -> None:
        """A shadow (re)started at these addresses: talk to it from now on (running requests that
        lost the old one resume with it)."""
        self.close()
        self._connect(control_address, pub_address)
        self.stale, self.fresh = False, True

    @property
    def up(self) -> bool:
        """Reachable, as far as the heartbeat and the beats know (drains their events)."""
        why = ["its connection dropped"] if self.control.lost() else []
        if self.beats is not None and self.beats.take_lost():
            self.beat_lost = True
            why.append(self.beats.why("shadow"))
        if why:  # stale: a resume reconnects afresh
            self.lost_at_us, self.stale, self.fresh = now_us(), True, False
            log.warning(
                "shadow (%s) lost (%s): requests run without predictions until it is back",
                self.address,
                "; ".join(why),
            )
        if self.beats is not None and self.beats.take_back():
            self.beat_lost = False
            log.info("shadow (%s) answers beats again: running requests resume with it", self.address)
        return not self.beat_lost and (self.control.connected or self.fresh)

    def resumable(self, request: str) -> bool:
        """The request runs without the shadow, and the shadow is reachable now."""
        r = self.requests.get(request)
        return r is not None and not r.active and r.max_new_tokens > 0 and self.up

    def resume(self, request: str, iteration: int, fed_ids: list[int]) -> None:
        """Main's iteration `iteration` of `request` runs next, after feeding `fed_ids` (its
        iterations 1..iteration-1): the shadow takes the request up again from there."""
        r = self.requests[request]
        if self.stale:  # fresh connections: no retransmission backoff, no stale queue
            self.replace(self.address, self.pub_address)
        r.offset, r.active, r.ended, r.resumes = iteration - 1, True, False, r.resumes + 1
        ids = [*r.prompt_ids, *fed_ids]
        left = r.max_new_tokens - r.offset
        if left < 1:  # nothing left to predict
            r.active = False
            return
        self._send(to_frames(BeginRequest(request, ids, left, r.stream, r.tick(iteration))))
        log.info("request %s: the shadow resumes it at iteration %d", request, iteration)

    def wait_up(self, timeout_s: float) -> bool:
        """At start-up: wait for the connection, so the first request already has the shadow."""
        deadline = time.monotonic() + timeout_s
        while not self.up and time.monotonic() < deadline:
            self.control.monitor.poll(50)
        return self.control.connected

    def _send(self, frames: list, copy: bool = True) -> None:
        try:
            self.control.sock.send_multipart(frames, copy=copy, flags=zmq.NOBLOCK)
        except zmq.Again:  # gone, or too far behind to use: main never waits for the shadow
            pass

    # -- one request ----------------------------------------------------------------------------
    def begin(
        self, request: str, prompt_ids: list[int], max_new_tokens: int, stream: str = "", first_tick: int = 1
    ) -> None:
        stream = stream or request
        if stream != self.stream:  # a new busy period: the old stream's predictions are no use
            self.stream, self.predictions = stream, {}
        if not self.requests:
            self.lost_at_us = 0.0  # stats report a loss seen while these requests ran only
        active = self.up
        self.requests[request] = _Request(stream, first_tick, active, list(prompt_ids), max_new_tokens)
        if active:
            self._send(to_frames(BeginRequest(request, prompt_ids, max_new_tokens, stream, first_tick)))

    def align(
        self,
        request: str,
        iteration: int,
        token: int,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        next_align: int = 0,
    ) -> None:
        r = self.requests.get(request)
        if r is None or not r.active:
            return
        if not self.up:  # lost mid-request: stop talking to it (a poll of its monitor, microseconds)
            for other in self.requests.values():
                other.active = False
            return
        tensors = [keys, values] if keys is not None else []
        shifted_next = next_align - r.offset if next_align > 0 else next_align
        message = Align(
            request,
            iteration - r.offset,
            token,
            keys is not None,
            sent_at_us=now_us(),
            next_align=max(shifted_next, 0),
        )
        self._send(to_frames(message, tensors), copy=False)

    def end(self, request: str) -> None:
        r = self.requests.get(request)
        if r is not None and r.active:
            self._send(to_frames(EndRequest(request)))

    def was_active(self, request: str) -> bool:
        r = self.requests.get(request)
        return r is not None and r.active

    def observations(self, request: str) -> ShadowObservations:
        r = self.requests.get(request)
        return r.seen if r is not None else ShadowObservations()

    def ended(self, request: str) -> bool:
        """The shadow sent every prediction it will send for this request (or it never had it)."""
        self._drain(None)
        r = self.requests.get(request)
        return r is None or not r.active or r.ended

    def wait_ended(self, request: str, deadline: float) -> None:
        """Wait (until `deadline`, time.monotonic) for the shadow to say it is done with `request`."""
        while not self.ended(request) and time.monotonic() < deadline:
            self.sub.poll(10)

    def forget(self, request: str) -> None:
        """The request's stats are out: drop what is kept for it, and predictions nobody needs."""
        self.requests.pop(request, None)
        live = [r.first_tick for r in self.requests.values() if r.stream == self.stream]
        oldest = min(live, default=float("inf"))  # none left: no prediction is needed
        self.predictions = {k: p for k, p in self.predictions.items() if k[0] >= oldest}

    # -- predictions ----------------------------------------------------------------------------
    def prediction(self, step: Step) -> Prediction | None:
        if not any(r.active for r in self.requests.values()):
            return None
        self._drain(step)
        if step.request != self.stream:
            return None
        return self.predictions.get((step.iteration, step.layer))

    def collect(
        self, request: str, keys: list[tuple[int, int]], wait_s: float
    ) -> dict[tuple[int, int], list[int]]:
        """The request's own predictions by its (iteration, layer), for `keys`, waiting up to wait_s
        for ones still in flight: until the shadow has said it stopped working on the request, whose
        predictions for the rest will never come. Without that word (a lost or stuck shadow) wait_s
        bounds the wait."""
        r = self.requests.get(request)
        if r is None or not r.active:
            return {}

        def own(key: tuple[int, int]) -> list[int] | None:  # by main's (iteration, layer)
            mine = r.stream == self.stream  # predictions are kept for the current stream only
            return own_experts(self.predictions.get((r.tick(key[0]), key[1])) if mine else None, request)

        deadline = time.monotonic() + wait_s
        while not r.ended and any(own(k) is None for k in keys) and time.monotonic() < deadline:
            if self.sub.poll(10):
                self._drain(None)
        found = {k: own(k) for k in keys}
        return {k: v for k, v in found.items() if v is not None}

    def _drain(self, now: Step | None) -> None:
        while self.sub.poll(0):
            _topic, *frames = self.sub.recv_multipart(copy=False)
            try:
                message, _ = from_frames(frames)
            except CodecError as exc:
                self.dropped.drop(exc)
                continue
            if isinstance(message, Prediction) and message.step.request == self.stream:
                if message.step.layer not in self.order:
                    self.dropped.drop(
                        f"a prediction for layer {message.step.layer}, which is not a MoE layer"
                    )
                    continue
                s = message.step
                self.predictions[(s.iteration, s.layer)] = message
                if now is not None:
                    ahead = (
                        (s.iteration - now.iteration) * len(self.order)
                        + self.order[s.layer]
                        - self.order[now.layer]
                    )
                    for name in message.requests or self.requests:
                        r = self.requests.get(name)
                        if r is not None and r.stream == self.stream:
                            r.seen.lookahead_layers.append(ahead)
            elif isinstance(message, ShadowEnded):
                r = self.requests.get(message.request)
                if r is not None:
                    r.ended = True
            elif isinstance(message, ShadowIteration):
                r = self.requests.get(message.request)
                if r is None:
                    continue
                seen, iteration = r.seen, message.iteration + r.offset  # main's iteration
                seen.late_departure_s[iteration] = message.late_departure_s
                seen.alignment_wait_s[iteration] = message.alignment_wait_s
                seen.ahead[iteration] = message.ahead
                seen.rollbacks = max(seen.rollbacks, message.rollbacks)
                seen.device_peak_bytes = max(seen.device_peak_bytes, message.device_peak_bytes)
                if message.iteration > 1:
                    seen.forward_s[iteration - 1] = message.previous_forward_s

    def close(self) -> None:
        self.control.close()
        self.sub.close(0)
        self.fresh = False
