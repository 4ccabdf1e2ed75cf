"""Data-plane messages between main, workers (and later the shadow), as frozen dataclasses.

Every message names its `(request, iteration, layer)` so that predictions, retries after a worker
is replaced, and timelines can all be matched to the decode step they belong to. `to_frames` /
`from_frames` go through codec; the message kind travels in the header.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from odmoe.codec import CodecError, decode, encode


@dataclass(frozen=True)
class Step:
    request: str
    iteration: int  # 0 = prefill, n = the n-th decode iteration
    layer: int


@dataclass(frozen=True)
class ComputeExpert:
    """main -> worker: compute `expert` of `step.layer` on these rows (tensor 0: hidden [n, H])."""

    step: Step
    expert: int
    kernel: str
    kind: str = "compute"


@dataclass(frozen=True)
class ExpertResult:
    """worker -> main: the unweighted expert output (tensor 0: [n, H]) and what it cost."""

    step: Step
    expert: int
    worker: int
    load_s: float
    compute_s: float
    bytes_loaded: int
    peak_rss: int
    error: str = ""
    kind: str = "result"


@dataclass(frozen=True)
class Ping:
    kind: str = "ping"


@dataclass(frozen=True)
class Pong:
    worker: int
    layers: list[int]
    store_bytes: int
    peak_rss: int
    kind: str = "pong"


@dataclass(frozen=True)
class Shutdown:
    kind: str = "shutdown"


_KINDS = {cls.kind: cls for cls in (ComputeExpert, ExpertResult, Ping, Pong, Shutdown)}
Message = ComputeExpert | ExpertResult | Ping | Pong | Shutdown


def to_frames(message: Message, tensors: list[torch.Tensor] = ()) -> list:
    return encode(asdict(message), tensors)


def from_frames(frames: list) -> tuple[Message, list[torch.Tensor]]:
    header, tensors = decode(frames)
    cls = _KINDS.get(header.get("kind"))
    if cls is None:
        raise CodecError(f"unknown message kind {header.get('kind')!r}")
    values = {f.name: header[f.name] for f in fields(cls) if f.name in header}
    if "step" in values:
        values["step"] = Step(**values["step"])
    return cls(**values), tensors
