"""The shadow's copy of the whole model at a chosen precision (paper §3.2), built layer by layer.

Contract: `load_shadow_model(path, precision, device, memory)` returns transformers' own model class,
experts included, ready to run locally, holding only its share: the model is built on the `meta`
device and filled one decoder layer at a time from the safetensors (`Checkpoint`): a layer's tensors
are read, quantized, and their full-precision copies dropped before the next layer is read, and each
expert is quantized as soon as it is read. Loading thus peaks at the shadow's steady size plus about
one layer; nothing ever holds the whole model at full precision. Precisions
(`odmoe.shadow.precision`):
- fp32 / bf16 / fp16: every tensor in the dtype `from_pretrained(dtype=...)` gives it (fp32 equals
  `from_pretrained(dtype=float32)` to the bit: on main's device an exact emulator);
- int8_dynamic (torch's dynamic int8) and int4 (torch's int4 weight-only kernel): the fast CPU shadows;
- int8 / nf4: bitsandbytes linears (the GPU path; on CPU 4-5x slower than fp32: recall studies only).
  On a CUDA device every linear is quantized as it moves there, so the device never holds a
  full-precision expert;
- auto (the default): `resolve_precision` picks int8_dynamic or int4 on a CPU, int8 or nf4 on CUDA,
  from the bytes each would hold (estimated from the model's shapes before anything is read) and the
  memory this node may use (`odmoe.node_memory`), and logs its choice and why.
transformers keeps experts as fused [E, 2I, H] parameters that no quantizer touches, so at the
quantized precisions each expert (`Checkpoint.expert`) becomes two quantized linears of an
`UnfusedExperts`; gpt-oss's biased experts stay fused, in float32. Routers are bare parameters, not
linears, so they stay in full precision, as does Qwen2-MoE's shared-expert gate; the embedding stays
at the checkpoint's dtype (`CastEmbedding`); the vocabulary head is quantized for int8_dynamic and
int4. A model needing a tensor the checkpoint's weight map lacks is loaded the old way instead
(`load_whole_shadow_model`: `from_pretrained` at full precision, then quantized), with a log line.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
import time

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.models.llama4.modeling_llama4 import Llama4Router

from odmoe.models.checkpoint import Checkpoint, CheckpointError
from odmoe.models.families import is_expert_key, layer_of_key
from odmoe.models.fp8 import SCALE_SUFFIX, dequantize, scale_key
from odmoe.models.load_dtypes import loaded_dtypes, meta_skeleton
from odmoe.models.main_model import experts_modules_named, llama4_choice, resolve_dtype
from odmoe.models.open_model import open_checkpoint
from odmoe.node_memory import NodeMemory, node_memory
from odmoe.shadow.hedging import GroupLimit
from odmoe.shadow.precision import (
    AUTO_CHOICES,
    CPU_ONLY,
    HEAD_QUANTIZED,
    PRECISIONS,
    QUANTIZED,
    WeightShape,
    choose_precision,
    shadow_weight_bytes,
    why_chosen,
)
from odmoe.shadow.quantized_linear import CastEmbedding, FlatRows, float_linear, quantized_linear

__all__ = ["PRECISIONS", "load_shadow_model", "resolve_precision"]

log = logging.getLogger("odmoe.shadow.model")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_KEEP_FULL = ("shared_expert_gate", "lm_head")  # tiny gates stay exact; the head is decided apart
_EXPERT_PARAMS = {"gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"}


class _PerExpertLinears(nn.Module):
    """A fused experts module's experts as per-expert linears (any modules computing x @ W.T:
    quantized or not): gate_up each [2I, H], gate rows first; down each [H, I]."""

    stored_transposed = False  # the fused parameters are [E, H, 2I] / [E, I, H] (Llama 4's)

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module], hidden_act: str):
        super().__init__()
        self.num_experts = len(gate_up)
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.act_fn = ACT2FN[hidden_act]

    @classmethod
    def from_fused(cls, fused: nn.Module, hidden_act: str, copy: bool = True):
        """Float linears over a fused module's [E, 2I, H] / [E, H, I] (`copy=False`: views of it)."""
        take = (lambda t: t.detach().clone()) if copy else (lambda t: t.detach())
        turn = cls.stored_transposed
        gate_up = [float_linear(take(w.T if turn else w), None) for w in fused.gate_up_proj]
        down = [float_linear(take(w.T if turn else w), None) for w in fused.down_proj]
        return cls(gate_up, down, hidden_act)


