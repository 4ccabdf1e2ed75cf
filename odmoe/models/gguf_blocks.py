"""GGUF blocks -> float32 values, bit for bit what the `gguf` package's `dequantize` gives.

Contract: `dequantize(raw, ggml_type, shape)` takes a tensor's bytes as a GGUF file stores them
(uint8, whole rows of whole blocks) and returns float32 values of `shape`, equal to the bit to
`gguf.dequantize` — the function transformers' GGUF loader calls, so the numbers transformers loads.
The types a downloaded MoE file mostly holds (F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K) are done here
with torch, the same float32 operations in the same order as the package's numpy (a product, then a
difference: no fused multiply-add, so each result rounds as numpy's does) on all of torch's threads
— the package's numpy takes ~240 ms for one Qwen3-shaped Q4_K expert (11 M weights) on one core,
which would cost more than the link bytes Q4_K saves. Every other type goes to the package itself.
`tests/test_gguf_checkpoint.py` holds the two equal on every byte pattern.

`dequantize_into(raw, ggml_type, out)` writes the same values into a worker's slot (cast as `copy_`
casts where the slot is not float32): for the block types it works in place in `out` (float32) or
through a small reused chunk, 1 MiB of values at a time, because a fresh 44 MB float32 result per
load cost more in page faults (~25 ms of first touches per Qwen3-shaped expert on a 2-core box) than
the arithmetic, and a chunk's steps stay in the cache. Q4_K's nibbles and 6-bit scales are unpacked
four bytes at a time on int32 words. One Qwen3-shaped Q4_K expert (11 M weights): 175 ms through
`dequantize`, ~22 ms through `dequantize_into`, one thread (`python -m odmoe_bench.gguf_link`
measures it in a cluster).
"""

from __future__ import annotations

import numpy as np
import torch

