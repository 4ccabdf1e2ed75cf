"""One decode iteration of several requests in one pass through main's layers, each request's rows
bit for bit what its own batch-of-one forward pass computes.

Contract: `BatchedDecode.supports(main)` says whether main's family has the decoder layer this
module replays (norm, attention, residual add, norm, MoE or MLP block, residual add: Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4-MoE); `BatchedDecode(main).step(inputs, running)` is one
decode iteration for every `DecodeInput` (a request's input token and its own K/V cache), a
`DecodePass` its caller iterates one decoder layer at a time (between two layers nothing of the pass
is active: main may prefill a prompt there); once through, its `logits` are each request's
last-position logits [1, V] (float32, on the host), each cache updated as that request's own
`model(input_ids, attention_mask, cache, logits_to_keep=1)` call would update it. The
engine uses it when two or more requests decode in one tick (`server.decode=batched`, the default
where the family is supported); a request alone, a prefill and every other family take
transformers' own forward pass per request as before.

Why the bits are the request's own (DESIGN: lossless batching). transformers' own decoder layers run
once on all the requests' rows [B, 1, H] under `RowExact`, a torch function mode that makes
every op whose result for a row could depend on the rows around it compute each request's rows as
that request alone would:
- attention: transformers' attention function called per request (its query row, its own K/V
  cache through `_BatchCache`, its own causal mask built as its model forward builds it);
- `linear` (projections, routers, shared experts, lm_head): one `bmm` of one-row matrices against
  the weight, which the GEMM computes as the batch-of-one `linear`. The first time a shape (rows,
  weight, dtype, device) is met the result is compared with the per-row `linear`s, on that input
  and on 8 random ones of the shape; if any bit differs, that shape is computed row by row from
  then on, so a BLAS that picks another kernel costs speed, never bits;
- reductions (sum, mean, softmax, top-k, norms, ...): per request, as they run alone (how torch
  splits a reduction depends on the whole tensor's shape);
- transcendental elementwise functions (exp, sigmoid, silu, cos, sin, ...): per request. torch
  computes them by SIMD approximations in its vector loop's body and by libm in its tail, and a row
  that is all tail alone (16 values) is all body among 4 rows (GLM-4-MoE's router sigmoid differed);
- the rest is exact whatever the batch: arithmetic (+ - * /, sqrt) is correctly rounded on both
  paths, views, gathers and concatenations move bits;
- the routed experts' rows go to the workers split per request (the pass's `ForwardPass` has one
  request per row: `RemoteExperts` exchanges them as one decode layer),
  exactly the rows, choices and combine each request's own call makes.
`tests/test_batched_decode.py` compares every request's final logits with its alone run, bit for
bit, per family, dtype and shapes that put rows in loop tails. What it saves is main's per-request
Python and small-op overhead: one call of each projection, norm, router and the lm_head for all.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from odmoe.main.exchange_records import ForwardPass, forward_pass
from odmoe.models.main_model import MainModel

log = logging.getLogger("odmoe.main")
__all__ = ["BatchedDecode", "DecodeInput", "RowExact"]

# model_type -> how its model forward picks each layer's causal mask
FAMILIES = {
    "mixtral": "sliding_window",
    "qwen3_moe": "sliding_window",
    "qwen2_moe": "layer_types",
    "olmoe": "causal",
    "glm4_moe": "causal",
}  # not DeepSeek: its attention expands the cached latent K/V between the cache and the attention call
ATTENTION = ("sdpa", "eager")  # implementations whose per-request call is transformers' own math


@dataclass
class DecodeInput:
    """One decoding request: its input token [1, 1], its K/V cache, and the positions its attention
    mask covers (prompt + tokens so far, this one included)."""

    token: torch.Tensor
    cache: DynamicCache
    positions: int


# where `dim` sits among the positional arguments, and its default, where not (1, None: none)
_DIM_AT: dict = {F.normalize: (2, 1)} | {
    getattr(owner, name): at
    for name, at in (("topk", (2, -1)), ("norm", (2, None)), ("sort", (1, -1)), ("argsort", (1, -1)))
    for owner in (torch, torch.Tensor)
}


def _reduced_dims(func, args, kwargs, ndim: int) -> set[int] | None:
    """The dims a reduction call reduces over (None: all of them, or unknown)."""
    if func in (F.rms_norm, F.layer_norm):
        shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else None)
        return set(range(ndim - len(shape), ndim)) if shape is not None else None
    if func is F.group_norm:
        return None
    at, default = _DIM_AT.get(func, (1, None))
    dim = kwargs.get("dim", args[at] if len(args) > at else default)
    if isinstance(dim, bool):
        return None
    if isinstance(dim, int):
        return {dim % ndim}
    if isinstance(dim, (tuple, list)) and all(isinstance(d, int) for d in dim):
        return {d % ndim for d in dim}
    return None


def _bmm_agrees_on_samples(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, samples=8
) -> bool:
    """Whether bmm equals the one-row `linear` on random inputs of x's shape too: one input proves
    little (Qwen2-MoE's shared-expert gate, [2, 48] x [1, 48], agreed on its first call and then
    differed on 42 of the next ones: alone that call is a dot product, whose partial sums bmm does
    not keep)."""
    generator = torch.Generator(device=x.device).manual_seed(0)
    for _ in range(samples):
        sample = torch.randn(x.shape, generator=generator, device=x.device).to(x.dtype)
        if not torch.equal(_bmm_linear(sample, weight, bias), _linear_per_row(sample, weight, bias)):
            return False
    return True


def _linear_per_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` of each index of x's first dim alone, as its request's own call computes it."""
    return torch.cat([F.linear(x[b : b + 1], weight, bias) for b in range(x.shape[0])])


