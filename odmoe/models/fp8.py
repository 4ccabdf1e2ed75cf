"""Block-wise FP8 checkpoints as published (DeepSeek-V3, Kimi-K2, the Qwen3 / GLM FP8 releases).

Such a checkpoint stores a quantized matrix as `NAME.weight` in float8 (e4m3) with
`NAME.weight_scale_inv`, one float32 scale per block of `weight_block_size` (128 x 128 as
released), and says so in its config's `quantization_config` (`quant_method: fp8`). Tensors
without a scale (norms, embeddings, routers, lm_head) are stored as they are.

Contract: `block_fp8(config)` is the checkpoint's FP8 layout, None when it is not quantized;
another quantization method raises `UnsupportedModelError`. `dequantize(q, scale_inv)` is the
float32 product transformers computes when it loads the checkpoint on a machine without FP8 kernels
(`Fp8Dequantize`: the weight and its block's scale both in float32, multiplied), so casting it to a
parameter's dtype gives that parameter's bits exactly. `QuantizedExpert` is one routed expert as
stored: a worker keeps it so in host memory (one byte a weight, plus the scales) and dequantizes
it as it loads it into a slot, on the slot's device (an elementwise product, rounded alike on a CPU
and a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from odmoe.models.families import UnsupportedModelError

SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class BlockFp8:
    block: tuple[int, int] | None  # weight_block_size; None: read from each scale grid's shape


def quantization_of(config) -> dict:
    """A config's `quantization_config` as a dict ({} when it has none)."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return {}
    return quantization if isinstance(quantization, dict) else quantization.to_dict()


def block_fp8(config) -> BlockFp8 | None:
    q = quantization_of(config)
    if not q:
        return None
    method = q.get("quant_method", "?")
    if method == "mxfp4":
        return None  # gpt-oss's experts: odmoe.models.mxfp4
    if method != "fp8":
        raise UnsupportedModelError(
            f"a {method!r}-quantized checkpoint is not served; odmoe serves unquantized weights, "
            "block-wise FP8 (quant_method fp8) and gpt-oss's MXFP4 experts; convert it to bf16/fp16/fp32 "
            "safetensors first"
        )
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModelError("FP8 checkpoints with static activation scales are not served")
    block = q.get("weight_block_size")
    return BlockFp8(tuple(block) if block else None)


def scale_key(weight_key: str) -> str:
    """`x.weight` -> `x.weight_scale_inv`."""
    return weight_key + SCALE_SUFFIX


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The float32 matrix transformers dequantizes `q` [rows, cols] to, before casting it."""
    rows, cols = q.shape[-2:]
    scale_rows, scale_cols = scale_inv.shape[-2:] if scale_inv.dim() >= 2 else (1, 1)
    if rows % scale_rows or cols % scale_cols:
        raise ValueError(
            f"FP8 weight {tuple(q.shape)} is not divisible by its scale grid {tuple(scale_inv.shape)}"
        )
    if scale_inv.dtype == torch.uint8:  # E8M0 exponents stored as bytes: the scale is 2 ** (byte - 127)
        scales = (scale_inv.to(torch.float32) - 127.0).exp2()
    else:
        scales = scale_inv.to(torch.float32)
    blocks = q.to(torch.float32).reshape(-1, scale_rows, rows // scale_rows, scale_cols, cols // scale_cols)
    product = blocks * scales.reshape(-1, scale_rows, scale_cols).unsqueeze(-1).unsqueeze(2)
    return product.reshape(q.shape)


@dataclass(frozen=True)
class QuantizedMatrix:
    q: torch.Tensor  # float8
    scale_inv: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale_inv.numel() * self.scale_inv.element_size()

    def to(self, device: torch.device) -> QuantizedMatrix:
        return QuantizedMatrix(
            self.q.to(device, non_blocking=True), self.scale_inv.to(device, non_blocking=True)
        )

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.q, self.scale_inv).to(dtype)


@dataclass(frozen=True)
class QuantizedExpert:
    """One routed expert as an FP8 checkpoint stores it (gate and up apart, as on disk)."""

    gate: QuantizedMatrix  # [I, H]
    up: QuantizedMatrix  # [I, H]
    down: QuantizedMatrix  # [H, I]
    form = "fp8"

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    @property
    def shapes(self) -> tuple[torch.Size, torch.Size]:
        """(gate_up [2I, H], down [H, I]): the fused layout transformers computes with."""
        rows, cols = self.gate.q.shape
        return torch.Size([rows + self.up.q.shape[0], cols]), self.down.q.shape

    def load_into(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Dequantize into a slot's tensors, on their device: gate rows first, as transformers fuses them."""
        device, dtype, rows = gate_up.device, gate_up.dtype, self.gate.q.shape[0]
        gate_up[:rows].copy_(self.gate.to(device).dequantized(dtype))
        gate_up[rows:].copy_(self.up.to(device).dequantized(dtype))
        down.copy_(self.down.to(device).dequantized(down.dtype))