QK_K = 256  # values in a K-quant super-block
# ggml type ids (gguf.GGMLQuantizationType), here so the fast path needs no import of the package
F32, F16, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 8, 12, 13, 14, 30
_BLOCK = {Q8_0: (32, 34), Q4_K: (QK_K, 144), Q5_K: (QK_K, 176), Q6_K: (QK_K, 210)}


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw` uint8 bytes stored as `ggml_type` -> float32 [shape] (module contract), on `raw`'s
    device: a worker moves the stored bytes to its slot's device and dequantizes them there."""
    raw = raw.contiguous().view(-1)
    if raw.device.type != "cpu" and ggml_type not in (F32, BF16, *_BLOCK):  # the package: numpy
        return dequantize(raw.cpu(), ggml_type, shape).to(raw.device)
    if ggml_type == F32:
        return raw.view(torch.float32).view(shape).clone()
    if ggml_type == F16:  # numpy's conversion: a NaN keeps its payload as the package's does
        values = torch.from_numpy(raw.cpu().numpy().view(np.float16).astype(np.float32)).view(shape)
        return values.to(raw.device)
    if ggml_type == BF16:  # the package: int16 -> int32 << 16, as float32
        return (raw.view(torch.int16).to(torch.int32) << 16).view(torch.float32).view(shape)
    if ggml_type in _BLOCK:
        out = torch.empty(shape, dtype=torch.float32, device=raw.device)
        dequantize_into(raw, ggml_type, out)
        return out
    return torch.from_numpy(_gguf_dequantize(raw.numpy(), ggml_type, shape))


def dequantize_into(raw: torch.Tensor, ggml_type: int, out: torch.Tensor) -> None:
    """`out[...] = dequantize(raw, ggml_type, out.shape)` cast to `out`'s dtype (module contract)."""
    into = _INTO.get(ggml_type)
    if into is None or raw.device != out.device or not out.is_contiguous():
        out.copy_(dequantize(raw, ggml_type, tuple(out.shape)))
        return
    values, nbytes = _BLOCK[ggml_type]
    blocks, flat = raw.contiguous().view(-1, nbytes), out.view(-1, values)
    if blocks.storage_offset() % 4:  # Q4_K's word-wise path reads whole int32 words
        blocks = blocks.clone()
    # on a CPU a chunk at a time: its steps stay in the cache; a slot of another dtype takes each
    # chunk by one cast. An accelerator does each step on the whole tensor (one launch per step).
    step = max(1, _CHUNK_VALUES // values) if out.device.type == "cpu" else len(blocks)
    direct = out.dtype == torch.float32
    chunk = None if direct else torch.empty(min(step, len(blocks)), values, device=out.device)
    for first in range(0, len(blocks), step):
        part = blocks[first : first + step]
        target = flat[first : first + step] if chunk is None else chunk[: len(part)]
        into(part, target)
        if chunk is not None:
            flat[first : first + step].copy_(target)


_CHUNK_VALUES = 1 << 18  # 1 MiB of float32: in cache, and a temporary the allocator reuses (no page faults)


def _gguf_dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    values = gguf_dequantize(raw.reshape(*shape[:-1], -1), GGMLQuantizationType(ggml_type))
    return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block, as float32 [n, 1]. On a CPU through numpy, as the
    package converts: torch's own conversion gives a NaN scale another payload when `blocks` is few
    (its scalar path; the vectorized one keeps it), so a small chunk would differ in NaN bits."""
    halves = blocks[:, at : at + 2].contiguous()
    if halves.device.type == "cpu":
        return torch.from_numpy(halves.numpy().view(np.float16).astype(np.float32))
    return halves.view(torch.float16).float()


def _shifts(values: list[int], like: torch.Tensor, groups: int) -> torch.Tensor:
    """Right-shift amounts [1, 1, groups, 1] of `like`'s dtype, on its device."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).view(1, 1, groups, 1)


# -- each block type written into a given float32 [n, block values] tensor --------------------------
# The package's numpy operations in its order: the integers unpacked exactly (here four bytes at a
# time where a block is whole int32 words), then per value a product and a difference done in place
# in `out` (x * d is d * x in IEEE arithmetic; nothing is fused), so every value rounds as numpy's.
def _q8_0_into(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(_f16(blocks, 0))


def _q4_k_into(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    words = blocks.view(torch.int32)  # [n, 36]: 144 bytes, little-endian, each op on 4 bytes at once
    d, dm = _k_scales_words(blocks, words[:, 1:4])
    # the 128 bytes of nibbles: low then high nibbles of each 32 bytes -> sub-blocks 2j and 2j + 1
    qs = words[:, 4:].view(n, 4, 1, 8)
    nibbles = torch.cat([qs & 0x0F0F0F0F, (qs >> 4) & 0x0F0F0F0F], dim=2)  # [n, 4, 2, 8] words
    out.view(n, -1).copy_(nibbles.view(n, -1).view(torch.uint8))
    out.view(n, -1, 32).mul_(d).sub_(dm)


def _k_scales_words(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d * scale, dmin * min) per sub-block of 32, [n, 8, 1] each, from the 12 bytes of 6-bit scales
    and mins as 3 int32 words [n, 3]: the package's byte operations (its `get_scale_min`) done on
    four bytes at once (a shift then a mask per byte keeps every bit in its own byte)."""
    n = blocks.shape[0]
    d, m, m_d = scales[:, 0:1], scales[:, 1:2], scales[:, 2:3]
    sc = torch.cat([d & 0x3F3F3F3F, (m_d & 0x0F0F0F0F) | ((d >> 2) & 0x30303030)], dim=1)
    mins = torch.cat([m & 0x3F3F3F3F, ((m_d >> 4) & 0x0F0F0F0F) | ((m >> 2) & 0x30303030)], dim=1)
    d_sc = (_f16(blocks, 0) * sc.view(torch.uint8).float()).view(n, -1, 1)
    d_min = (_f16(blocks, 2) * mins.view(torch.uint8).float()).view(n, -1, 1)
    return d_sc, d_min


def _q5_k_into(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    words = blocks.view(torch.int32)  # [n, 44]: 176 bytes
    d, dm = _k_scales_words(blocks, words[:, 1:4])
    # bit k of each of the 32 high-bit bytes is the fifth bit of sub-block k's value
    qh, qs = words[:, 4:12].view(n, 1, 8), words[:, 12:].view(n, 4, 1, 8)
    high = ((qh >> _shifts(list(range(8)), words, 8).view(1, 8, 1)) & 0x01010101) << 4  # [n, 8, 8]
    low = torch.cat([qs & 0x0F0F0F0F, (qs >> 4) & 0x0F0F0F0F], dim=2).view(n, 8, 8)
    out.view(n, -1).copy_((low | high).view(n, -1).view(torch.uint8))
    out.view(n, -1, 32).mul_(d).sub_(dm)


def _q6_k_into(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = (_f16(blocks, 208) * scales).view(n, QK_K // 16, 1)
    low = ((ql.reshape(n, -1, 1, 64) >> _shifts([0, 4], blocks, 2)) & 0x0F).reshape(n, -1, 32)
    high = ((qh.reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], blocks, 4)) & 0x03).reshape(n, -1, 32)
    out.view(n, QK_K // 16, -1).copy_(((low | (high << 4)).view(torch.int8) - 32).view(n, QK_K // 16, -1))
    out.view(n, QK_K // 16, -1).mul_(d)


_INTO = {Q8_0: _q8_0_into, Q4_K: _q4_k_into, Q5_K: _q5_k_into, Q6_K: _q6_k_into}
