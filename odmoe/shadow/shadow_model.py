"""The shadow's copy of the whole model at a chosen precision (paper §3.2).

Contract: `load_shadow_model(path, precision)` returns transformers' own model, experts included,
ready to run locally. Precisions:
- fp32 / bf16 / fp16: the checkpoint cast to that dtype (fp32 on main's device is an exact emulator);
- int8 / nf4: bitsandbytes linears (the GPU path; they also run on CPU, 4-5x slower than fp32 there,
  fine for recall studies, too slow to stay ahead of main). On a CUDA device the checkpoint is read
  on the host, unfused there without copies, and each linear is quantized as it moves to the GPU, so
  the device never holds the full-precision experts (a real-width model would not fit beside the
  rest of a one-GPU cluster); the unquantized rest follows;
- int8_dynamic: torch's dynamic int8 quantization, the fast CPU int8.
transformers keeps experts as fused [E, 2I, H] parameters that no quantizer touches, so for the
quantized precisions each experts module is first unfused into per-expert `nn.Linear`s. Routers are
bare parameters, not linears, so they stay in full precision; so does Qwen2-MoE's shared-expert gate.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.models.llama4.modeling_llama4 import Llama4Router

from odmoe.models.main_model import experts_modules_named, llama4_choice
from odmoe.shadow.hedging import GroupLimit

PRECISIONS = ("fp32", "bf16", "fp16", "int8", "nf4", "int8_dynamic")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_KEEP_FULL = ("shared_expert_gate", "lm_head")  # tiny gates and the vocabulary head stay exact


class UnfusedExperts(nn.Module):
    """A fused experts module as per-expert linears, computing what transformers' eager kernel does."""

    def __init__(self, fused: nn.Module, hidden_act: str, copy: bool = True):
        super().__init__()
        take = (lambda t: t.detach().clone()) if copy else (lambda t: t.detach())  # no copy: views
        self.num_experts = fused.gate_up_proj.shape[0]
        self.gate_up = nn.ModuleList()
        self.down = nn.ModuleList()
        for e in range(self.num_experts):
            gate_up = nn.Linear(fused.gate_up_proj.shape[2], fused.gate_up_proj.shape[1], bias=False)
            gate_up.weight = nn.Parameter(take(fused.gate_up_proj[e]), requires_grad=False)
            down = nn.Linear(fused.down_proj.shape[2], fused.down_proj.shape[1], bias=False)
            down.weight = nn.Parameter(take(fused.down_proj[e]), requires_grad=False)
            self.gate_up.append(gate_up)
            self.down.append(down)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden)
        for e in top_k_index.unique().tolist():
            token_idx, slot_idx = torch.where(top_k_index == e)
            gate, up = self.gate_up[e](hidden[token_idx]).chunk(2, dim=-1)
            y = self.down[e](self.act_fn(gate) * up).to(hidden.dtype)
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, slot_idx, None]).to(out.dtype))
        return out


class UnfusedBmmExperts(nn.Module):
    """Llama 4's fused experts ([E, H, 2I], [E, I, H], called on [E * T, H] rows already scaled by
    the router) as per-expert linears; rows a token did not route to are zero and give zero, so
    only the others are computed (a predictor's shortcut: the shadow need not be exact)."""

    def __init__(self, fused: nn.Module, hidden_act: str, copy: bool = True):
        super().__init__()
        take = (lambda t: t.detach().clone()) if copy else (lambda t: t.detach())
        self.num_experts, hidden, double = fused.gate_up_proj.shape
        self.gate_up = nn.ModuleList()
        self.down = nn.ModuleList()
        for e in range(self.num_experts):
            gate_up = nn.Linear(hidden, double, bias=False)
            gate_up.weight = nn.Parameter(take(fused.gate_up_proj[e].T), requires_grad=False)
            down = nn.Linear(double // 2, hidden, bias=False)
            down.weight = nn.Parameter(take(fused.down_proj[e].T), requires_grad=False)
            self.gate_up.append(gate_up)
            self.down.append(down)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, routed_in: torch.Tensor) -> torch.Tensor:
        rows = routed_in.view(self.num_experts, -1, routed_in.shape[-1])
        out = torch.zeros_like(rows)
        for e in range(self.num_experts):
            used = rows[e].abs().sum(-1).nonzero().flatten()
            if used.numel():
                gate, up = self.gate_up[e](rows[e, used]).chunk(2, dim=-1)
                out[e, used] = self.down[e](up * self.act_fn(gate)).to(out.dtype)
        return out.view(-1, routed_in.shape[-1])


