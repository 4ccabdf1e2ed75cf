"""The expert MLP and the top-k combine, bit-for-bit as transformers computes them.

Losslessness lives here. transformers picks an "experts implementation" per model (`grouped_mm`
where torch has the kernel, else `eager`); the two differ in how rows reach the matmul and, above
all, in how the k weighted expert outputs of a token are summed (`eager`: `index_add_` in ascending
expert order; `grouped_mm`: a `[T, k, H].sum(1)`). Floating-point addition is not associative, so
main must combine exactly as the reference would, and a worker must run the same kernel on the same
rows *in the same order*: a CPU matmul's result for a row can change in the last bits with the row's
position in the block (seen on AMD EPYC with 37-token batches, not on every CPU). `split_by_expert`
gives each expert's rows in the order the kernel itself would feed them.

On CUDA the reference's `grouped_mm` is one call over all E experts' rows (T*k of them), and
PyTorch's CUTLASS bf16 kernel picks its tile shape from the *average* rows per group
(`M = rows / groups`, small tiles when M <= 128 or N <= 128; aten/src/ATen/native/cuda/GroupMM.cu),
not from this expert's own row count: a worker calling it with one group of n rows could pick the
other tile shape and differ in the last bits. So a CUDA worker mirrors the reference call's shape
(`grouped_shape = (T*k, E)`, sent by main): its n rows first in a [T*k, H] input, then padding the
kernel never reads (rows past the last offset), and E groups of which only the first is non-empty,
the weight repeated over the group dimension by a stride-0 view (no copy). Every shape the kernel
selects on is then the reference's. The non-bf16 CUDA path (a per-group `mm` loop) and the CPU path
see the same rows either way; the CPU path is left as it was.

Llama 4 is not on transformers' experts interface: `Llama4TextMoe` scales each token's row by its
router score (a sigmoid, 0 for experts not chosen) *before* the experts, then runs every expert over
every row of the layer as one `bmm` ([E, T, H] @ [E, H, 2I]) and sums the [E, T, H] outputs over E.
A row's result in a CPU matmul can depend on how many rows the call has and where the row sits
(measured: the routed rows alone through `mm` differ from the reference's bmm in 72 of 168 fp32
cases), so this module's kernel "bmm" computes an expert the way the reference's bmm computes its
slice: the routed rows, already scaled (`expert_input`), placed at their token positions in a zero
[T, H] block, one single-threaded bmm (the reference's batch of E experts is parallel across experts,
each expert's product on one thread; a two-thread batch-of-one call differs in a few shapes), and
only the routed rows sent back. The rows left zero are exactly what the reference computes for the
experts a token did not choose (a zero row maps to zero), so `combine` rebuilds the [E, T, H] block
and sums it as the reference does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers.activations import ACT2FN
from transformers.integrations.moe import _grouped_linear as _hf_grouped_linear
from transformers.integrations.moe import _grouped_mm
from transformers.utils.import_utils import is_torch_greater_or_equal

KERNELS = ("grouped_mm", "eager", "bmm")


@dataclass(frozen=True)
class ExpertMLP:
    """What an expert computes besides its weights. `standard`: act(gate) * up over a gate_up
    [2I, H] (gate rows first) and down [H, I], no bias (every family but gpt-oss and Llama 4).
    `gpt_oss`: weights stored transposed with their bias as one more row — gate_up [H + 1, 2I], down
    [I + 1, H] — gate and up interleaved in gate_up's columns, and the clamped SwiGLU (`alpha`,
    `limit`) of transformers' GptOssExperts._apply_gate. `llama4`: transposed, no bias — gate_up
    [H, 2I] (gate columns first), down [I, H] — computed by the "bmm" kernel."""

    hidden_act: str = "silu"
    layout: str = "standard"
    alpha: float = 0.0
    limit: float = 0.0

    def hidden_size(self, gate_up_shape: torch.Size) -> int:
        """The rows' width an expert of this layout takes, from its gate_up's shape."""
        if self.layout == "gpt_oss":
            return gate_up_shape[0] - 1
        return gate_up_shape[0] if self.layout == "llama4" else gate_up_shape[-1]


def expert_mlp(config, layout: str = "standard") -> ExpertMLP:
    """The ExpertMLP of a model with this config and its family's expert layout."""
    if layout == "gpt_oss":
        return ExpertMLP(config.hidden_act, layout, float(config.swiglu_alpha), float(config.swiglu_limit))
    return ExpertMLP(config.hidden_act, layout)


