"""Split a float tensor's bits into an exponent byte stream and the remaining bytes, and join them back.

Contract: `split(t)` returns `(exponent, rest)` as uint8 arrays: `exponent[n]` is one byte per element,
`rest[n, b]` the element's other `b = itemsize - 1` bytes; `join_into(dest, exponent, rest)` writes
the identical bits back into `dest`'s memory. Lossless for every bit pattern (NaN payloads, +-Inf,
-0.0, subnormals) because it only moves bits; it never looks at values.

How: rotate each element's bits left by one, so the sign drops to the lowest bit. For bfloat16
(s|e8|m7) and float32 (s|e8|m23) the top byte is then exactly the 8-bit exponent and the low bytes
are mantissa + sign; for float16 (s|e5|m10) the top byte is the 5-bit exponent and the top 3 mantissa
bits. Entropy coding that byte costs about H(exponent) + 3 bits there, the same as storing those 3
near-random bits raw, and every stream stays byte-aligned (no bit packing). Everything is numpy
vector ops on uint16/uint32 views: no Python loop over elements.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

# dtype -> the unsigned little-endian integer view of its bits
_UINT: dict[torch.dtype, np.dtype] = {
    torch.bfloat16: np.dtype("<u2"),
    torch.float16: np.dtype("<u2"),
    torch.float32: np.dtype("<u4"),
}
DTYPES = tuple(_UINT)


class UnsupportedDtypeError(ValueError):
    """Only the float dtypes odmoe serves have a bit layout here."""


def _uint(dtype: torch.dtype) -> np.dtype:
    if sys.byteorder != "little":  # every view below assumes the host stores tensors little-endian
        raise RuntimeError("odmoe's bit-field split assumes a little-endian host")
    if dtype not in _UINT:
        raise UnsupportedDtypeError(f"no bit-field split for {dtype} (only {', '.join(map(str, DTYPES))})")
    return _UINT[dtype]


def byte_view(t: torch.Tensor) -> np.ndarray:
    """t's memory as uint8 [n, itemsize] (a view: writing it writes t). t must be a contiguous CPU tensor."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("byte_view needs a contiguous CPU tensor")
    flat = t.reshape(-1)
    return flat.view(torch.uint8).numpy().reshape(flat.numel(), t.element_size())


def split(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(exponent [n] uint8, rest [n, itemsize-1] uint8) of a contiguous CPU float tensor."""
    u = _uint(t.dtype)
    bits = byte_view(t).view(u).reshape(-1)  # [n]
    width = u.itemsize * 8
    rotated = (bits << np.array(1, u)) | (bits >> np.array(width - 1, u))  # sign to the lowest bit
    as_bytes = rotated.view(np.uint8).reshape(-1, u.itemsize)  # little-endian: last byte is the top
    return np.ascontiguousarray(as_bytes[:, -1]), np.ascontiguousarray(as_bytes[:, :-1])


def join_into(dest: np.ndarray, exponent: np.ndarray, rest: np.ndarray, dtype: torch.dtype) -> None:
    """Write the elements whose split was (exponent, rest) into dest ([n, itemsize] uint8, e.g. a
    `byte_view` slice of the destination tensor)."""
    u = _uint(dtype)
    n = dest.shape[0]
    if exponent.shape != (n,) or rest.shape != (n, u.itemsize - 1):
        raise ValueError(f"join_into: {n} elements but exponent {exponent.shape}, rest {rest.shape}")
    bits = dest.view(u).reshape(-1)  # [n], still dest's memory
    if u.itemsize == 2:
        # 16-bit: the rotated value is (exponent << 8) | rest, so the original is
        # (exponent << 7) | (rest >> 1) | (rest << 15), built straight into dest (about a third
        # faster than placing the bytes and rotating them: fewer passes over memory)
        r = rest.reshape(-1)
        np.left_shift(exponent, 7, out=bits, dtype=u)
        np.bitwise_or(bits, np.right_shift(r, 1, dtype=u), out=bits)
        np.bitwise_or(bits, np.left_shift(r, 15, dtype=u), out=bits)
        return
    dest[:, -1] = exponent
    dest[:, :-1] = rest
    width = u.itemsize * 8
    # rotate right by one: the sign goes back to the top bit (in place, in dest's memory)
    np.bitwise_or(bits >> np.array(1, u), bits << np.array(width - 1, u), out=bits)