def _bmm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`linear` of each index of x's first dim as a one-row matrix: [B, ..., in] -> [B, ..., out]."""
    rows = x.shape[0]
    xs = x.reshape(rows, -1, x.shape[-1])
    wt = weight.t().unsqueeze(0).expand(rows, weight.shape[1], weight.shape[0])
    if bias is None:
        y = torch.bmm(xs, wt)
    else:
        y = torch.baddbmm(bias.expand(rows, xs.shape[1], weight.shape[0]), xs, wt)
    return y.reshape(*x.shape[:-1], weight.shape[0])


# Reductions: how torch splits a reduction over SIMD lanes and threads depends on the whole tensor's
# shape, so a [B, n] tensor's rows may be summed in another order than a [1, n] one's. Not seen on
# this CPU (sums, means and softmaxes over 3-60 values of 2-8 rows all agreed), but nothing promises
# it for every shape and instruction set: each request's rows are reduced alone, as alone.
_REDUCTIONS = {
    getattr(owner, name)
    for owner in (torch, torch.Tensor)
    for name in (
        "sum", "mean", "prod", "softmax", "log_softmax", "logsumexp", "topk", "max", "min", "amax",
        "amin", "argmax", "argmin", "cumsum", "cumprod", "norm", "var", "std", "sort", "argsort",
    )
    if hasattr(owner, name)
} | {F.softmax, F.log_softmax, F.normalize, F.rms_norm, F.layer_norm, F.group_norm}  # fmt: skip
# Elementwise functions torch computes with other code in its vector loop's body than in its tail
# (exp, sigmoid, cos, ... by SIMD approximations there, by libm here): a row of 16 values is all
# tail alone and all body among 4 rows, and its bits can differ (GLM-4-MoE's router sigmoid over 16
# experts did). Each request's rows go through them alone, as alone. Arithmetic (+ - * /, sqrt,
# rsqrt) is correctly rounded on both paths and stays batched.
_UNARY = {
    getattr(owner, name)
    for owner in (torch, torch.Tensor, torch.special)
    for name in (
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sigmoid", "tanh", "sin", "cos",
        "tan", "erf", "erfc", "expit", "logit", "atan", "asin", "acos", "sinh", "cosh",
    )
    if hasattr(owner, name)
} | {
    F.silu, F.gelu, F.sigmoid, F.tanh, F.softplus, F.elu, F.selu, F.mish, F.logsigmoid, F.hardswish,
    F.glu,
}  # fmt: skip


