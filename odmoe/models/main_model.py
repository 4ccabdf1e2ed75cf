"""Main's model: the Hugging Face model with its routed experts replaced by remote calls.

Contract: `build_main_model` returns transformers' own `*ForCausalLM` (attention, KV cache, norms,
routers, shared experts, dense layers, lm_head all unchanged) whose expert tensors were never read
from disk: they stay on the `meta` device. Each experts module is registered under the experts
implementation "odmoe_remote", which forwards `(layer, hidden[T, H], top_k_index, top_k_weights)` to
whatever `ExpertCall` is attached. The kernel transformers would have used for the reference is kept
in `MainModel.kernel` so the remote side reproduces it exactly (see expert_math).

Every family odmoe serves but Llama 4 computes its routed experts through transformers' experts
interface, DeepSeek-V2/V3 included, so the router's output (DeepSeek: float32 weights, already normalised
and multiplied by `routed_scaling_factor` inside the router) reaches the remote call exactly as it
would reach transformers' kernel. Persistent buffers (DeepSeek-V3's `e_score_correction_bias`) are
loaded like parameters, and every tensor takes the dtype `from_pretrained(dtype=...)` would give it,
read from the model class by `load_dtypes` (DeepSeek's router weight stays float32 at bf16).

Llama 4's MoE block (`Llama4TextMoe`) calls its experts module on rows already scaled by the
router, for every expert and every token; main replaces the block's forward with
`_llama4_moe_forward`, which runs the same router, hands the remote call the tokens' rows and the
router's top-k choice and scores (expert_math's kernel "bmm" scales and sums as the block does),
and adds the shared expert as the block does.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from odmoe.models.checkpoint import Checkpoint, CheckpointError
from odmoe.models.expert_math import kernel_of
from odmoe.models.load_dtypes import loaded_dtypes

REMOTE = "odmoe_remote"

# (layer, hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]
ExpertCall = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _remote_experts_forward(module, hidden, top_k_index, top_k_weights):
    return module.odmoe_call(module.odmoe_layer, hidden, top_k_index, top_k_weights)


ALL_EXPERTS_FUNCTIONS.register(REMOTE, _remote_experts_forward)


def llama4_choice(
    top_k: int, scores: torch.Tensor, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's router output (scores [T, E], logits [T, E]) as (top_k_index, top_k_weights): the
    top-k logits by the router's own `topk` call (so ties break alike) and their scores."""
    top_k_index = torch.topk(logits, top_k, dim=1).indices
    return top_k_index, scores.gather(1, top_k_index)


def _llama4_moe_forward(self, hidden_states):
    """Llama4TextMoe.forward with the routed experts remote: the same router and choice, the same
    shared expert and in-place add."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden_states)
    top_k_index, top_k_weights = llama4_choice(self.top_k, router_scores, router_logits)
    experts = self.experts
    routed = experts.odmoe_call(experts.odmoe_layer, hidden_states, top_k_index, top_k_weights)
    out = self.shared_expert(hidden_states)
    out.add_(routed)
    return out, router_logits


@dataclass
class MainModel:
    model: PreTrainedModel
    kernel: str  # experts kernel of the reference: transformers' implementation ("grouped_mm"/"eager"), "bmm"
    moe_layers: list[int]
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")  # where main computes (`model.device`)

    @property
    def device_bytes(self) -> int:
        """Weights main holds (everything but the routed experts, which stay on `meta`)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.device.type != "meta")

    def attach(self, call: ExpertCall) -> None:
        for layer, module in experts_modules(self.model):
            module.odmoe_layer = layer
            module.odmoe_call = call


def resolve_dtype(name: str, checkpoint: Checkpoint) -> torch.dtype:
    """ "auto" is what `from_pretrained` uses by default: the dtype the checkpoint was saved in."""
    if name == "auto":
        saved = getattr(checkpoint.config, "dtype", None) or getattr(checkpoint.config, "torch_dtype", None)
        if isinstance(saved, torch.dtype):
            return saved
        return getattr(torch, str(saved)) if saved else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"model.dtype={name!r} is not a floating-point torch dtype")
    return dtype


def experts_modules_named(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, experts module) of every routed-experts block."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if name.endswith(".experts") and hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")
    ]


def experts_modules(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(layer, experts module) for every routed-experts block, found by the fused parameter names."""
    found = []
    for name, module in model.named_modules():
        if name.endswith(".experts") and hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            found.append((int(name.split(".layers.")[1].split(".")[0]), module))
    return sorted(found, key=lambda item: item[0])


def build_main_model(
    checkpoint: Checkpoint, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> MainModel:
    """Main's model at `dtype` on `device` (each tensor read from disk once and put there; the routed
    experts stay on `meta` wherever main computes)."""
    device = torch.device(device)
    config = checkpoint.config
    # Parameters on `meta`, buffers real: rotary inv_freq is computed as usual, no weight allocated.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    kernel = kernel_of(checkpoint.family.expert_layout, model.config._experts_implementation)
    state = checkpoint.non_expert_state_dict()
    expert_params = {  # the routed experts' weights (and gpt-oss's biases): the workers'
        f"{name}.{p}"
        for name, module in experts_modules_named(model)
        for p, _ in module.named_parameters(recurse=False)
    }
    needed = {n for n, _ in model.named_parameters()} - expert_params
    if getattr(config, "tie_word_embeddings", False):
        needed.discard("lm_head.weight")
    missing = sorted(needed - state.keys())
    if missing:
        raise CheckpointError(f"{checkpoint.path} lacks tensors main needs: {missing[:5]}")
    dtype_of = loaded_dtypes(model, dtype)
    for key in sorted(needed):
        _set_parameter(model, key, state[key].to(device, dtype_of(key)))
    # Persistent buffers saved with the weights (DeepSeek-V3's router `e_score_correction_bias`)
    # are real tensors already (zeros); put the checkpoint's in, in the dtype from_pretrained gives them.
    for key, buffer in list(model.named_buffers()):
        owner_name, _, attr = key.rpartition(".")
        if key in state:
            value = state[key].to(device, dtype_of(key))
            setattr(model.get_submodule(owner_name), attr, value)
        elif buffer.device != device and buffer.device.type != "meta":  # rotary inv_freq, computed on CPU
            setattr(model.get_submodule(owner_name), attr, buffer.to(device))
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    if kernel == "bmm":  # Llama 4: its MoE block's forward, not an experts implementation
        for name, _ in experts_modules_named(model):
            block = model.get_submodule(name.rpartition(".")[0])
            block.forward = types.MethodType(_llama4_moe_forward, block)
    else:
        model.set_experts_implementation(REMOTE)
    model.eval()
    return MainModel(model=model, kernel=kernel, moe_layers=checkpoint.moe_layers, dtype=dtype, device=device)


def _set_parameter(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    owner_name, _, attr = key.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, attr, torch.nn.Parameter(value, requires_grad=False))