def kernel_of(layout: str, implementation: str) -> str:
    """The kernel an expert of this layout computes with: Llama 4's own bmm, else the experts
    implementation transformers resolved for the model."""
    return "bmm" if layout == "llama4" else implementation


@dataclass(frozen=True)
class ExpertRows:
    """The token rows one expert computes: `hidden[token_idx]`, with the k-slot each came from."""

    expert: int
    token_idx: torch.Tensor  # [n] long
    slot_idx: torch.Tensor  # [n] long, position in top-k


_ROW0 = torch.zeros(1, dtype=torch.long)  # token_idx of a one-token batch (never written to)
_SLOTS = [torch.tensor([s]) for s in range(64)]  # slot_idx of each top-k position (never written to)


def split_by_expert(top_k_index: torch.Tensor, num_experts: int, kernel: str = "eager") -> list[ExpertRows]:
    """Experts hit by this batch, ascending, each with its rows in that kernel's order."""
    if (
        top_k_index.shape[0] == 1
        and top_k_index.shape[-1] <= len(_SLOTS)
        and top_k_index.device.type == "cpu"
    ):
        # A decode step: one token, k distinct experts, one row each. Both kernels visit experts in
        # ascending order with that single row: the same rows as below without a dozen tensor ops.
        ids = top_k_index[0].tolist()
        if len(set(ids)) == len(ids):
            return [
                ExpertRows(expert=e, token_idx=_ROW0, slot_idx=_SLOTS[s])
                for s, e in sorted(enumerate(ids), key=lambda p: p[1])
            ]
    if kernel == "grouped_mm":
        # grouped_mm sorts the flattened (token, slot) pairs by expert with this very call (not a
        # stable sort), then multiplies each expert's run of rows in that order.
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        sorted_ids, perm = torch.sort(flat)
        pairs = {expert: perm[sorted_ids == expert] for expert in sorted_ids.unique().tolist()}
        return [ExpertRows(expert, token_idx=p // top_k, slot_idx=p % top_k) for expert, p in pairs.items()]
    # eager: [T, k] -> one_hot [T, k, E] -> [E, k, T], as the kernel builds its mask.
    mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    where = {expert: torch.where(mask[expert]) for expert in hit}  # (slot_idx, token_idx)
    return [ExpertRows(expert, token_idx=t, slot_idx=s) for expert, (s, t) in where.items()]


def expert_input(
    hidden: torch.Tensor, rows: ExpertRows, top_k_weights: torch.Tensor, kernel: str
) -> torch.Tensor:
    """The rows one expert computes on: `hidden[token_idx]`; for "bmm" (Llama 4) each multiplied by
    the router's score for this expert first, the very product Llama4TextMoe forms."""
    x = hidden if hidden.shape[0] == 1 else hidden[rows.token_idx]
    if kernel != "bmm":
        return x
    return x * top_k_weights[rows.token_idx, rows.slot_idx, None]


def expert_forward(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    mlp: str | ExpertMLP,
    kernel: str,
    grouped_shape: tuple[int, int] | None = None,
    positions: list[int] | None = None,
) -> torch.Tensor:
    """One expert's gated MLP on rows x [n, H] -> [n, H], unweighted. `mlp`: an ExpertMLP, or the
    standard layout's activation name. `grouped_shape`: (rows, experts) of the reference's grouped
    call, mirrored on CUDA (see the module's docstring); for "bmm" (T, E) of the reference's bmm,
    with `positions` the rows' token positions in its T (None: x is all T rows)."""
    if kernel == "bmm":
        return _bmm_forward(x, gate_up, down, mlp, grouped_shape, positions)
    if isinstance(mlp, ExpertMLP) and mlp.layout == "gpt_oss":
        return _gpt_oss_forward(x, gate_up, down, mlp, kernel, grouped_shape)
    act = _activation(mlp.hidden_act if isinstance(mlp, ExpertMLP) else mlp)
    if kernel == "grouped_mm" and grouped_shape and x.device.type == "cuda":
        rows, groups = grouped_shape
        gate, up = _mirrored_grouped_linear(x, gate_up, rows, groups).chunk(2, dim=-1)
        return _mirrored_grouped_linear(act(gate) * up, down, rows, groups)
    if kernel == "eager":
        gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
        return torch.nn.functional.linear(act(gate) * up, down)
    if kernel == "grouped_mm":
        # A one-expert group through the grouped matmul transformers' kernel uses: same op, same strides.
        offs = _offsets(x.shape[0], x.device)
        gate, up = _grouped_linear(x, gate_up, offs).chunk(2, dim=-1)
        return _grouped_linear(act(gate) * up, down, offs)
    raise ValueError(f"unknown experts kernel {kernel!r}; expected one of {KERNELS}")


def _gpt_oss_forward(x, gate_up, down, mlp: ExpertMLP, kernel: str, grouped_shape) -> torch.Tensor:
    """gpt-oss's expert as transformers computes it: x @ W + b (W [in, out], transposed), the
    clamped SwiGLU over interleaved gate/up columns, then @ W_down + b_down. `eager` is
    GptOssExperts.forward's own arithmetic; `grouped_mm` is the generic kernel's with
    is_transposed and has_bias (the bias added in place after the matmul)."""
    w_gu, b_gu, w_d, b_d = gate_up[:-1], gate_up[-1], down[:-1], down[-1]
    if kernel == "eager":
        return _gpt_oss_gate(x @ w_gu + b_gu, mlp) @ w_d + b_d
    if kernel != "grouped_mm":
        raise ValueError(f"unknown experts kernel {kernel!r}; expected one of {KERNELS}")
    if grouped_shape and x.device.type == "cuda":
        rows, groups = grouped_shape
        gate_up = _mirrored_grouped_linear(x, w_gu, rows, groups, transposed=True).add_(b_gu)
        gated = _gpt_oss_gate(gate_up, mlp)
        return _mirrored_grouped_linear(gated, w_d, rows, groups, transposed=True).add_(b_d)
    offs = _offsets(x.shape[0], x.device)
    gated = _gpt_oss_gate(_grouped_mm(x, w_gu.unsqueeze(0), offs=offs).add_(b_gu), mlp)
    return _grouped_mm(gated, w_d.unsqueeze(0), offs=offs).add_(b_d)


def _bmm_forward(x, gate_up, down, mlp, grouped_shape, positions) -> torch.Tensor:
    """Llama4TextExperts.forward for one expert's slice of its bmm: x's rows at their positions in
    a zero [T, H] block, on one thread (see the module's docstring)."""
    act = _activation(mlp.hidden_act if isinstance(mlp, ExpertMLP) else mlp)
    block = x
    if positions is not None:
        if grouped_shape is None:
            raise ValueError("the bmm kernel needs the reference's row count with positions")
        block = x.new_zeros(grouped_shape[0], x.shape[1])
        block[positions] = x
    with _one_thread():
        gate, up = torch.bmm(block[None], gate_up[None]).chunk(2, dim=-1)
        y = torch.bmm(up * act(gate), down[None])[0]
    return y if positions is None else y[positions]


class _one_thread:
    """torch on one intra-op thread for the block (restored after)."""

    def __enter__(self):
        self.before = torch.get_num_threads()
        if self.before != 1:
            torch.set_num_threads(1)

    def __exit__(self, *_):
        if self.before != 1:
            torch.set_num_threads(self.before)


def _gpt_oss_gate(gate_up: torch.Tensor, mlp: ExpertMLP) -> torch.Tensor:
    """transformers' GptOssExperts._apply_gate, op for op."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=mlp.limit)
    up = up.clamp(min=-mlp.limit, max=mlp.limit)
    glu = gate * torch.sigmoid(gate * mlp.alpha)
    return (up + 1) * glu


@functools.cache
def _activation(name: str):
    return ACT2FN[name]  # ACT2FN builds a new module at every lookup


@functools.lru_cache(maxsize=256)
def _offsets(rows: int, device: torch.device) -> torch.Tensor:
    """grouped_mm's offsets for one group of `rows` rows (read, never written, by the kernel)."""
    return torch.tensor([rows], dtype=torch.int32, device=device)


# transformers' `_grouped_mm` hands CPU weights to torch's grouped_mm as they are from torch 2.11 on
# (before, only 16-byte-aligned ones). Calling it directly there skips per-call version checks and
# conversions that cost a one-row decode call more than its matmuls did (tests: same bits).
_DIRECT_ON_CPU = hasattr(torch.nn.functional, "grouped_mm") and is_torch_greater_or_equal(
    "2.11", accept_dev=True
)


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' `_grouped_linear` for one expert's weight [out, in]: x [n, in] -> [n, out]."""
    w = weight.unsqueeze(0).transpose(-2, -1)  # [1, in, out], the layout transformers hands the kernel
    if _DIRECT_ON_CPU and weight.device.type == "cpu" and x.dtype == weight.dtype:
        return torch.nn.functional.grouped_mm(x, w, offs=offs)
    return _grouped_mm(x, w, offs=offs)


def _mirrored_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, rows: int, groups: int, transposed: bool = False
) -> torch.Tensor:
    """x [n, in] @ weight [out, in].T (`transposed`: weight [in, out], gpt-oss) as group 0 of a
    grouped call shaped like the reference's: input [max(rows, n), in] (rows past n are never read),
    `groups` groups, the others empty."""
    n = x.shape[0]
    padded = x.new_zeros(max(rows, n), x.shape[1])
    padded[:n] = x
    offs = torch.full((max(groups, 1),), n, dtype=torch.int32, device=x.device)
    weights = weight.unsqueeze(0).expand(max(groups, 1), *weight.shape)  # stride 0: no copy
    return _hf_grouped_linear(padded, weights, offs, is_transposed=transposed)[:n]


def combine(
    hidden: torch.Tensor,
    parts: list[tuple[ExpertRows, torch.Tensor]],
    top_k_weights: torch.Tensor,
    kernel: str,
    num_experts: int = 0,
) -> torch.Tensor:
    """Weighted sum of the experts' outputs per token, [T, H], in the reference's order and dtype
    ("bmm": the outputs come weighted, summed over all `num_experts` as Llama4TextMoe sums them)."""
    num_tokens, hidden_dim = hidden.shape
    top_k = top_k_weights.shape[-1]
    if kernel == "bmm":
        dense = hidden.new_zeros(max(num_experts, 1), num_tokens, hidden_dim)
        for rows, y in parts:
            dense[rows.expert, rows.token_idx] = y.to(dense.dtype)
        return dense.sum(dim=0)
    if num_tokens == 1 and (by_slot := _one_row_per_slot(parts, top_k, hidden.dtype)) is not None:
        return _combine_one_token(hidden, by_slot, top_k_weights, kernel)
    if kernel == "eager":
        out = torch.zeros_like(hidden)
        for rows, y in sorted(parts, key=lambda p: p[0].expert):
            weighted = y * top_k_weights[rows.token_idx, rows.slot_idx, None]
            out.index_add_(0, rows.token_idx, weighted.to(out.dtype))
        return out
    if kernel == "grouped_mm":
        flat = torch.zeros(num_tokens * top_k, hidden_dim, dtype=hidden.dtype, device=hidden.device)
        for rows, y in parts:
            flat[rows.token_idx * top_k + rows.slot_idx] = y.to(flat.dtype)
        weighted = flat * top_k_weights.reshape(-1).unsqueeze(-1)
        return weighted.view(num_tokens, top_k, hidden_dim).sum(dim=1).to(hidden.dtype)
    raise ValueError(f"unknown experts kernel {kernel!r}; expected one of {KERNELS}")


def _one_row_per_slot(parts, top_k: int, dtype: torch.dtype) -> list[tuple[ExpertRows, torch.Tensor]] | None:
    """A decode step's parts by top-k slot, when every slot has exactly one output row of `dtype`
    (else None: the general path)."""
    by_slot: list = [None] * top_k
    for rows, y in parts:
        if rows.slot_idx.shape[0] != 1 or y.dtype != dtype:
            return None
        by_slot[int(rows.slot_idx[0])] = (rows, y)
    return None if any(p is None for p in by_slot) else by_slot


def _combine_one_token(
    hidden: torch.Tensor,
    by_slot: list[tuple[ExpertRows, torch.Tensor]],
    top_k_weights: torch.Tensor,
    kernel: str,
) -> torch.Tensor:
    """`combine` for one token whose k slots hold k distinct experts, in fewer tensor ops and to the
    same bits: the same products, added in the same order by the same ops (tested against the
    general path, NaN payloads included)."""
    if kernel == "grouped_mm":
        flat = torch.cat([y for _, y in by_slot])  # [k, H]: what the general path scatters into zeros
        weighted = flat * top_k_weights.reshape(-1, 1)
        return weighted.view(1, len(by_slot), -1).sum(dim=1).to(hidden.dtype)
    if kernel == "eager":
        out = torch.zeros_like(hidden)
        for slot, (rows, y) in sorted(enumerate(by_slot), key=lambda p: p[1][0].expert):
            # [1, 1] weights (not a 0-dim scalar): the same type promotion as the general path
            out.index_add_(0, rows.token_idx, (y * top_k_weights[:, slot, None]).to(out.dtype))
        return out
    raise ValueError(f"unknown experts kernel {kernel!r}; expected one of {KERNELS}")
