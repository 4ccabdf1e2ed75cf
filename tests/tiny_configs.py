"""Tiny in-memory configs of each family for unit tests that need no tokenizer or files."""

from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

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
}
