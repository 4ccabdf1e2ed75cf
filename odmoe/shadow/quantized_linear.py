"""The quantized linears the shadow is built of, each made from one full-precision weight.

Contract: `quantized_linear(weight [out, in], bias [out] | None, precision, device)` returns a module
computing `x @ weight.T + bias` approximately, holding only its quantized form (the caller frees the
weight). Precisions:
- int4: torch's CPU int4 weight-only kernel (`_weight_int4pack_mm_for_cpu`): two weights per byte,
  asymmetric per group of 64 (else 32) inputs with a bf16 scale and zero each; activations enter the
  kernel in bf16 and leave in the caller's dtype. A linear the kernel cannot take (outputs not a
  multiple of 16, inputs not of 32: only toy widths) stays in float.
- int8_dynamic: torch's dynamic int8 (fbgemm on x86: int8 weights packed once, activations quantized
  per call), made as `quantize_dynamic` makes it (per-tensor scale).
- int8 / nf4: bitsandbytes; the weight is quantized as it reaches `device` (a GPU), so the device
  never holds the full-precision copy.
`CastEmbedding` keeps an embedding at the checkpoint's dtype and hands out rows in the compute dtype.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from odmoe.shadow.precision import int4_group


class Int4Linear(nn.Module):
    """x @ W.T (+ b) with W held as group-wise asymmetric int4: w ≈ (q - 8) * scale + zero."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group = group
        packed, scales_and_zeros = int4_pack(weight, group)
        self.register_buffer("packed", packed)  # [out, in / 2] uint8
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [in / group, out, 2] bf16
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [T, in]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"


def int4_pack(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [out, in / 2] uint8, scales_and_zeros [in / group, out, 2] bf16) of a weight [out, in],
    in the layout torch's CPU int4 kernel reads. Scale and zero are rounded to bf16 first, so the
    nibbles are chosen against what the kernel will use."""
    out_features, in_features = weight.shape
    w = (
        weight.detach().to(torch.float32, copy=True).reshape(out_features, in_features // group, group)
    )  # [out, G, g]
    lo, hi = torch.aminmax(w, dim=-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    inverse = 1 / scale.float()
    offset = (8 * scale.float() - zero.float()) * inverse  # a nibble of 0 stands for zero - 8 * scale
    q = w.mul_(inverse).add_(offset).round_().clamp_(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out_features, in_features), 1)
    scales_and_zeros = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [G, out, 2]
    return packed, scales_and_zeros


class FlatRows(nn.Module):
    """A linear fed [..., in] with more than 3 dims sees [rows, in]: bitsandbytes' CPU int8 matmul
    fails on 4-D inputs, which MLA gives its `kv_b_proj` ([B, 1, S, kv_lora_rank]). Row-wise
    quantization does not depend on the batch shape, so the result is what a 2-D call gives."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() <= 3:
            return self.linear(x)
        return self.linear(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


class CastEmbedding(nn.Module):
    """An embedding table kept as stored (bf16 in most checkpoints), its rows handed out in the
    model's compute dtype. The table is a buffer, not a parameter, so `model.dtype` (the first
    parameter's) stays the compute dtype."""

    def __init__(self, weight: torch.Tensor, padding_idx: int | None, compute_dtype: torch.dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx
        self.compute_dtype = compute_dtype
        self.register_buffer("weight", weight.detach())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx).to(self.compute_dtype)


def quantized_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, precision: str, device: torch.device | None = None
) -> nn.Module:
    """The module contract's one linear at `precision` (on `device`; None: the CPU)."""
    if precision == "int4":
        group = int4_group(*weight.shape)
        if group is None:
            return float_linear(weight, bias)
        return Int4Linear(weight, bias, group)
    if precision == "int8_dynamic":
        return _dynamic_int8_linear(weight, bias)
    if precision in ("int8", "nf4"):
        return _bitsandbytes_linear(weight, bias, precision, device or torch.device("cpu"))
    raise ValueError(f"{precision!r} is not a quantized precision")


def float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach().float().contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
    return linear


def _dynamic_int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear
    from torch.ao.quantization import default_dynamic_qconfig

    observer = default_dynamic_qconfig.weight()  # what quantize_dynamic gives an nn.Linear: per tensor
    w = weight.detach().float().contiguous()
    observer(w)
    scale, zero_point = observer.calculate_qparams()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantized tensors deprecated; they still work
        qweight = torch.quantize_per_tensor(w, float(scale), int(zero_point), torch.qint8)
        del w
        # made 1 x 1 and resized: the constructor would pack a zero weight of the full size first
        # (as `from_float` does), doubling the load's packing time for nothing
        q = DynamicInt8Linear(1, 1, dtype=torch.qint8)
        q.in_features, q.out_features = qweight.shape[1], qweight.shape[0]
        q.set_weight_bias(qweight, None if bias is None else bias.detach().float())
    return q


_PACKED_NF4_BLOCK_N = 32  # bitsandbytes' _convert_weight_packed_for_cpu packs output rows by 32


def fits_packed_cpu_nf4(in_features: int, out_features: int, blocksize: int) -> bool:
    """Pure: whether bitsandbytes' packed CPU nf4 kernel can take this linear (whole blocks per row,
    output rows in whole packs)."""
    return in_features % blocksize == 0 and out_features % _PACKED_NF4_BLOCK_N == 0


def _bitsandbytes_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, precision: str, device: torch.device
) -> nn.Module:
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    w = weight.detach().float()
    q: nn.Module
    if precision == "int8":
        q = bnb.nn.Linear8bitLt(
            in_features, out_features, bias=bias is not None, has_fp16_weights=False, threshold=0.0
        )
        q.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    else:
        q = bnb.nn.Linear4bit(
            in_features, out_features, bias=bias is not None, compute_dtype=torch.float32, quant_type="nf4"
        )
        q.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
        if not fits_packed_cpu_nf4(in_features, out_features, q.weight.blocksize):
            # bitsandbytes repacks nf4 weights for its AVX512-BF16 CPU kernel on the first forward,
            # which only takes rows of whole blocks (and crashes on e.g. a 32-wide LoRA input);
            # such a linear keeps the generic nf4 path, the same on every CPU
            q.support_avx512bf16_for_cpu = False
    if bias is not None:
        q.bias = nn.Parameter(bias.detach().float(), requires_grad=False)
    return q.to(device)  # quantizes as it reaches the device
