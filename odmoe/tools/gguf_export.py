"""Small MoE models written as GGUF files, named and laid out as llama.cpp's converter writes them.

Contract: `write_gguf(model_dir, out_dir, qtype)` reads one of odmoe's own safetensors models
(odmoe.tools.model_factory) and writes `out_dir/model-{qtype}.gguf` (or shards
`model-{qtype}-00001-of-0000N.gguf` with `shards=N`): llama.cpp's tensor names (`token_embd`,
`blk.{i}.attn_q`, the experts stacked into `blk.{i}.ffn_{gate,up,down}_exps` [E, rows, cols]), its
metadata keys (`{arch}.block_count`, `expert_feed_forward_length`, ...) and its tokenizer keys
(`tokenizer.ggml.*`, the chat template), so that transformers' own GGUF loader
(`from_pretrained(dir, gguf_file=...)`) reads it as it reads a download. The `gguf` package writes
the file.

Which tensors take `qtype`, as llama.cpp's `llama-quantize` decides: every matrix (1-D tensors and
the router `ffn_gate_inp` stay F32); a matrix whose rows are not a whole number of `qtype`'s blocks
takes llama.cpp's fallback type (Q4_K -> Q5_0, Q6_K -> Q8_0, ...), else F16. `Q4_K_M` is the mix
llama.cpp's Q4_K_M writes: Q6_K for `output`, and for `attn_v` and `ffn_down_exps` in the layers it
gives more bits, Q4_K elsewhere.

The values: F32 / F16 / BF16 and the types the `gguf` package quantizes (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0) are the model's weights rounded by the package. The package dequantizes but does not quantize
the K- and IQ-types, so their blocks are drawn at random, each field in its range (any byte is a
valid quant or scale index), with the blocks' float16 scales set so that every row has the standard
deviation of the model's row it replaces: a valid file of the same shape and weight scale, whose
values are its own.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from odmoe.tools.model_factory import built_beside

GGUF_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q4_K_M",
    "IQ4_NL",
    "IQ4_XS",
)
# llama.cpp's architecture names for the families transformers reads from GGUF
ARCHITECTURES = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# byte offsets of a block's float16 scales (d, and dmin where there is one): the values are linear in
# them when they are all set to one number, which is how random blocks get their weight scale
_F16_FIELDS = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}
# llama-quantize's type for a tensor whose rows do not hold whole blocks of the type asked for
_FALLBACK = {
    "Q2_K": "IQ4_NL",
    "Q3_K": "IQ4_NL",
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
    "IQ4_XS": "IQ4_NL",
}
_FILE_TYPES = {  # general.file_type (llama.cpp's LlamaFileType) per type asked for
    "F32": "ALL_F32",
    "F16": "MOSTLY_F16",
    "BF16": "MOSTLY_BF16",
    "Q8_0": "MOSTLY_Q8_0",
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_1": "MOSTLY_Q4_1",
    "Q5_0": "MOSTLY_Q5_0",
    "Q5_1": "MOSTLY_Q5_1",
    "Q2_K": "MOSTLY_Q2_K",
    "Q3_K": "MOSTLY_Q3_K_M",
    "Q4_K": "MOSTLY_Q4_K_S",
    "Q5_K": "MOSTLY_Q5_K_S",
    "Q6_K": "MOSTLY_Q6_K",
    "Q4_K_M": "MOSTLY_Q4_K_M",
    "IQ4_NL": "MOSTLY_IQ4_NL",
    "IQ4_XS": "MOSTLY_IQ4_XS",
}


def gguf_file_name(qtype: str, shard: int = 0, shards: int = 1) -> str:
    """llama.cpp's naming: `model-Q4_K.gguf`, or `model-Q4_K-00001-of-00003.gguf` for a shard."""
    return f"model-{qtype}.gguf" if shards == 1 else f"model-{qtype}-{shard + 1:05d}-of-{shards:05d}.gguf"


def tensor_type(name: str, cols: int, qtype: str, layer: int | None, layers: int) -> str:
    """The ggml type llama.cpp gives tensor `name` (rows of `cols` values) in a `qtype` file."""
    import gguf

    if name.endswith(".bias") or "ffn_gate_inp" in name or "norm" in name:
        return "F32"
    if qtype == "Q4_K_M":
        more_bits = layer is not None and (
            layer < layers / 8 or layer >= 7 * layers / 8 or (layer - layers / 8) % 3 == 2
        )
        wants = (
            "Q6_K"
            if name == "output.weight" or (more_bits and ("attn_v" in name or "ffn_down" in name))
            else "Q4_K"
        )
    else:
        wants = qtype
    while cols % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[wants]][0]:
        wants = _FALLBACK.get(wants, "F16")
    return wants


