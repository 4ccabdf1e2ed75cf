"""Main's side of the shadow: tell it what main did, collect what it predicts.

Contract: `begin` / `align` / `end` push control messages to the shadow (PUSH -> its PULL);
`prediction(step)` returns the shadow's prediction for that (request, iteration, layer) if it has
arrived (SUB to its PUB, drained without blocking), else None: main never waits for the shadow.
While draining it notes, for each prediction, how many MoE layers ahead of main it arrived, and
the shadow's late departure per iteration.

Losing the shadow costs speed, never tokens: the control connection is heartbeated, every send is
non-blocking (dropped when the shadow is gone or too far behind), and a request that begins while
the shadow is unreachable runs without it (`active` is False: no predictions, loads after
routing). With security on (a `Curve` identity) both connections only complete a CURVE handshake
with the holder of the cluster's "shadow" key. A shadow that comes back on the same address is
used from the next request; one restarted elsewhere announces itself and main `replace`s the
link. Prediction frames are untrusted and dropped when they do not decode or name a layer that does not exist.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import zmq

from odmoe.codec import CodecError
from odmoe.dropped import DropLog
from odmoe.heartbeat import Heartbeat, WatchedSocket
from odmoe.messages import (
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
from odmoe.security import Curve, secure_client
from odmoe.trace import now_us

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


class ShadowLink:
    def __init__(
        self,
        control_address: str,
        pub_address: str,
        moe_layers: list[int],
        heartbeat: Heartbeat | None = None,
        curve: Curve | None = None,
    ):
        self.ctx = zmq.Context.instance()
        self.curve = curve  # security on: both connections are CURVE clients of the key "shadow"
        self.heartbeat = heartbeat or Heartbeat()
        self.order = {layer: i for i, layer in enumerate(moe_layers)}
        self.request = ""
        self.active = False  # this request runs with the shadow
        self.ended = False  # the shadow said it works on this request no more (ShadowEnded)
        self.predictions: dict[tuple[int, int], Prediction] = {}
        self.seen = ShadowObservations()
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
        secure_client(self.sub, self.curve, "shadow")
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub_address)
        self.address, self.pub_address = control_address, pub_address
        self.lost_at_us = 0.0

    def replace(self, control_address: str, pub_address: str) -> None:
        """A shadow (re)started at these addresses: talk to it from the next request on."""
        self.close()
        self._connect(control_address, pub_address)

    @property
    def up(self) -> bool:
        """Connected, as far as the heartbeat knows (drains the connection's events)."""
        if self.control.lost():
            self.lost_at_us = now_us()
            log.warning("shadow (%s) lost: requests run without predictions until it is back", self.address)
        return self.control.connected

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

    def begin(self, request: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.request, self.predictions, self.seen = request, {}, ShadowObservations()
        self.ended = False
        self.lost_at_us = 0.0  # stats report a loss seen during this request only
        self.active = self.up
        if self.active:
            self._send(to_frames(BeginRequest(request, prompt_ids, max_new_tokens)))

    def align(
        self,
        iteration: int,
        token: int,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        next_align: int = 0,
    ) -> None:
        if not self.active:
            return
        if not self.up:  # lost mid-request: stop talking to it (a poll of its monitor, microseconds)
            self.active = False
            return
        tensors = [keys, values] if keys is not None else []
        message = Align(
            self.request, iteration, token, keys is not None, sent_at_us=now_us(), next_align=next_align
        )
        self._send(to_frames(message, tensors), copy=False)

    def end(self) -> None:
        if self.active:
            self._send(to_frames(EndRequest(self.request)))

    def prediction(self, step: Step) -> Prediction | None:
        if not self.active:
            return None
        self._drain(step)
        return self.predictions.get((step.iteration, step.layer))

    def collect(self, keys: list[tuple[int, int]], wait_s: float) -> dict[tuple[int, int], Prediction]:
        """This request's predictions for `keys`, waiting up to wait_s for ones still in flight: until
        the shadow has said it stopped working on the request (after `end`), whose predictions for
        the rest will never come. Without that word (a lost or stuck shadow) wait_s bounds the wait."""
        if not self.active:
            return {}
        deadline = time.monotonic() + wait_s
        while not self.ended and any(k not in self.predictions for k in keys) and time.monotonic() < deadline:
            if self.sub.poll(10):
                self._drain(None)
        return dict(self.predictions)

    def _drain(self, now: Step | None) -> None:
        while self.sub.poll(0):
            _topic, *frames = self.sub.recv_multipart(copy=False)
            try:
                message, _ = from_frames(frames)
            except CodecError as exc:
                self.dropped.drop(exc)
                continue
            if isinstance(message, Prediction) and message.step.request == self.request:
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
                    self.seen.lookahead_layers.append(ahead)
            elif isinstance(message, ShadowEnded) and message.request == self.request:
                self.ended = True
            elif isinstance(message, ShadowIteration) and message.request == self.request:
                self.seen.late_departure_s[message.iteration] = message.late_departure_s
                self.seen.alignment_wait_s[message.iteration] = message.alignment_wait_s
                self.seen.ahead[message.iteration] = message.ahead
                self.seen.rollbacks = max(self.seen.rollbacks, message.rollbacks)
                self.seen.device_peak_bytes = max(self.seen.device_peak_bytes, message.device_peak_bytes)
                if message.iteration > 1:
                    self.seen.forward_s[message.iteration - 1] = message.previous_forward_s

    def close(self) -> None:
        self.control.close()
        self.sub.close(0)
