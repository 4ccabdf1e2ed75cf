"""Wire format of the data plane: one msgpack header frame, then one raw frame per tensor.

Contract: `encode(header, tensors)` -> list of frames for `send_multipart`; `decode(frames)` ->
(header, tensors). Tensors of any dtype (bf16 included, which numpy cannot name) travel as their
raw bytes; the header records dtype and shape under the reserved key "_tensors". Decoding wraps the
received buffers without copying when they are aligned (else copies them: see `_tensor`); the result
may be read-only memory owned by the frame, so callers that write to a tensor must clone it first.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import msgpack
import numpy as np
import torch

_TENSORS = "_tensors"
# A header is a few hundred bytes (a BeginRequest's prompt ids are the largest); a bigger one is a
# malformed or hostile peer, refused before msgpack allocates anything for it.
MAX_HEADER_BYTES = 16 * 2**20
ALIGN = 64  # received tensors start at a multiple of this many bytes (torch's own allocations do)
_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class CodecError(ValueError):
    """A message that does not follow the wire format."""


_NAMES = {dt: name for name, dt in _DTYPES.items()}


# numpy has no bfloat16: its bytes travel through an int16 view (same size, no copy)
_NUMPY_VIEW = {torch.bfloat16: torch.int16}
# Received tensors are wrapped through numpy: two cheap calls where torch.frombuffer + view cost
# several times more on a process just woken (the per-layer case).
_NUMPY = {dt: torch.empty(0, dtype=_NUMPY_VIEW.get(dt, dt)).numpy().dtype for dt in _DTYPES.values()}


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is already a contiguous CPU tensor: the per-layer
    case takes two torch calls (each costs tens of µs in a process just woken)."""
    view = _NUMPY_VIEW.get(t.dtype)
    if not t.requires_grad:
        try:
            return memoryview((t if view is None else t.view(view)).numpy()).cast("B")
        except (TypeError, RuntimeError):  # another device, not contiguous or empty: the cast refuses
            pass
    if t.numel() == 0:
        return memoryview(b"")
    t = t.detach().contiguous().cpu()
    return memoryview((t if view is None else t.view(view)).numpy()).cast("B")


def encode(header: dict[str, Any], tensors: list[torch.Tensor] = ()) -> list:
    meta = []
    for t in tensors:
        name = _NAMES.get(t.dtype)
        if name is None:
            raise CodecError(f"dtype {t.dtype} cannot travel")
        meta.append([name, list(t.shape)])
    return [msgpack.packb({**header, _TENSORS: meta}), *(_raw(t) for t in tensors)]


def _buffer(frame) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def decode(frames: list) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Every frame is untrusted: anything that is not exactly this wire format raises CodecError
    (and nothing else), so a node can drop it with one log line and go on."""
    if not frames:
        raise CodecError("empty message")
    head = _buffer(frames[0])
    if head.nbytes > MAX_HEADER_BYTES:
        raise CodecError(f"header frame of {head.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head)
    except Exception as exc:  # a malformed peer must not kill the node
        raise CodecError(f"bad header frame: {exc}") from exc
    if not isinstance(header, dict):
        raise CodecError(f"header is a {type(header).__name__}, not a map")
    meta = header.pop(_TENSORS, None)
    if not isinstance(meta, list):
        raise CodecError(f"header's {_TENSORS!r} is not a list")
    if len(meta) != len(frames) - 1:
        raise CodecError(f"header names {len(meta)} tensors but {len(frames) - 1} frames follow")
    return header, [_tensor(entry, frame) for entry, frame in zip(meta, frames[1:], strict=True)]


def _tensor(entry, frame) -> torch.Tensor:
    if not (type(entry) is list and len(entry) == 2 and type(entry[1]) is list):
        raise CodecError(f"tensor entry {entry!r:.80} is not [dtype, shape]")
    name, shape = entry
    dtype = _DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise CodecError(f"unknown dtype {name!r:.40}")
    for s in shape:
        if type(s) is not int or not 0 <= s < 2**40:  # `type(s) is int`: a bool is no size
            raise CodecError(f"bad shape {shape!r:.80}")
    buf = _buffer(frame)
    expected = dtype.itemsize * math.prod(shape)
    if buf.nbytes != expected:
        raise CodecError(f"tensor frame has {buf.nbytes} bytes, {name}{shape} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    array = np.frombuffer(buf, dtype=_NUMPY[dtype]).reshape(shape)
    if buf.readonly:
        with warnings.catch_warnings():
            # from_numpy warns that bytes are read-only; read-only is this module's contract.
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(array)
    else:  # a received ZeroMQ frame: writable memory, nothing to warn about
        t = torch.from_numpy(array)
    if t.data_ptr() % ALIGN:
        # ZeroMQ keeps a long message's bytes right after its own header (8 bytes off a 16-byte
        # boundary here), and the CPU's float32 matmul rounds otherwise for rows that start off a
        # 16-byte boundary (AMD EPYC, MKL: other last bits than transformers' aligned rows). A copy
        # is aligned like every tensor torch allocates; a layer's rows are a few KiB.
        t = t.clone()
    return t.view(dtype) if dtype in _NUMPY_VIEW else t
