"""What the shadow would hold at each precision, and which precision `shadow.precision=auto` picks.

Contract: both functions are pure and run before anything is read from the checkpoint.
- `shadow_weight_bytes(shapes, precision)` is the bytes of weights a shadow at `precision` holds,
  from its tensors' shapes alone (`WeightShape`s, listed by `odmoe.shadow.shadow_model.weight_shapes`
  from the model's `meta` skeleton, whose shapes are the checkpoint's or loading fails). It counts
  what each kernel keeps: fbgemm's packed int8 weights and their column offsets, bitsandbytes' row
  statistics and NF4 block scales (nested), int4's packed nibbles and group-wise bf16 scales and zeros.
- `choose_precision(estimates, memory_bytes, device_type)` is auto's rule: on a CPU torch's dynamic
  int8 (the fastest CPU shadow) when its weights plus `PROCESS_BYTES` fit the node's memory, else
  int4; on CUDA bitsandbytes int8, else NF4 — the first that fits, the smaller where none does (the
  shadow only predicts: a smaller one that runs beats none).

What stays unquantized at every quantized precision: the routers (they decide the predictions), norms
and biases in float32, the embedding at the checkpoint's dtype (a lookup, not a matmul); the vocabulary
head is quantized with the linears for int8_dynamic and int4 (at a real vocabulary it is the largest
matrix) and kept in float32 for bitsandbytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "int8", "nf4", "int8_dynamic", "int4")
QUANTIZED = ("int8", "nf4", "int8_dynamic", "int4")  # linears replaced, experts unfused
CPU_ONLY = ("int8_dynamic", "int4")  # torch's CPU kernels
HEAD_QUANTIZED = ("int8_dynamic", "int4")
AUTO_CHOICES = {"cpu": ("int8_dynamic", "int4"), "cuda": ("int8", "nf4")}  # preferred first
# What a shadow process needs besides its weights: torch and transformers imported (~0.5 GiB), the
# KV cache and activations, one layer at full precision while it loads
PROCESS_BYTES = 1 << 30
INT4_GROUPS = (64, 32)  # along the input; the kernel also takes 128 and 256 (coarser, less exact)
INT4_ROWS = 16  # the kernel packs output rows by 16
NF4_BLOCK = 64  # bitsandbytes' default: one absmax per 64 weights, itself quantized to a byte
NF4_LINEAR_BYTES = 1280  # per linear: the nf4 and nested code books (16 + 256 float32) and their state
_FLOAT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class WeightShape:
    """One tensor of the model as the shadow holds it.

    kind: "linear" (an nn.Linear's weight, shape (out, in)); "experts" (a fused experts parameter,
    shape (experts, out, in) of each expert's linear once unfused); "head" (the vocabulary head,
    (vocab, hidden)); "embedding"; "other" (routers, norms, biases, buffers; anything kept in float).
    """

    kind: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def int4_group(out_features: int, in_features: int) -> int | None:
    """The group size an int4 linear of this shape is quantized with, or None where torch's CPU
    kernel cannot take it (the linear then stays in float)."""
    if out_features % INT4_ROWS:
        return None
    return next((g for g in INT4_GROUPS if in_features % g == 0), None)


def linear_bytes(out_features: int, in_features: int, precision: str) -> int:
    """Bytes one bias-free linear's weight takes at a quantized precision."""
    n = out_features * in_features
    if precision == "int8_dynamic":
        return n + 4 * out_features  # int8 packed by fbgemm + int32 column offsets
    if precision == "int8":
        return n + 4 * out_features  # int8 + float32 row statistics (SCB)
    if precision == "nf4":  # nibbles + a uint8 absmax per block (nested) + the linear's own code books
        return n // 2 + -(-n // NF4_BLOCK) + NF4_LINEAR_BYTES
    if precision == "int4":
        group = int4_group(out_features, in_features)
        if group is None:
            return 4 * n
        return n // 2 + 2 * 2 * out_features * (in_features // group)  # nibbles + bf16 scale, zero
    raise ValueError(f"{precision!r} is not a quantized precision")


def shadow_weight_bytes(shapes: Iterable[WeightShape], precision: str, embedding_itemsize: int = 2) -> int:
    """Bytes of weights the shadow holds at `precision` (module contract). `embedding_itemsize`:
    bytes per element of the checkpoint's embedding, which the quantized precisions keep as stored."""
    if precision in _FLOAT_BYTES:
        return sum(s.numel for s in shapes) * _FLOAT_BYTES[precision]
    total = 0
    for s in shapes:
        if s.kind == "linear" or (s.kind == "head" and precision in HEAD_QUANTIZED):
            total += linear_bytes(s.shape[-2], s.shape[-1], precision)
        elif s.kind == "experts":
            total += s.shape[0] * linear_bytes(s.shape[1], s.shape[2], precision)
        elif s.kind == "embedding":
            total += s.numel * embedding_itemsize
        else:
            total += s.numel * 4
    return total


def choose_precision(estimates: dict[str, int], memory_bytes: int, device_type: str) -> str:
    """auto's choice (module contract): `estimates` holds `shadow_weight_bytes` of each of the
    device's choices; `device_type` is "cpu" or "cuda"."""
    choices = AUTO_CHOICES["cuda" if device_type == "cuda" else "cpu"]
    return next((p for p in choices if estimates[p] + PROCESS_BYTES <= memory_bytes), choices[-1])


def why_chosen(choice: str, estimates: dict[str, int], memory_bytes: int, device_type: str) -> str:
    """The reason `choose_precision` gave `choice`, in words for the log line."""
    choices = AUTO_CHOICES["cuda" if device_type == "cuda" else "cpu"]
    need = estimates[choice] + PROCESS_BYTES
    if need <= memory_bytes:
        passed = choices[: choices.index(choice)]
        missed = "".join(f"{p} needs {_gib(estimates[p] + PROCESS_BYTES)}, more than that; " for p in passed)
        return f"{missed}its weights + {_gib(PROCESS_BYTES)} for the process fit"
    return f"nothing fits (the smallest needs {_gib(need)}): the smallest is loaded"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
