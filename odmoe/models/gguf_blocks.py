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
        values, nbytes = _BLOCK[ggml_type]
        blocks = raw.view(-1, nbytes)
        out = {Q8_0: _q8_0, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}[ggml_type](blocks)
        return out.view(shape)
    return torch.from_numpy(_gguf_dequantize(raw.numpy(), ggml_type, shape))


def _gguf_dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    values = gguf_dequantize(raw.reshape(*shape[:-1], -1), GGMLQuantizationType(ggml_type))
    return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block, as float32 [n, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)  # [n, 1]
    x = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n, 32]
    return x * d


def _shifts(values: list[int], like: torch.Tensor, groups: int) -> torch.Tensor:
    """Right-shift amounts [1, 1, groups, 1] on `like`'s device."""
    return torch.tensor(values, dtype=torch.uint8, device=like.device).view(1, 1, groups, 1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> ([n, 8], [n, 8]) (the package's unpacking)."""
    scales = scales.reshape(-1, 3, 4)
    d, m, m_d = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mins


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d * scale, dmin * min) per sub-block of 32, [n, 8, 1] each."""
    n = blocks.shape[0]
    sc, mins = _scale_min_k4(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc.float()).view(n, -1, 1)
    dm = (_f16(blocks, 2) * mins.float()).view(n, -1, 1)
    return d, dm


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dm = _k_scales(blocks)
    qs = blocks[:, 16:].reshape(n, -1, 1, 32) >> _shifts([0, 4], blocks, 2)  # [n, 4, 2, 32]: low, then high
    q = (qs & 0x0F).reshape(n, -1, 32).float()  # [n, 8, 32]
    return (d * q - dm).view(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dm = _k_scales(blocks)
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    low = (qs.reshape(n, -1, 1, 32) >> _shifts([0, 4], blocks, 2)) & 0x0F
    high = (qh.reshape(n, -1, 1, 32) >> _shifts(list(range(8)), blocks, 8)) & 0x01
    q = (low.reshape(n, -1, 32) | (high.reshape(n, -1, 32) << 4)).float()
    return (d * q - dm).view(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = (_f16(blocks, 208) * scales).view(n, QK_K // 16, 1)
    low = ((ql.reshape(n, -1, 1, 64) >> _shifts([0, 4], blocks, 2)) & 0x0F).reshape(n, -1, 32)
    high = ((qh.reshape(n, -1, 1, 32) >> _shifts([0, 2, 4, 6], blocks, 4)) & 0x03).reshape(n, -1, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, QK_K // 16, -1).float()
    return (d * q).view(n, QK_K)
