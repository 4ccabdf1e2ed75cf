"""Generated data-plane frames for fuzzing: random bytes, random msgpack, and real messages mutated.

`frames(rng, hidden)` returns one multipart message (a list of bytes). Real messages are built with
the wire code itself, then damaged in one way each: a flipped or truncated header, a field of the
wrong type, a tensor whose shape or dtype disagrees with its bytes, a frame too many or too few,
an unknown kind, an oversized header, or left valid but for a request that does not exist.
"""

from __future__ import annotations

import random

import msgpack
import torch

from odmoe.models.expert_math import KERNELS
from odmoe.transport.codec import MAX_HEADER_BYTES
from odmoe.transport.messages import (
    Align,
    BeginRequest,
    ComputeExperts,
    EndRequest,
    ExpertsResult,
    LiveWorkers,
    Ping,
    Prediction,
    Release,
    ShadowEnded,
    ShadowIteration,
    Step,
    to_frames,
)

WRONG_VALUES = [None, True, -1, 2**40, 3.5, "", "x" * 300, [], [1, "a"], {"a": 1}, b"\x00\xff", [[[]]]]


def _real(rng: random.Random, hidden: int) -> list[bytes]:
    step = Step(f"fuzz{rng.randrange(1000)}", rng.randrange(4), rng.randrange(6))
    rows = torch.randn(rng.randrange(1, 4), hidden)
    choices = [
        lambda: to_frames(
            ComputeExperts.single(step, rng.randrange(10), rng.choice(KERNELS), rows.shape[0]), [rows]
        ),
        lambda: to_frames(
            ComputeExperts.single(
                step,
                rng.randrange(8),
                "eager",
                rows.shape[0],
                part=rng.randrange(3),
                parts=rng.randrange(1, 4),
            ),
            [rows],
        ),
        lambda: to_frames(
            ComputeExperts(step, [1, 2], [[1], [rows.shape[0] - 1 or 1]], "eager"), [rows[:1], rows[1:]]
        ),
        lambda: to_frames(ExpertsResult(step, 1, [0], [0.0], [0.0], [0], [False], [0.0], 0), [rows]),
        lambda: to_frames(Ping(shadow_pub=rng.choice(["", "tcp://127.0.0.1:1"]))),
        lambda: to_frames(Release(step)),
        lambda: to_frames(EndRequest(step.request)),
        lambda: to_frames(LiveWorkers([rng.randrange(-2, 6) for _ in range(rng.randrange(4))])),
        lambda: to_frames(Prediction(step, [1, 2], [1, 2, 3], [0.5, 0.3, 0.2])),
        lambda: to_frames(ShadowIteration(step.request, 1, 0.0)),
        lambda: to_frames(ShadowEnded(step.request)),
        lambda: to_frames(BeginRequest(step.request, [rng.randrange(-5, 2000) for _ in range(3)], 4)),
        lambda: to_frames(Align(step.request, rng.randrange(5), token=rng.randrange(-1, 50))),
        lambda: to_frames(
            Align(step.request, 1, token=3, kv=True), [torch.randn(rng.randrange(1, 5), 2, 1, 8)] * 2
        ),
    ]
    return [bytes(memoryview(f)) for f in rng.choice(choices)()]


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    header = msgpack.unpackb(frames[0])
    how = rng.randrange(9)
    if how == 0:  # flip bytes in the header
        raw = bytearray(frames[0])
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return [bytes(raw), *frames[1:]]
    if how == 1:  # truncate the header
        return [frames[0][: rng.randrange(len(frames[0]))], *frames[1:]]
    if how == 2:  # a field of the wrong type
        key = rng.choice(list(header))
        header[key] = rng.choice(WRONG_VALUES)
    elif how == 3 and header["_tensors"]:  # a shape that disagrees with the bytes
        header["_tensors"][0][1] = [rng.randrange(-3, 9) for _ in range(rng.randrange(4))]
    elif how == 4 and header["_tensors"]:  # a dtype that disagrees, or does not exist
        header["_tensors"][0][0] = rng.choice(["int8", "float64", "complex64", "nope", 7])
    elif how == 5:  # a frame too many or too few
        if len(frames) > 1 and rng.random() < 0.5:
            return frames[:-1]
        return [*frames, b"\x00" * rng.randrange(9)]
    elif how == 6:
        header["kind"] = rng.choice(["shutdown", "nope", "", 3, None])
    elif how == 7:  # truncate a tensor frame
        if len(frames) > 1:
            return [frames[0], frames[1][: rng.randrange(len(frames[1]) + 1)], *frames[2:]]
    else:  # left valid: for a request that does not exist
        pass
    return [msgpack.packb(header), *frames[1:]]


def _random_msgpack(rng: random.Random) -> bytes:
    def value(depth=0):
        if depth > 2 or rng.random() < 0.5:
            return rng.choice(WRONG_VALUES)
        if rng.random() < 0.5:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["kind", "step", "_tensors", "expert", "x"]): value(depth + 1) for _ in range(3)}

    return msgpack.packb(value(), use_bin_type=True)


def frames(rng: random.Random, hidden: int) -> list[bytes]:
    kind = rng.random()
    if kind < 0.15:
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
    if kind < 0.3:
        return [_random_msgpack(rng), *(rng.randbytes(rng.randrange(9)) for _ in range(rng.randrange(2)))]
    if kind < 0.3005:
        return [b"\x00" * (MAX_HEADER_BYTES + 1)]
    real = _real(rng, hidden)
    return real if kind < 0.4 else _mutate(rng, real)
