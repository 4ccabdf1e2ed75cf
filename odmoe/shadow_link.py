"""Main's side of the shadow: tell it what main did, collect what it predicts.

Contract: `begin` / `align` / `end` push control messages to the shadow (PUSH -> its PULL);
`prediction(step)` returns the shadow's prediction for that (request, iteration, layer) if it has
arrived (SUB to its PUB, drained without blocking), else None: main never waits for the shadow.
While draining it notes, for each prediction, how many MoE layers ahead of main it arrived, and
the shadow's late departure per iteration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import zmq

from odmoe.messages import (
    Align,
    BeginRequest,
    EndRequest,
    Prediction,
    ShadowIteration,
    Step,
    from_frames,
    to_frames,
)
from odmoe.trace import now_us


@dataclass
class ShadowObservations:
    lookahead_layers: list[int] = field(default_factory=list)
    late_departure_s: dict[int, float] = field(default_factory=dict)  # iteration -> seconds
    forward_s: dict[int, float] = field(default_factory=dict)  # iteration -> its forward pass, seconds
    alignment_wait_s: dict[int, float] = field(default_factory=dict)  # iteration -> idle for alignment


class ShadowLink:
    def __init__(self, control_address: str, pub_address: str, moe_layers: list[int]):
        self.ctx = zmq.Context.instance()
        self.control = self.ctx.socket(zmq.PUSH)
        self.sub = self.ctx.socket(zmq.SUB)
        for sock in (self.control, self.sub):
            sock.setsockopt(zmq.LINGER, 0)
        self.control.setsockopt(zmq.SNDHWM, 10_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.control.connect(control_address)
        self.sub.connect(pub_address)
        self.pub_address = pub_address
        self.order = {layer: i for i, layer in enumerate(moe_layers)}
        self.request = ""
        self.predictions: dict[tuple[int, int], Prediction] = {}
        self.seen = ShadowObservations()

    def begin(self, request: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.request, self.predictions, self.seen = request, {}, ShadowObservations()
        self.control.send_multipart(to_frames(BeginRequest(request, prompt_ids, max_new_tokens)))

    def align(
        self, iteration: int, token: int, keys: torch.Tensor | None, values: torch.Tensor | None
    ) -> None:
        tensors = [keys, values] if keys is not None else []
        message = Align(self.request, iteration, token=token, kv=keys is not None, sent_at_us=now_us())
        self.control.send_multipart(to_frames(message, tensors), copy=False)

    def end(self) -> None:
        self.control.send_multipart(to_frames(EndRequest(self.request)))

    def prediction(self, step: Step) -> Prediction | None:
        self._drain(step)
        return self.predictions.get((step.iteration, step.layer))

    def collect(self, keys: list[tuple[int, int]], wait_s: float) -> dict[tuple[int, int], Prediction]:
        """This request's predictions for `keys`, waiting up to wait_s for ones still in flight."""
        deadline = time.monotonic() + wait_s
        while any(k not in self.predictions for k in keys) and time.monotonic() < deadline:
            if self.sub.poll(10):
                self._drain(None)
        return dict(self.predictions)

    def _drain(self, now: Step | None) -> None:
        while self.sub.poll(0):
            _topic, *frames = self.sub.recv_multipart(copy=False)
            message, _ = from_frames(frames)
            if isinstance(message, Prediction) and message.step.request == self.request:
                s = message.step
                self.predictions[(s.iteration, s.layer)] = message
                if now is not None:
                    ahead = (
                        (s.iteration - now.iteration) * len(self.order)
                        + self.order[s.layer]
                        - self.order[now.layer]
                    )
                    self.seen.lookahead_layers.append(ahead)
            elif isinstance(message, ShadowIteration) and message.request == self.request:
                self.seen.late_departure_s[message.iteration] = message.late_departure_s
                self.seen.alignment_wait_s[message.iteration] = message.alignment_wait_s
                if message.iteration > 1:
                    self.seen.forward_s[message.iteration - 1] = message.previous_forward_s

    def close(self) -> None:
        self.control.close(0)
        self.sub.close(0)