def _unfuse(model: PreTrainedModel, copy: bool = True) -> None:
    for name, module in experts_modules_named(model):
        if getattr(module, "has_bias", False):  # gpt-oss: its biased experts stay fused, unquantized
            continue
        parent = model.get_submodule(name.rpartition(".")[0])
        llama4 = isinstance(getattr(parent, "router", None), Llama4Router)
        unfused = UnfusedBmmExperts if llama4 else UnfusedExperts
        parent.experts = unfused(module, model.config.hidden_act, copy)


def _linears(model: nn.Module):
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and child_name not in _KEEP_FULL:
                yield module, child_name, child


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


def _to_bitsandbytes(model: PreTrainedModel, precision: str, device: torch.device | None = None) -> None:
    """Every linear (but _KEEP_FULL) quantized; each lands on `device` (None: where it was)."""
    import bitsandbytes as bnb

    for parent, name, lin in list(_linears(model)):
        weight = lin.weight.data.float()
        if precision == "int8":
            q = bnb.nn.Linear8bitLt(
                lin.in_features,
                lin.out_features,
                bias=lin.bias is not None,
                has_fp16_weights=False,
                threshold=0.0,
            )
            q.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        else:
            q = bnb.nn.Linear4bit(
                lin.in_features,
                lin.out_features,
                bias=lin.bias is not None,
                compute_dtype=torch.float32,
                quant_type="nf4",
            )
            q.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            if not _fits_packed_cpu_nf4(lin.in_features, lin.out_features, q.weight.blocksize):
                # bitsandbytes repacks nf4 weights for its AVX512-BF16 CPU kernel on the first forward,
                # which only takes rows of whole blocks (and crashes on e.g. a 32-wide LoRA input);
                # such a linear keeps the generic nf4 path, the same on every CPU
                q.support_avx512bf16_for_cpu = False
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.data.float(), requires_grad=False)
        q = q.to(device if device is not None else lin.weight.device)  # quantizes as it reaches a GPU
        setattr(parent, name, FlatRows(q) if name == "kv_b_proj" else q)


_PACKED_NF4_BLOCK_N = 32  # bitsandbytes' _convert_weight_packed_for_cpu packs output rows by 32


def _fits_packed_cpu_nf4(in_features: int, out_features: int, blocksize: int) -> bool:
    """Pure: whether bitsandbytes' packed CPU nf4 kernel can take this linear (whole blocks per row,
    output rows in whole packs)."""
    return in_features % blocksize == 0 and out_features % _PACKED_NF4_BLOCK_N == 0


def _to_dynamic_int8(model: PreTrainedModel) -> None:
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch marks its quantized tensors deprecated; they still work
        for parent, name, lin in list(_linears(model)):
            setattr(parent, name, quantize_dynamic(nn.Sequential(lin), {nn.Linear}, dtype=torch.qint8)[0])


