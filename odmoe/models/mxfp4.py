"""MXFP4 experts as gpt-oss is published (`quant_method: mxfp4`).

The release stores each expert matrix W [out, in] as `*_blocks` (uint8, two 4-bit e2m1 values a
byte, low nibble first, 16 bytes = 32 values a block along `in`) and `*_scales` (uint8 E8M0: one
power of two, 2 ** (byte - 127), per block); everything else (attention, router, embeddings, the
experts' biases) is bf16. transformers without MXFP4 kernels (a CPU without triton) dequantizes at
load — the 4-bit value from its table times the block's power of two, then W transposed to gpt-oss's
[in, out] layout — and that is what odmoe matches: every product is exact in bf16 and float32 alike
(a 4-bit value times a power of two), so `dequantize` gives transformers' numbers in either.

Contract: `dequantize(blocks, scales)` -> float32 [out, in]; `Mxfp4Expert` is one gpt-oss expert as
stored (a worker keeps it so: ~0.53 bytes a weight with its scales) and dequantizes into a slot in
the gpt-oss layout (odmoe.models.expert_math.ExpertMLP: transposed, the bias as one more row) on the
slot's device. `quantize(w)` makes MXFP4 blocks by the OCP MX rule (a block's scale is its largest
magnitude's power of two less e2m1's largest exponent; values rounded to the nearest e2m1), for the
test checkpoints odmoe's factory makes (transformers' own MXFP4 quantizer needs triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
_E2M1_MAX_EXPONENT = 2  # 6.0 = 1.5 * 2**2


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [out, G, 16] uint8 and scales [out, G] uint8 -> float32 [out, G * 32]."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    values = torch.empty(*b.shape[:-1], b.shape[-1] * 2, dtype=torch.float32, device=b.device)
    values[..., 0::2] = lut[(b & 0x0F).long()]
    values[..., 1::2] = lut[(b >> 4).long()]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponents.unsqueeze(-1).to(torch.float32))
    return values.reshape(*b.shape[:-2], b.shape[-2] * b.shape[-1] * 2)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (in a multiple of 32) -> (blocks [out, in/32, 16] uint8, scales [out, in/32] uint8)."""
    rows, cols = w.shape
    if cols % BLOCK:
        raise ValueError(f"MXFP4 needs the input width to be a multiple of {BLOCK}, got {cols}")
    x = w.to(torch.float32).reshape(rows, cols // BLOCK, BLOCK)
    amax = x.abs().amax(-1)
    exponent = (
        torch.where(amax > 0, torch.floor(torch.log2(amax)), torch.zeros_like(amax)) - _E2M1_MAX_EXPONENT
    )
    exponent = exponent.clamp(-127, 127)
    scaled = x / torch.exp2(exponent).unsqueeze(-1)
    table = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    magnitude = (scaled.abs().unsqueeze(-1) - table).abs().argmin(-1)  # nearest of 0 .. 6
    codes = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    codes = codes.reshape(rows, cols // BLOCK, BLOCK // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


@dataclass(frozen=True)
class Mxfp4Matrix:
    blocks: torch.Tensor  # [out, G, 16] uint8
    scales: torch.Tensor  # [out, G] uint8
    bias: torch.Tensor  # [out]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.blocks, self.scales, self.bias))

    def into(self, slot: torch.Tensor) -> None:
        """slot [in + 1, out] := W transposed, then the bias row (gpt-oss's expert layout)."""
        device = slot.device
        w = dequantize(self.blocks.to(device, non_blocking=True), self.scales.to(device, non_blocking=True))
        slot[:-1].copy_(w.t())
        slot[-1].copy_(self.bias.to(device))


@dataclass(frozen=True)
class Mxfp4Expert:
    """One gpt-oss expert as the MXFP4 release stores it."""

    gate_up: Mxfp4Matrix  # W [2I, H] (gate and up interleaved along 2I), bias [2I]
    down: Mxfp4Matrix  # W [H, I], bias [H]
    form = "mxfp4"

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    @property
    def shapes(self) -> tuple[torch.Size, torch.Size]:
        """(gate_up [H + 1, 2I], down [I + 1, H]): the slots' gpt-oss layout."""
        out_gu, groups_gu = self.gate_up.scales.shape
        out_d, groups_d = self.down.scales.shape
        return torch.Size([groups_gu * BLOCK + 1, out_gu]), torch.Size([groups_d * BLOCK + 1, out_d])

    def load_into(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up.into(gate_up)
        self.down.into(down)
