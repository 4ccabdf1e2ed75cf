"""Several requests' rows of one expert in one call, each request's bits its own.

Contract: `StackedSegments().forward(x, segments, gate_up, down, mlp, kernel, grouped_shape)` returns
what `expert_forward` gives each segment of x's rows (`segments`: the row counts of the requests
that route to this expert in a decode exchange, in order) computed alone, concatenated. It computes
them in one call where that call is proven to give those bits, else one call per segment as before.

Why this exists: in a batched decode exchange a worker computes an expert for every request that
routes to it, each request's rows apart, because a matmul's result for a row can depend on the rows
around it (a GEMM is not a GEMV). Apart, each request pays the expert's whole Python and dispatch
cost (two projections, a split, an activation, a product: ~5 ops). Two stacked calls keep every
segment's arithmetic its own:
- `grouped_mm` (transformers' default experts kernel): one grouped call with a group per segment,
  the weight repeated over the groups by a stride-0 view. On the CPU torch computes a grouped call
  group by group with one `mm` each, the very call a one-segment grouped call makes;
- `eager`, every segment one row: each projection a `bmm` of one-row matrices against the weight,
  as main's batched pass does (`odmoe.main.batched_decode`).
The activation and product between the projections run on all rows at once: elementwise, and each
row is its own loop of the gate's width (the gate is a strided half of the projection's columns, so
rows do not merge into one loop whose vector body and tail would split them otherwise).

Nothing above is taken on trust: the first time a shape is met (kernel, layout, segments, weights,
dtypes, device) the stacked result is compared bit for bit with the per-segment calls, on that input
and on 8 random inputs of the shape; if any bit differs, that shape is computed segment by segment
from then on (logged once). A BLAS or torch build that computes otherwise costs speed, never bits.
Kernels and layouts not listed (Llama 4's bmm, gpt-oss, CUDA's mirrored grouped calls) always go
segment by segment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from odmoe.models.expert_math import ExpertMLP, _activation, expert_forward
from odmoe.transport.codec import ALIGN

log = logging.getLogger("odmoe.worker")
__all__ = ["StackedSegments"]

SAMPLES = 8  # random inputs a shape's verdict is also taken on (one input proves little)


class StackedSegments:
    def __init__(self, samples: int = SAMPLES):
        self.samples = samples
        self.verdicts: dict[tuple, bool] = {}  # shape key -> the stacked call gives each segment's bits
        self.calls: dict[tuple, Callable] = {}  # shape key -> its stacked call, where the verdict is yes

    def forward(
        self,
        x: torch.Tensor,
        segments: list[int],
        gate_up: torch.Tensor,
        down: torch.Tensor,
        mlp: ExpertMLP,
        kernel: str,
        grouped_shape: tuple[int, int] | None = None,
        positions: list[int] | None = None,
    ) -> torch.Tensor:
        """x [sum(segments), H] -> [sum(segments), H]: each segment's rows as expert_forward alone
        (`positions`, "bmm" with one segment: the rows' token positions, as expert_forward takes them)."""
        if len(segments) == 1:
            return expert_forward(_aligned(x), gate_up, down, mlp, kernel, grouped_shape, positions)
        assert positions is None, "row positions are a one-segment (prefill) call's"
        key = (
            kernel, mlp.layout, tuple(segments), tuple(gate_up.shape), tuple(down.shape),
            x.dtype, gate_up.dtype, x.device.type,
        )  # fmt: skip
        verdict = self.verdicts.get(key)
        if verdict is False:
            return _apart(x, segments, gate_up, down, mlp, kernel, grouped_shape)
        x = _aligned(x)  # every row then starts where the shape puts it, as on the samples
        if verdict:  # the per-layer path: the call built once per shape, nothing checked again
            return self.calls[key](x, gate_up, down)
        stacked = _stacked_call(segments, mlp, kernel, x.device, grouped_shape)
        alone = _apart(x, segments, gate_up, down, mlp, kernel, grouped_shape)
        try:
            verdict = (
                stacked is not None
                and torch.equal(stacked(x, gate_up, down), alone)
                and self._agrees_on_samples(stacked, x, segments, gate_up, down, mlp, kernel, grouped_shape)
            )
        except RuntimeError as exc:  # a shape the stacked kernel refuses (bf16 rows not 16-byte strided)
            log.debug("stacked call refused: %s", exc)
            verdict = False
        self.verdicts[key] = verdict
        if verdict:
            self.calls[key] = stacked
        elif stacked is not None:
            log.info("expert %s x %s (%s, %s): stacked differs; apart", key[3], key[2], key[5], kernel)
        return alone

    def _agrees_on_samples(self, stacked, x, segments, gate_up, down, mlp, kernel, grouped_shape) -> bool:
        generator = torch.Generator(device=x.device).manual_seed(0)
        for _ in range(self.samples):
            sample = torch.randn(x.shape, generator=generator, device=x.device).to(x.dtype)
            apart = _apart(sample, segments, gate_up, down, mlp, kernel, grouped_shape)
            if not torch.equal(stacked(sample, gate_up, down), apart):
                return False
        return True


def _apart(x, segments, gate_up, down, mlp, kernel, grouped_shape) -> torch.Tensor:
    """Each segment through expert_forward alone, from a tensor of its own (aligned, as received)."""
    parts = [_aligned(p) for p in torch.split(x, segments)]
    ys = [expert_forward(p, gate_up, down, mlp, kernel, grouped_shape) for p in parts]
    return ys[0] if len(ys) == 1 else torch.cat(ys)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    return x if x.data_ptr() % ALIGN == 0 else x.clone()  # see codec.ALIGN


def _stacked_call(segments, mlp: ExpertMLP, kernel: str, device: torch.device, grouped_shape):
    """The one call for all segments, or None where there is none to try."""
    if mlp.layout != "standard":
        return None
    act = _activation(mlp.hidden_act)
    if kernel == "grouped_mm" and not (grouped_shape and device.type == "cuda"):
        if not hasattr(torch.nn.functional, "grouped_mm"):
            return None
        offs = torch.tensor(segments, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
        groups = len(segments)

        def grouped(x, gate_up, down):
            w1 = gate_up.unsqueeze(0).transpose(-2, -1).expand(groups, *gate_up.shape[::-1])
            w2 = down.unsqueeze(0).transpose(-2, -1).expand(groups, *down.shape[::-1])
            gate, up = torch.nn.functional.grouped_mm(x, w1, offs=offs).chunk(2, dim=-1)
            return torch.nn.functional.grouped_mm(act(gate) * up, w2, offs=offs)

        return grouped
    if kernel == "eager" and all(s == 1 for s in segments):

        def one_row_each(x, gate_up, down):
            rows = x.shape[0]
            gate, up = torch.bmm(x[:, None], gate_up.t().expand(rows, *gate_up.shape[::-1])).chunk(2, dim=-1)
            return torch.bmm(act(gate) * up, down.t().expand(rows, *down.shape[::-1]))[:, 0]

        return one_row_each
    return None