def block_bytes(values: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """`values` [..., cols] float32 as `qtype`: ggml's bytes [..., cols / block * block_bytes] uint8
    (or float32 / float16 values for F32 / F16)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return values.astype(np.float32)
    if qtype not in _F16_FIELDS:  # F16, BF16 and the types the package quantizes itself
        return gguf.quants.quantize(values.astype(np.float32), kind)
    rows = values.reshape(-1, values.shape[-1]).astype(np.float64)
    return _random_blocks(rows, qtype, rng).reshape(*values.shape[:-1], -1)


def _random_blocks(rows: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random valid `qtype` blocks for `rows` [R, cols]: every quant, sub-block scale and min drawn
    at random, then each row's float16 `d` (and `dmin`) set so the row has mean ~0 and the standard
    deviation of the row it replaces. A block's values are linear in d and dmin
    (`d * scale * q - dmin * min`), so two dequantizations, one with (d, dmin) = (1, 0) and one with
    (0, 1), say which d and dmin give that mean and spread."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block_values, nbytes = gguf.GGML_QUANT_SIZES[kind]
    count = rows.shape[1] // block_values
    blocks = rng.integers(0, 256, size=(rows.shape[0], count, nbytes), dtype=np.uint8)
    fields = _F16_FIELDS[qtype]  # (d,) or (d, dmin)

    def values_with(*scales: np.ndarray) -> np.ndarray:  # per row d (and dmin) -> dequantized [R, cols]
        for offset, scale in zip(fields, scales, strict=True):
            f16 = np.broadcast_to(np.asarray(scale, np.float16).reshape(-1, 1), (rows.shape[0], count))
            blocks[..., offset : offset + 2] = f16[..., None].view(np.uint8).reshape(*f16.shape, 2)
        return gguf.quants.dequantize(blocks.reshape(rows.shape[0], -1), kind).astype(np.float64)

    ones, zeros = np.ones(rows.shape[0]), np.zeros(rows.shape[0])
    if len(fields) == 2:
        scaled, minus_min = values_with(ones, zeros), values_with(zeros, ones)
        ratio = -scaled.mean(1) / np.minimum(minus_min.mean(1), -1e-6)  # dmin / d for a mean of ~0
        unit = scaled + ratio[:, None] * minus_min
    else:
        ratio, unit = zeros, values_with(ones)
    spread = unit.std(1)
    d = np.where(spread > 0, rows.std(1) / np.maximum(spread, 1e-30), 0.0)
    values_with(*((d, d * ratio) if len(fields) == 2 else (d,)))
    return blocks.reshape(rows.shape[0], -1)


def _gguf_tensors(model_dir: Path, arch: str) -> dict[str, np.ndarray]:
    """Every tensor of the model under llama.cpp's name, float32, in its GGUF layout."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in model.state_dict().items():
        value = tensor.detach().float().numpy()
        if hf_name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: llama.cpp stacks gate and up apart
            layer = hf_name.split(".")[2]
            half = value.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = value[:, :half]
            out[f"blk.{layer}.ffn_up_exps.weight"] = value[:, half:]
            continue
        base, _, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = hf_name, "weight"
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name} in llama.cpp's {arch} map")
        if gguf_name.endswith("ffn_gate_inp_shexp"):  # [1, H] -> [H], as llama.cpp stores it
            value = value.reshape(-1)
        out[f"{gguf_name}.{suffix}"] = value
    return out


def _write_metadata(writer, config, arch: str, qtype: str, tokenizer_dir: Path) -> None:
    import gguf

    writer.add_name(f"odmoe {arch} {qtype}")
    writer.add_file_type(int(gguf.LlamaFileType[_FILE_TYPES[qtype]]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    else:
        head_dim = config.head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    _write_tokenizer(writer, tokenizer_dir)


def _write_tokenizer(writer, tokenizer_dir: Path) -> None:
    """The byte-level BPE odmoe's models carry, as llama.cpp writes a Qwen tokenizer ("gpt2" model,
    "qwen2" pre-tokenizer; special tokens marked control)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = sorted(state["model"]["vocab"].items(), key=lambda item: item[1])
    special = {t["content"] for t in state["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in special else 1 for token, _ in vocab])  # 3: CONTROL
    merges = state["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(
    model_dir: str | Path, out_dir: str | Path, qtype: str, shards: int = 1, seed: int = 0
) -> Path:
    """`model_dir` (one of odmoe's qwen2_moe / qwen3_moe models) as a `qtype` GGUF file in `out_dir`
    (replaced); returns the file's path (the first shard's)."""
    import gguf
    from transformers import AutoConfig

    if qtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type {qtype!r} is not one of {', '.join(GGUF_TYPES)}")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = AutoConfig.from_pretrained(model_dir)
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(
            f"a {config.model_type} model cannot be written as GGUF here: transformers reads "
            f"{', '.join(ARCHITECTURES)} from GGUF"
        )
    tensors = _gguf_tensors(model_dir, arch)
    rng = np.random.default_rng(seed)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with built_beside(out_dir) as tmp:
        writer = gguf.GGUFWriter(
            tmp / gguf_file_name(qtype),
            arch,
            split_max_tensors=-(-len(tensors) // shards) if shards > 1 else 0,
        )
        _write_metadata(writer, config, arch, qtype, model_dir)
        for name, value in tensors.items():
            layer = int(name.split(".")[1]) if name.startswith("blk.") else None
            kind = tensor_type(name, value.shape[-1], qtype, layer, config.num_hidden_layers)
            data = block_bytes(value, kind, rng)
            raw = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out_dir / gguf_file_name(qtype, 0, shards)