def load_shadow_model(path: str, precision: str, device: str = "cpu") -> PreTrainedModel:
    if precision not in PRECISIONS:
        raise ValueError(f"shadow.precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    dtype = _DTYPES.get(precision, torch.float32)
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu and precision == "int8_dynamic":
        raise ValueError("shadow.precision=int8_dynamic is torch's CPU int8; on CUDA use int8 or nf4")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if on_gpu and precision in ("int8", "nf4"):
        _unfuse(model, copy=False)  # views of the host copy, each quantized on its way to the GPU
        _to_bitsandbytes(model, precision, torch.device(device))
        model = model.to(device)  # attention, norms, routers, embeddings, lm_head
        model.eval()
        return model
    model = model.to(device)
    if precision in ("int8", "nf4", "int8_dynamic"):
        _unfuse(model)
        if precision == "int8_dynamic":
            _to_dynamic_int8(model)
        else:
            _to_bitsandbytes(model, precision)
    model.eval()
    return model


def router_modules(model: nn.Module, num_experts: int) -> list[tuple[int, nn.Module]]:
    """(layer, router) of every routed MoE layer: the `mlp.gate` (Phi-3.5-MoE, gpt-oss:
    `mlp.router`; Llama 4: `feed_forward.router`) whose weight is [experts, hidden] (Qwen2-MoE's
    one-output shared-expert gate is not one). `router_output` reads its forward's output as
    (logits [T, E], top_k_weights [T, k], top_k_index [T, k])."""
    found = [
        (int(name.split(".layers.")[1].split(".")[0]), module)
        for name, module in model.named_modules()
        if name.endswith((".mlp.gate", ".mlp.router", ".feed_forward.router"))
        and getattr(module, "weight", None) is not None
        and module.weight.dim() == 2
        and module.weight.shape[0] == num_experts
    ]
    return sorted(found, key=lambda item: item[0])


def router_output(router: nn.Module, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A router call's (logits [T, E], top_k_weights [T, k], top_k_index [T, k]), as transformers'
    experts interface has them; Llama 4's router returns (scores [T, E], logits [T, E]) instead,
    read as main reads it (`llama4_choice`)."""
    if isinstance(router, Llama4Router):
        scores, logits = output
        index, weights = llama4_choice(router.top_k, scores, logits)
        return logits, weights, index
    return output


def choice_scores(router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The scores a router ranks experts by, for its logits [..., E]; top-k of these is its choice.

    Softmax for every family but these: Llama 4 takes a sigmoid (the logits' order); ERNIE 4.5 adds
    its `moe_statics` correction bias to the softmax; DeepSeek-V3's sigmoid scores plus
    `e_score_correction_bias` decide (the bias moves the choice, not the weights). Where the router
    limits the choice to its best `topk_group` of `n_group` expert groups (V3 always; V2 with
    `group_limited_greedy`), experts of the other groups score -inf, so the top-(k+1) the shadow
    publishes are ones the router could pick. Group ranking as transformers does it: V3 sums each
    group's best two, V2 takes the best.
    """
    return mask_groups(unmasked_choice_scores(router, logits), group_limit(router))


def mask_groups(scores: torch.Tensor, limit: GroupLimit | None) -> torch.Tensor:
    """Unmasked choice scores [..., E] with every expert outside the router's kept groups at -inf."""
    if limit is None:
        return scores
    grouped = scores.reshape(*scores.shape[:-1], limit.groups, -1)  # [..., G, E/G]
    rank = grouped.topk(2, dim=-1).values.sum(-1) if limit.by_top2 else grouped.max(-1).values
    keep = torch.zeros_like(rank, dtype=torch.bool)
    keep.scatter_(-1, rank.topk(limit.keep, dim=-1).indices, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).reshape(scores.shape)


def unmasked_choice_scores(router: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """`choice_scores` before any expert group is ruled out (what group hedging ranks groups by)."""
    logits = logits.float()
    if isinstance(router, Llama4Router):
        return logits.sigmoid()
    statics = getattr(router, "moe_statics", None)  # ERNIE 4.5: softmax, plus a bias for the choice
    if statics is not None:
        return logits.softmax(dim=-1) + statics.e_score_correction_bias.float().squeeze(0)
    bias = getattr(router, "e_score_correction_bias", None)
    return logits.sigmoid() + bias if bias is not None else logits.softmax(dim=-1)


def group_limit(router: nn.Module) -> GroupLimit | None:
    """How this router limits its choice to expert groups, or None: V3 always (groups ranked by
    their best two scores), V2 with `group_limited_greedy` (by their best)."""
    bias = getattr(router, "e_score_correction_bias", None)
    groups = getattr(router, "num_group", None) or 1
    limited = bias is not None or getattr(router, "topk_method", None) == "group_limited_greedy"
    if groups <= 1 or not limited:
        return None
    return GroupLimit(groups, router.topk_group, bias is not None)


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored (quantized tensors at their packed size)."""
    total = sum(
        t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, torch.Tensor)
    )
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    for module in model.modules():
        if isinstance(module, DynamicInt8Linear):  # packed params are not in state_dict
            bias = module.bias()
            total += module.weight().numel() + (bias.numel() * bias.element_size() if bias is not None else 0)
    return total
