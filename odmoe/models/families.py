"""The one table of per-family differences.

Everything odmoe needs to know about a Hugging Face MoE family that is not already in the
family's own modeling code: how its checkpoints name expert tensors on disk, how the other tensors
are renamed on load, and which config fields hold the expert counts. Routing, attention, shared
experts and dense layers stay in transformers' own classes (main runs them unchanged), so they need
no entry here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """The checkpoint is not an MoE model of a family odmoe supports."""


@dataclass(frozen=True)
class Family:
    model_type: str
    # Disk layout of one expert: "{prefix}.{layer}.{moe}.experts.{expert}.{proj}.weight".
    moe_module: str  # the MoE block's name on disk ("block_sparse_moe" or "mlp")
    gate_proj: str
    up_proj: str
    down_proj: str
    num_experts_field: str
    top_k_field: str = "num_experts_per_tok"
    # Disk-name -> module-name rewrites for the tensors main loads (transformers' own renames).
    renames: tuple[tuple[str, str], ...] = ()
    # the experts' layout (odmoe.models.expert_math.ExpertMLP): standard, gpt_oss (transposed,
    # biased, interleaved gate/up, clamped SwiGLU) or llama4 (transposed, router score applied to
    # the input, every expert a bmm over all of the layer's rows)
    expert_layout: str = "standard"
    fused_module: str = "mlp"  # the MoE block's name over fused [E, ...] expert tensors on disk

    def expert_key(self, layer: int, expert: int, proj: str) -> str:
        return f"model.layers.{layer}.{self.moe_module}.experts.{expert}.{proj}.weight"

    def fused_key(self, layer: int, name: str) -> str:
        """Key of a fused [E, ...] expert tensor, for checkpoints saved in the fused layout."""
        return f"model.layers.{layer}.{self.fused_module}.experts.{name}"

    def module_key(self, disk_key: str) -> str:
        for old, new in self.renames:
            disk_key = disk_key.replace(old, new)
        return disk_key


_MLP_STYLE = dict(moe_module="mlp", gate_proj="gate_proj", up_proj="up_proj", down_proj="down_proj")

FAMILIES: dict[str, Family] = {
    "mixtral": Family(
        "mixtral",
        moe_module="block_sparse_moe",
        gate_proj="w1",
        up_proj="w3",
        down_proj="w2",
        num_experts_field="num_local_experts",
        renames=((".block_sparse_moe.", ".mlp."),),
    ),
    "qwen2_moe": Family("qwen2_moe", num_experts_field="num_experts", **_MLP_STYLE),
    "qwen3_moe": Family("qwen3_moe", num_experts_field="num_experts", **_MLP_STYLE),
    "olmoe": Family("olmoe", num_experts_field="num_experts", **_MLP_STYLE),
    # DeepSeek-V2 and V3 (MLA attention, dense first layers, shared experts, group-limited routing)
    # save per-expert keys like Qwen; transformers 5.23 names the count `n_routed_experts` (aliased
    # `num_experts` / `num_local_experts`). Layers at or beyond `num_hidden_layers` on disk are V3's
    # multi-token-prediction layers, which `Checkpoint` skips.
    "deepseek_v2": Family("deepseek_v2", num_experts_field="n_routed_experts", **_MLP_STYLE),
    "deepseek_v3": Family("deepseek_v3", num_experts_field="n_routed_experts", **_MLP_STYLE),
    # GLM-4.5 / 4.6: DeepSeek-V3's MoE block and routing under another attention; the same disk layout
    "glm4_moe": Family("glm4_moe", num_experts_field="n_routed_experts", **_MLP_STYLE),
    # Qwen3-Next (and the Qwen3.5 MoE models built on it): Qwen's fused experts and shared expert;
    # its hybrid attention (gated DeltaNet with a recurrent state, every 4th layer full) runs on main
    # as transformers has it
    "qwen3_next": Family("qwen3_next", num_experts_field="num_experts", **_MLP_STYLE),
    # Qwen3.5's MoE language model: Qwen3-Next's architecture under its own text-only config (its
    # published checkpoints wrap it in a vision-language `qwen3_5_moe` config: not served yet)
    "qwen3_5_moe_text": Family("qwen3_5_moe_text", num_experts_field="num_experts", **_MLP_STYLE),
    # gpt-oss: fused, transposed experts with biases (gate_up_proj [E, H, 2I] + gate_up_proj_bias,
    # down_proj [E, I, H] + down_proj_bias), gate and up interleaved, a clamped SwiGLU; a biased
    # top-k router (`mlp.router`), attention sinks and sliding-window layers run on main as they are
    "gpt_oss": Family(
        "gpt_oss", num_experts_field="num_local_experts", expert_layout="gpt_oss", **_MLP_STYLE
    ),
    # Llama 4 (Scout, Maverick): fused, transposed experts (gate_up_proj [E, H, 2I], down_proj
    # [E, I, H]) outside transformers' experts interface: the router's sigmoid score scales each
    # token's row *before* the experts, which run as one bmm over every expert and every row
    # (odmoe.models.expert_math, kernel "bmm"); top-1 routing plus a shared expert, MoE on
    # interleaved layers, chunked attention on the RoPE layers
    "llama4_text": Family(
        "llama4_text",
        moe_module="feed_forward",
        gate_proj="gate_proj",
        up_proj="up_proj",
        down_proj="down_proj",
        num_experts_field="num_local_experts",
        expert_layout="llama4",
        fused_module="feed_forward",
    ),
    # ERNIE 4.5 MoE: Qwen's per-expert layout and experts; a float32 softmax router whose choice adds
    # a correction bias (`moe_statics`), shared experts, the first layer dense
    "ernie4_5_moe": Family(
        "ernie4_5_moe",
        num_experts_field="moe_num_experts",
        top_k_field="moe_k",
        renames=((".mlp.moe_statics.", ".mlp.gate.moe_statics."),),
        **_MLP_STYLE,
    ),
    # Phi-3.5-MoE: Mixtral's disk layout and expert MLP; its sparsemixer router runs on main as is
    "phimoe": Family(
        "phimoe",
        moe_module="block_sparse_moe",
        gate_proj="w1",
        up_proj="w3",
        down_proj="w2",
        num_experts_field="num_local_experts",
        renames=((".block_sparse_moe.gate.", ".mlp.router."), (".block_sparse_moe.", ".mlp.")),
    ),
}


@dataclass(frozen=True)
class Wrapper:
    """A vision-language checkpoint whose language model odmoe serves: its `text_config` is the
    model, and its tensors are those whose disk name starts with one of `text_keys`' disk prefixes,
    renamed to the text model's names (as transformers' AutoModelForCausalLM loads the same
    checkpoint). Every other tensor (the vision tower, its projector) is skipped."""

    text_keys: tuple[tuple[str, str], ...]  # (disk prefix, the text model's prefix)

    def text_key(self, disk_key: str) -> str | None:
        for disk, text in self.text_keys:
            if disk_key.startswith(disk):
                return text + disk_key[len(disk) :]
        return None


# model_type of a published multimodal checkpoint -> where its language model is
WRAPPERS: dict[str, Wrapper] = {
    # Qwen3.5 MoE (Qwen3_5MoeForConditionalGeneration): model.language_model.* and lm_head
    "qwen3_5_moe": Wrapper((("model.language_model.", "model."), ("lm_head.", "lm_head."))),
    # Llama 4 (Llama4ForConditionalGeneration): language_model.model.* and language_model.lm_head
    "llama4": Wrapper((("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))),
}


def served_config(config) -> tuple[object, Wrapper | None]:
    """The config of the model odmoe serves from a checkpoint's config: a multimodal wrapper's text
    model (with the wrapper's dtype when the text config names none), else the config itself."""
    wrapper = WRAPPERS.get(getattr(config, "model_type", None))
    if wrapper is None:
        return config, None
    text = config.text_config
    if getattr(text, "dtype", None) is None and getattr(config, "dtype", None) is not None:
        text.dtype = config.dtype
    return text, wrapper


# Matches any routed-expert tensor on disk, per-expert or fused; shared experts
# ("shared_expert", "shared_experts") do not match and stay on main.
_EXPERT_KEY = re.compile(r"\.experts\.(\d+\.|gate_up_proj|down_proj|gate_proj|up_proj)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def family_of(config) -> Family:
    config, _ = served_config(config)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        served = sorted([*FAMILIES, *WRAPPERS])
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; odmoe serves {', '.join(served)}"
        )
    family = FAMILIES[model_type]
    if not getattr(config, family.num_experts_field, 0):
        raise UnsupportedModelError(
            f"{model_type} config has no routed experts ({family.num_experts_field}=0)"
        )
    return family


def is_expert_key(key: str) -> bool:
    return _EXPERT_KEY.search(key) is not None


def layer_of_key(key: str) -> int | None:
    match = _LAYER.match(key)
    return int(match.group(1)) if match else None