class UnfusedExperts(_PerExpertLinears):
    """A fused experts module as per-expert linears, computing what transformers' eager kernel does."""

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden)
        for e in top_k_index.unique().tolist():
            token_idx, slot_idx = torch.where(top_k_index == e)
            gate, up = self.gate_up[e](hidden[token_idx]).chunk(2, dim=-1)
            y = self.down[e](self.act_fn(gate) * up).to(hidden.dtype)
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, slot_idx, None]).to(out.dtype))
        return out


class UnfusedBmmExperts(_PerExpertLinears):
    """Llama 4's fused experts ([E, H, 2I], [E, I, H], called on [E * T, H] rows already scaled by
    the router) as per-expert linears; rows a token did not route to are zero and give zero, so
    only the others are computed (a predictor's shortcut: the shadow need not be exact)."""

    stored_transposed = True

    def forward(self, routed_in: torch.Tensor) -> torch.Tensor:
        rows = routed_in.view(self.num_experts, -1, routed_in.shape[-1])
        out = torch.zeros_like(rows)
        for e in range(self.num_experts):
            used = rows[e].abs().sum(-1).nonzero().flatten()
            if used.numel():
                gate, up = self.gate_up[e](rows[e, used]).chunk(2, dim=-1)
                out[e, used] = self.down[e](up * self.act_fn(gate)).to(out.dtype)
        return out.view(-1, routed_in.shape[-1])


# -- the precision -------------------------------------------------------------------------------


