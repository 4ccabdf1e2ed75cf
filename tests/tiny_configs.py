"""Tiny in-memory configs of each family for unit tests that need no tokenizer or files."""

from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

COMMON = dict(
    vocab_size=256,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# DeepSeek: layer 0 dense, layer 1 MoE; MLA; 8 routed experts in 4 groups of which 2 may be used.
DEEPSEEK = dict(
    COMMON,
    num_key_value_heads=4,
    intermediate_size=48,
    moe_intermediate_size=24,
    n_routed_experts=8,
    first_k_dense_replace=1,
    q_lora_rank=16,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_group=4,
    topk_group=2,
)

TINY = {
    "mixtral": lambda: MixtralConfig(intermediate_size=48, num_local_experts=8, **COMMON),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        intermediate_size=48,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=48,
        num_experts=8,
        **COMMON,
    ),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        intermediate_size=48, moe_intermediate_size=24, num_experts=8, head_dim=8, **COMMON
    ),
    "olmoe": lambda: OlmoeConfig(intermediate_size=48, num_experts=8, **COMMON),
    "deepseek_v2": lambda: DeepseekV2Config(
        topk_method="group_limited_greedy", routed_scaling_factor=16.0, **DEEPSEEK
    ),
    "deepseek_v3": lambda: DeepseekV3Config(routed_scaling_factor=2.5, norm_topk_prob=True, **DEEPSEEK),
}