class RowExact(TorchFunctionMode):
    """While active, with `rows` requests' rows along every tensor's first dimension: `F.linear`
    (and so every `nn.Linear`) computes each request's rows as the batch-of-one call would, by `bmm`
    where a first comparison showed it equal, else one `linear` per request; and every reduction
    (sum, mean, softmax, top-k, norms...) runs on each request's rows alone."""

    def __init__(self):
        super().__init__()
        self.verdicts: dict[tuple, bool] = {}  # (shapes, dtypes, bias, device) -> bmm is bit-exact
        self.rows = 0  # requests in the pass (0: no splitting of reductions)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REDUCTIONS:
            return self._per_row(func, args, kwargs)
        if func in _UNARY:
            return self._per_row(func, args, kwargs, unary=True)
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        rows = x.shape[0] if x.dim() > 1 else 1
        if rows == 1:
            return func(*args, **kwargs)
        key = (tuple(x.shape), tuple(weight.shape), x.dtype, weight.dtype, bias is not None, x.device.type)
        exact = self.verdicts.get(key)
        if exact is False:
            return _linear_per_row(x, weight, bias)
        y = _bmm_linear(x, weight, bias)
        if exact is None:
            alone = _linear_per_row(x, weight, bias)
            exact = self.verdicts[key] = torch.equal(y, alone) and _bmm_agrees_on_samples(x, weight, bias)
            if not exact:
                log.info("linear %s x %s (%s): bmm differs from one row at a time; per row", *key[:3])
                return alone
        return y

    def _per_row(self, func, args, kwargs, unary: bool = False):
        """A reduction over other dims than the first, or an elementwise function of one tensor, on
        each request's rows alone."""
        x = args[0] if args else None
        rows = self.rows
        if not (isinstance(x, torch.Tensor) and rows > 1 and x.dim() >= 2 and x.shape[0] == rows):
            return func(*args, **kwargs)
        if unary:
            if any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())):
                return func(*args, **kwargs)  # not a function of one tensor
        else:
            dims = _reduced_dims(func, args, kwargs, x.dim())
            if dims is None or 0 in dims:
                return func(*args, **kwargs)  # reduces across requests: not something a pass computes
        alone = [func(x[b : b + 1], *args[1:], **kwargs) for b in range(rows)]
        first = alone[0]
        if isinstance(first, torch.Tensor):
            return torch.cat(alone)
        parts = [torch.cat(column) for column in zip(*alone, strict=True)]  # (values, indices)
        return type(first)(parts) if not hasattr(first, "_fields") else type(first)(*parts)


@dataclass
class DecodePass:
    """One batched decode iteration, run by iterating it: each step is a decoder layer; between two
    steps no torch function mode and no forward pass of the experts is active, so the caller may do
    other work of main's there (a prompt's prefill, in a pass of its own), which the pass never sees.
    `logits`: each request's [1, V], once iterated to the end."""

    layers: Iterator[int]
    logits: list[torch.Tensor] = field(default_factory=list)

    def __iter__(self) -> Iterator[int]:
        return self.layers