def resolve_precision(
    checkpoint: Checkpoint | str, precision: str, device: str = "cpu", memory: str = ""
) -> str:
    """`precision`, or for "auto" the one `odmoe.shadow.precision.choose_precision` picks for this
    model on this node (`memory`: `node.memory`, "" to detect), logged with its reason."""
    if precision not in PRECISIONS:
        raise ValueError(f"shadow.precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    checkpoint = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    device_type = "cuda" if torch.device(device).type == "cuda" else "cpu"
    shapes = weight_shapes(meta_skeleton(checkpoint.config, torch.float32), checkpoint.family.expert_layout)
    itemsize = resolve_dtype("auto", checkpoint).itemsize  # the embedding is kept as stored
    estimates = {p: shadow_weight_bytes(shapes, p, itemsize) for p in AUTO_CHOICES[device_type]}
    figure = _memory_figure(device, memory)
    choice = choose_precision(estimates, figure.bytes, device_type)
    log.info(
        "shadow.precision=auto: %s, %.2f GiB of weights (%s); this node's memory: %s",
        choice,
        estimates[choice] / 2**30,
        why_chosen(choice, estimates, figure.bytes, device_type),
        figure.describe(),
    )
    return choice


def _memory_figure(device: str, memory: str) -> NodeMemory:
    """What the shadow's weights must fit: `node.memory` when set; else, on CUDA, the device's free
    memory (where its weights go); else this node's (`node_memory`: cgroup limit, MemAvailable)."""
    target = torch.device(device)
    if target.type == "cuda" and not memory:
        free, _ = torch.cuda.mem_get_info(target)
        return NodeMemory(int(free), f"free memory of {target}")
    return node_memory(memory)


def weight_shapes(skeleton: nn.Module, layout: str) -> list[WeightShape]:
    """Every tensor of a (meta) model as the shadow would hold it (`WeightShape`'s kinds); `layout`
    is the family's expert layout (Llama 4's experts are stored transposed, gpt-oss's stay fused)."""
    shapes: list[WeightShape] = []
    covered: set[str] = set()
    head, embedding = skeleton.get_output_embeddings(), skeleton.get_input_embeddings()
    for name, module in skeleton.named_modules():
        if name.endswith(".experts") and hasattr(module, "gate_up_proj") and layout != "gpt_oss":
            for p in ("gate_up_proj", "down_proj"):
                e, a, b = getattr(module, p).shape
                shapes.append(WeightShape("experts", (e, b, a) if layout == "llama4" else (e, a, b)))
                covered.add(f"{name}.{p}")
            continue
        if module is head or module is embedding:
            kind = "head" if module is head else "embedding"
        elif type(module) is nn.Linear and name.rpartition(".")[2] not in _KEEP_FULL:
            kind = "linear"
        else:
            continue
        shapes.append(WeightShape(kind, tuple(module.weight.shape)))
        covered.add(f"{name}.weight")
    for name, tensor in (*skeleton.named_parameters(), *skeleton.named_buffers()):
        if name not in covered:
            shapes.append(WeightShape("other", tuple(tensor.shape)))
    return shapes


# -- loading ---------------------------------------------------------------------------------------


def load_shadow_model(path: str, precision: str, device: str = "cpu", memory: str = "") -> PreTrainedModel:
    """The shadow's model (module contract). `memory`: `node.memory`, for `precision="auto"`."""
    checkpoint = open_checkpoint(path)
    precision = resolve_precision(checkpoint, precision, device, memory)
    target = torch.device(device)
    if target.type == "cuda" and precision in CPU_ONLY:
        raise ValueError(f"shadow.precision={precision} is a CPU kernel of torch's; on CUDA use int8 or nf4")
    dtype = _DTYPES.get(precision, torch.float32)
    with init_empty_weights(include_buffers=False):  # parameters on meta; rotary buffers computed
        model = AutoModelForCausalLM.from_config(copy.deepcopy(checkpoint.config), dtype=dtype)
    lacking = _lacking(model, checkpoint)
    if lacking:
        log.info(
            "%s: loading the shadow whole through from_pretrained (full precision first), not layer by "
            "layer: its model needs %s, which the checkpoint does not hold as expected",
            path,
            ", ".join(lacking[:3]),
        )
        del model
        return load_whole_shadow_model(path, precision, device)
    start = time.perf_counter()
    _fill_by_layer(model, checkpoint, precision, target)
    model.eval()
    log.debug("%s: shadow loaded layer by layer at %s (%.1fs)", path, precision, time.perf_counter() - start)
    return model


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(name, the decoder layers) where the checkpoint's `model.layers.{i}` keys land, or None."""
    layers = model.get_submodule("model").get_submodule("layers") if hasattr(model, "model") else None
    return ("model.layers", layers) if isinstance(layers, nn.ModuleList) else None


def _lacking(model: PreTrainedModel, checkpoint: Checkpoint) -> list[str]:
    """What stops a layer-by-layer load: parameters the weight map does not hold, experts of a layer
    the checkpoint has none for, expert parameters of an unknown kind. Empty: go ahead."""
    if _decoder_layers(model) is None:
        return ["its decoder layers under model.layers"]
    module_key = checkpoint.family.module_key
    held = {module_key(k) for k in checkpoint.weight_map if not k.endswith(SCALE_SUFFIX)}
    experts = experts_modules_named(model)
    in_experts = {f"{n}.{p}" for n, m in experts for p, _ in m.named_parameters(recurse=False)}
    needed = {n for n, _ in model.named_parameters()} - in_experts
    if getattr(model.config, "tie_word_embeddings", False):
        needed.discard(f"{_name_of(model, model.get_output_embeddings())}.weight")
    lacking = sorted(needed - held)
    for name, module in experts:
        if _layer_of(name) not in checkpoint.moe_layers:
            lacking.append(f"the experts of {name}")
        unknown = {p for p, _ in module.named_parameters(recurse=False)} - _EXPERT_PARAMS
        lacking += [f"{name}.{p}" for p in sorted(unknown)]
    return lacking


def _fill_by_layer(
    model: PreTrainedModel, checkpoint: Checkpoint, precision: str, device: torch.device
) -> None:
    """Every tensor read into the meta skeleton, one decoder layer at a time (module contract)."""
    dtype_of = loaded_dtypes(model, _DTYPES.get(precision, torch.float32))
    keys: dict[int | None, list[str]] = {}  # layer (None: outside the layers) -> its non-expert keys
    for key in checkpoint.weight_map:
        if not is_expert_key(key) and not key.endswith(SCALE_SUFFIX):
            keys.setdefault(layer_of_key(key), []).append(key)
    prefix, layers = _decoder_layers(model)  # type: ignore[misc]  # _lacking made sure
    for index, layer in enumerate(layers):
        # 1) the layer's own tensors (attention, norms, router, shared expert), in their load dtype
        _read_tensors(model, checkpoint, keys.get(index, []), dtype_of)
        # 2) its experts, each quantized as soon as it is read (or into the fused parameters)
        for name, fused in experts_modules_named(layer):
            if precision in QUANTIZED and checkpoint.family.expert_layout != "gpt_oss":
                act = model.config.hidden_act
                _set_module(layer, name, _quantized_experts(checkpoint, index, fused, act, precision, device))
            else:
                _fill_fused(fused, f"{prefix}.{index}.{name}", checkpoint, index, dtype_of)
        # 3) its linears quantized; the full-precision copies go with the modules they replace
        if precision in QUANTIZED:
            _quantize_linears(layer, precision, device)
        layer.to(device)
        _return_freed_memory()
    _read_outside_layers(model, checkpoint, keys.get(None, []), precision, dtype_of, device)
    model.to(device)  # rotary buffers, norms
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        raise CheckpointError(f"{checkpoint.path}: the shadow was left without {meta[:5]}")


def _read(checkpoint: Checkpoint, key: str) -> torch.Tensor:
    """One tensor as stored; a block-FP8 one dequantized to float32, as transformers loads it."""
    if scale_key(key) in checkpoint.weight_map:
        return dequantize(checkpoint.tensor(key), checkpoint.tensor(scale_key(key)))
    return checkpoint.tensor(key)


def _read_tensors(model: nn.Module, checkpoint: Checkpoint, keys: list[str], dtype_of) -> None:
    unexpected = []
    for key in keys:
        name = checkpoint.family.module_key(key)
        if not _put(model, name, lambda key=key, name=name: _read(checkpoint, key).to(dtype_of(name))):
            unexpected.append(key)
    if unexpected:  # as from_pretrained: tensors the model has no place for are not loaded
        log.debug("%s: not in the model, not loaded: %s", checkpoint.path, unexpected)


def _put(model: nn.Module, name: str, value) -> bool:
    """Sets the parameter or buffer `name` to `value()`; False (nothing read) where there is none."""
    owner_name, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        return False
    if attr in owner._parameters:
        setattr(owner, attr, nn.Parameter(value(), requires_grad=False))
    elif attr in owner._buffers:
        owner._buffers[attr] = value()
    else:
        return False
    return True


def _quantized_experts(
    checkpoint: Checkpoint,
    layer: int,
    fused: nn.Module,
    hidden_act: str,
    precision: str,
    device: torch.device,
) -> nn.Module:
    """The layer's experts as quantized per-expert linears, each built from the expert read alone."""
    llama4 = checkpoint.family.expert_layout == "llama4"  # stored transposed: [H, 2I], [I, H]
    gate_up, down = [], []
    for e in range(fused.gate_up_proj.shape[0]):
        w = checkpoint.expert(layer, e)
        _check_shape(w.gate_up, fused.gate_up_proj, layer, e)
        _check_shape(w.down, fused.down_proj, layer, e)
        gate_up.append(quantized_linear(w.gate_up.T if llama4 else w.gate_up, None, precision, device))
        down.append(quantized_linear(w.down.T if llama4 else w.down, None, precision, device))
        del w
        _return_freed_memory()
    unfused = UnfusedBmmExperts if llama4 else UnfusedExperts
    return unfused(gate_up, down, hidden_act)


def _fill_fused(fused: nn.Module, name: str, checkpoint: Checkpoint, layer: int, dtype_of) -> None:
    """The fused expert parameters ([E, ...], in their load dtype) filled expert by expert; gpt-oss's
    experts come with their bias as one more row (`ExpertWeights`), split off into `*_bias`."""
    params = {
        p: torch.empty(t.shape, dtype=dtype_of(f"{name}.{p}"))
        for p, t in fused.named_parameters(recurse=False)
    }
    for e in range(params["gate_up_proj"].shape[0]):
        w = checkpoint.expert(layer, e)
        for p, value in (("gate_up_proj", w.gate_up), ("down_proj", w.down)):
            if f"{p}_bias" in params:
                params[f"{p}_bias"][e].copy_(value[-1])
                value = value[:-1]
            _check_shape(value, params[p], layer, e)
            params[p][e].copy_(value)
    for p, value in params.items():
        setattr(fused, p, nn.Parameter(value, requires_grad=False))


def _check_shape(value: torch.Tensor, fused: torch.Tensor, layer: int, expert: int) -> None:
    if tuple(value.shape) != tuple(fused.shape[1:]):
        raise CheckpointError(
            f"expert {expert} of layer {layer} is {tuple(value.shape)} on disk, "
            f"the model's {tuple(fused.shape[1:])}"
        )


def _read_outside_layers(
    model: PreTrainedModel,
    checkpoint: Checkpoint,
    keys: list[str],
    precision: str,
    dtype_of,
    device: torch.device,
) -> None:
    """The embedding, the final norm and the head. At the quantized precisions the embedding is kept
    as stored and the head (the embedding's table where they are tied) quantized or kept in float."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if precision not in QUANTIZED:
        _read_tensors(model, checkpoint, keys, dtype_of)
        if tied:
            model.tie_weights()
        return
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    embedding_name, head_name = _name_of(model, embedding), _name_of(model, head)
    by_name = {checkpoint.family.module_key(k): k for k in keys}
    apart = {f"{embedding_name}.weight", f"{head_name}.weight", f"{head_name}.bias"}
    _read_tensors(model, checkpoint, [k for n, k in by_name.items() if n not in apart], dtype_of)
    table = _read(checkpoint, by_name[f"{embedding_name}.weight"])
    weight = table if tied else _read(checkpoint, by_name[f"{head_name}.weight"])
    bias = _read(checkpoint, by_name[f"{head_name}.bias"]) if f"{head_name}.bias" in by_name else None
    if precision in HEAD_QUANTIZED:
        new_head = quantized_linear(weight, bias, precision, device)
    else:
        new_head = float_linear(weight, bias)
    del weight, bias
    _set_module(model, head_name, new_head)
    compute = _DTYPES.get(precision, torch.float32)
    model.set_input_embeddings(CastEmbedding(table, getattr(embedding, "padding_idx", None), compute))


def _quantize_linears(module: nn.Module, precision: str, device: torch.device | None = None) -> None:
    """Every nn.Linear under `module` (but _KEEP_FULL) replaced by its quantized form."""
    for parent, name, linear in list(_linears(module)):
        q = quantized_linear(linear.weight, linear.bias, precision, device)
        setattr(parent, name, FlatRows(q) if name == "kv_b_proj" and precision in ("int8", "nf4") else q)


def _linears(model: nn.Module):
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and child_name not in _KEEP_FULL:
                yield module, child_name, child


def _return_freed_memory() -> None:
    """Hands the pages of freed tensors back to the OS (glibc keeps freed heap memory for reuse
    otherwise, which a layer's scattered frees fragment), so resident memory follows what is held."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to hand back this way
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    """`root`'s submodule at the dotted `name` := `module`."""
    owner_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(owner_name) if owner_name else root, attr, module)


def _name_of(model: nn.Module, module: nn.Module | None) -> str:
    return next((n for n, m in model.named_modules() if m is module), "")


def _layer_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


def load_whole_shadow_model(path: str, precision: str, device: str = "cpu") -> PreTrainedModel:
    """The old way, for a model the layer-by-layer load does not take: the whole checkpoint through
    `from_pretrained` (at float32 for the quantized precisions), then quantized. On a CUDA device
    the quantized linears are made on the host from views and quantized on their way to the GPU."""
    if precision not in PRECISIONS or precision == "auto":
        raise ValueError(
            f"shadow.precision={precision!r}: load_whole_shadow_model takes a resolved precision"
        )
    dtype = _DTYPES.get(precision, torch.float32)
    if str(path).endswith(".gguf"):  # transformers' own GGUF loader, with the config odmoe serves
        from odmoe.models.gguf_checkpoint import gguf_location

        directory, name = gguf_location(path)
        config = open_checkpoint(path).config
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    target = torch.device(device)
    if precision in QUANTIZED:
        for name, module in experts_modules_named(model):
            if getattr(module, "has_bias", False):  # gpt-oss: its biased experts stay fused, unquantized
                continue
            owner = model.get_submodule(name.rpartition(".")[0])
            llama4 = isinstance(getattr(owner, "router", None), Llama4Router)
            unfused = UnfusedBmmExperts if llama4 else UnfusedExperts
            owner.experts = unfused.from_fused(module, model.config.hidden_act, copy=False)
        _quantize_linears(model, precision, target)
        head = model.get_output_embeddings()
        if precision in HEAD_QUANTIZED and type(head) is nn.Linear:
            new_head = quantized_linear(head.weight, head.bias, precision, target)
            _set_module(model, _name_of(model, head), new_head)
    model = model.to(target)
    model.eval()
    return model


def router_modules(model: nn.Module, num_experts: int) -> list[tuple[int, nn.Module]]:
    """(layer, router) of every routed MoE layer: the `mlp.gate` (Phi-3.5-MoE, gpt-oss:
    `mlp.router`; Llama 4: `feed_forward.router`) whose weight is [experts, hidden] (Qwen2-MoE's
    one-output shared-expert gate is not one). `router_output` reads its forward's output as
    (logits [T, E], top_k_weights [T, k], top_k_index [T, k])."""
    found = [
        (_layer_of(name), module)
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
    """Bytes of the model's weights as stored (quantized tensors at their packed size).

    Not through `state_dict()`: it unpacks every dynamic-int8 linear's packed weight into a new
    tensor at once, which at real width took the shadow's peak from 2.5 to 4.5 GiB (twice its size)
    just to count its bytes."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    for module in model.modules():
        if isinstance(module, DynamicInt8Linear):  # packed params are neither parameters nor buffers
            rows, columns = module.out_features, module.in_features
            total += rows * columns + 4 * rows  # int8 + fbgemm's int32 column offsets
            bias = module.bias()  # unpacks this one linear's weight a moment: one at a time
            total += bias.numel() * bias.element_size() if bias is not None else 0
    for parameter in model.parameters():  # bitsandbytes keeps its scales beside the packed weight
        quant_state = getattr(parameter, "quant_state", None)  # nf4 / fp4: absmax, code, ...
        if quant_state is not None:
            total += sum(_tensor_bytes(v) for v in quant_state.as_dict(packed=True).values())
        total += _tensor_bytes(getattr(parameter, "SCB", None))  # bnb int8: a scale per row
    return total


def _tensor_bytes(value) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