class BatchedDecode:
    def __init__(self, main: MainModel):
        self.main, self.model = main, main.model
        self.body = main.model.model
        self.config = main.model.config
        self.row_exact = RowExact()
        rope = getattr(self.config, "rope_parameters", None) or {}
        # default RoPE is elementwise in the position; other types may rescale on the longest one
        self.rope_rowwise = rope.get("rope_type", "default") == "default"
        name = self.config._attn_implementation
        attn = self.body.layers[0].self_attn
        # what each attention module calls: the registered implementation, or its module's eager one
        self.own_attention = (
            sys.modules[type(attn).__module__].eager_attention_forward
            if name == "eager"
            else ALL_ATTENTION_FUNCTIONS[name]
        )

    @staticmethod
    def supports(main: MainModel) -> bool:
        config = main.model.config
        body = getattr(main.model, "model", None)
        layers = getattr(body, "layers", None)
        return (
            config.model_type in FAMILIES
            and main.kernel != "bmm"
            and getattr(config, "_attn_implementation", None) in ATTENTION
            and layers is not None
            and all(
                hasattr(layer, name)
                for layer in layers
                for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
            )
            and _takes_cache(type(layers[0]).forward, type(layers[0].self_attn).forward, create_causal_mask)
        )

    def _masks(self, embeds: torch.Tensor, run: DecodeInput, position_ids: torch.Tensor) -> dict:
        """The request's own causal masks, built as its model forward builds them."""
        kwargs = {
            "config": self.config,
            "inputs_embeds": embeds,
            "attention_mask": torch.ones(1, run.positions, dtype=torch.long, device=embeds.device),
            "cache": run.cache,
            "position_ids": position_ids,
        }
        how = FAMILIES[self.config.model_type]
        if how == "layer_types":
            return {
                "full_attention": create_causal_mask(**kwargs),
                "sliding_attention": create_sliding_window_causal_mask(**kwargs),
            }
        if how == "causal" or self.config.sliding_window is None:
            return {"full_attention": create_causal_mask(**kwargs)}
        return {"full_attention": create_sliding_window_causal_mask(**kwargs)}

    def _mask_type(self, i: int) -> str:
        if FAMILIES[self.config.model_type] == "layer_types":
            return self.config.layer_types[i]
        return "full_attention"

    def step(self, inputs: list[DecodeInput], running: ForwardPass) -> DecodePass:
        """The decode iteration of `inputs`, to be iterated layer by layer; `running` (`rows`: one
        request per row, in order) is whose experts calls the pass makes."""
        logits: list[torch.Tensor] = []
        return DecodePass(self._layers(inputs, running, logits), logits)

    def _layers(self, inputs: list[DecodeInput], running: ForwardPass, logits: list) -> Iterator[int]:
        """The pass, yielding the index of each decoder layer done but the last; the pass's modes
        are entered for each layer and left before the yield."""
        body, device, rows = self.body, self.main.device, len(inputs)
        ids = torch.cat([run.token for run in inputs]).to(device)  # [B, 1]
        hidden = body.embed_tokens(ids)  # [B, 1, H]
        seen = [run.cache.get_seq_length() for run in inputs]
        position_ids = torch.tensor([[p] for p in seen], device=device)  # [B, 1]
        masks = [self._masks(hidden[b : b + 1], run, position_ids[b : b + 1]) for b, run in enumerate(inputs)]
        cache = _BatchCache([run.cache for run in inputs])
        with self._inside(running, rows):
            if self.rope_rowwise:  # cos / sin of each request's position alone (the mode)
                rotary = body.rotary_emb(hidden, position_ids)
            else:
                alone = [body.rotary_emb(hidden[b : b + 1], position_ids[b : b + 1]) for b in range(rows)]
                rotary = tuple(torch.cat(part) for part in zip(*alone, strict=True))  # (cos, sin)
        layers = body.layers[: self.config.num_hidden_layers]
        for i, layer in enumerate(layers):
            with self._inside(running, rows):
                hidden = layer(
                    hidden,
                    attention_mask=_PerRequest(m[self._mask_type(i)] for m in masks),
                    position_ids=position_ids,
                    cache=cache,
                    use_cache=True,
                    position_embeddings=rotary,
                )
            if i + 1 < len(layers):
                yield i
        with self._inside(running, rows):
            out = self.model.lm_head(body.norm(hidden)[:, -1:, :])
        logits.extend(out[b : b + 1, -1, :].float().cpu() for b in range(rows))

    @contextlib.contextmanager
    def _inside(self, running: ForwardPass, rows: int):
        """Within the pass: its experts calls, attention per request, every op row-exact."""
        self.row_exact.rows = rows
        try:
            with forward_pass(running), self._attention_per_request(), self.row_exact:
                yield
        finally:
            self.row_exact.rows = 0

    @contextlib.contextmanager
    def _attention_per_request(self):
        """transformers' attention function for this model, called per request (its query row, its
        own keys, values and mask) while the decoder layers run on every request's rows."""
        name = self.config._attn_implementation
        attention = self.own_attention
        had = name in ALL_ATTENTION_FUNCTIONS._local_mapping
        previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get(name)

        def per_request(module, query, key, value, attention_mask, **kwargs):
            if not isinstance(key, _PerRequest):  # not our batch (cannot happen inside step)
                return attention(module, query, key, value, attention_mask, **kwargs)
            positions = kwargs.pop("position_ids", None)
            out = []
            for b in range(len(key)):
                if positions is not None:
                    kwargs["position_ids"] = positions[b : b + 1]
                one = query[b : b + 1]
                out.append(attention(module, one, key[b], value[b], attention_mask[b], **kwargs)[0])
            return torch.cat(out), None

        ALL_ATTENTION_FUNCTIONS[name] = per_request
        try:
            yield
        finally:
            if had:
                ALL_ATTENTION_FUNCTIONS[name] = previous
            else:
                del ALL_ATTENTION_FUNCTIONS[name]


def _takes_cache(*functions) -> bool:
    """Whether these transformers functions take the K/V cache as `cache` (as the calls here pass it):
    a release naming it otherwise would silently get none, so such a release decodes per request."""
    return all("cache" in inspect.signature(f).parameters for f in functions)


class _PerRequest(list):
    """One entry per request of the batch (its keys, values or causal mask)."""


class _BatchCache:
    """Stands where the K/V cache stands in a decoder layer: each request's new key and value rows
    go to its own cache, and each request's own keys and values come back (as `_PerRequest`)."""

    def __init__(self, caches: list[DynamicCache]):
        self.caches = caches

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rows = [
            cache.update(key_states[b : b + 1], value_states[b : b + 1], layer_idx, *args, **kwargs)
            for b, cache in enumerate(self.caches)
        ]
        return _PerRequest(k for k, _ in rows), _PerRequest(v for _, v in rows)
