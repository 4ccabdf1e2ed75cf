"""Small MoE checkpoints that odmoe makes itself: no model hub is reachable at run time.

Contract: `make_model(spec, out_dir)` writes a random-init checkpoint of one family with
`save_pretrained` (safetensors, optionally sharded with an index) and a byte-level BPE tokenizer
beside it, so `AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`
work offline through the same local-path code a real checkpoint takes. Same spec, same bytes.
`ensure_default_model` creates the tiny model (`model.path=tiny`) once per cache directory, safely
under concurrency.

Every tokenizer odmoe saves carries CHAT_TEMPLATE, so `tokenizer.apply_chat_template` (the
OpenAI-style chat endpoint) works on odmoe's own models. The markers are plain text the byte-level
BPE already encodes, not new special tokens: the vocabulary, and so every cached model, is unchanged.
`add_chat_template(dir)` gives a model saved before the template existed its template file.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    DeepseekV2Config,
    DeepseekV3Config,
    Glm4MoeConfig,
    MixtralConfig,
    OlmoeConfig,
    PhimoeConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from odmoe.tools.corpora import corpus_files

log = logging.getLogger("odmoe.tools.model_factory")

# Published as vision-language checkpoints whose language model odmoe serves (models.families.WRAPPERS):
# the factory makes the whole wrapper, with a vision tower as small as it goes.
MULTIMODAL = {"qwen3_5_moe": "qwen3_5_moe_text", "llama4": "llama4_text"}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
GROUP_ROUTED = (*DEEPSEEK, "glm4_moe")  # routing limited to the best expert groups
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
DTYPES = ("float32", "float16", "bfloat16")
# Random routers give nearly uniform probabilities, so top-k would hinge on noise; scaling the
# router weights makes the choices decisive, closer to a trained model's routing.
ROUTER_SCALE = 8.0
ROUTER_WEIGHTS = ("mlp.gate.weight", "feed_forward.router.weight")
# DeepSeek-V3's aux-loss-free balancing bias, added to the sigmoid scores for the choice only. A
# random-init model would have it all zero; the factory draws it (std E_BIAS_STD) so it matters.
E_BIAS_STD = 0.05
GPT_OSS_BIAS_STD = 0.1  # gpt-oss's expert, router and sink biases, drawn so that they matter


# ChatML-like: each message is "<|role|>\n" + content + "</s>\n"; add_generation_prompt appends
# "<|assistant|>\n", after which the model writes its reply and ends it with </s> (the EOS token).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers saves and looks for it


@dataclass(frozen=True)
class ModelSpec:
    family: str = "mixtral"
    layers: int = 4
    hidden: int = 64
    intermediate: int = 128
    experts: int = 8
    top_k: int = 2
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 1024
    max_positions: int = 512
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r} is not one of {', '.join(FAMILIES)}")
        for name in (
            "layers",
            "hidden",
            "intermediate",
            "experts",
            "top_k",
            "heads",
            "kv_heads",
            "max_positions",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}")
        if self.family in GROUP_ROUTED:
            groups, topk_group = deepseek_groups(self.experts)
            if self.top_k > topk_group * (self.experts // groups):
                raise ValueError(
                    f"top_k={self.top_k} exceeds the {topk_group} of {groups} expert groups routing may use"
                )
        if self.vocab < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab={self.vocab} is too small for a byte-level tokenizer (>= 260)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def name(self) -> str:
        return (
            f"{self.family}-l{self.layers}-h{self.hidden}-e{self.experts}-k{self.top_k}"
            f"-v{self.vocab}-s{self.seed}-{self.dtype}"
        )


def hf_config(spec: ModelSpec) -> PretrainedConfig:
    common = dict(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        num_experts_per_tok=spec.top_k,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    return _CONFIGS[spec.family](spec, common)


def qwen3_next_config(spec: ModelSpec, common: dict) -> PretrainedConfig:
    """Qwen3-Next in miniature: hybrid layers, three gated-DeltaNet (linear attention with a
    recurrent state) to one full attention as the real model interleaves them, Qwen's fused
    experts with a sigmoid-gated shared expert beside them, partial rotary, q/k norms. Qwen3.5's
    MoE language model (`qwen3_5_moe_text`) is the same architecture under its own config."""
    head = spec.hidden // spec.heads
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(spec.layers)]
    if spec.family == "qwen3_5_moe_text":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

        config_class, extra = Qwen3_5MoeTextConfig, {}
    else:
        config_class, extra = Qwen3NextConfig, {"intermediate_size": spec.intermediate}
    return config_class(
        **extra,
        moe_intermediate_size=spec.intermediate,
        shared_expert_intermediate_size=spec.intermediate,
        num_experts=spec.experts,
        head_dim=head,
        layer_types=kinds,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=head,
        linear_value_head_dim=head,
        linear_num_key_heads=spec.kv_heads,
        linear_num_value_heads=spec.heads,
        **common,
    )


def qwen3_5_moe_config(spec: ModelSpec) -> PretrainedConfig:
    """Qwen3.5 MoE as published: the vision-language wrapper (`Qwen3_5MoeForConditionalGeneration`)
    around the `qwen3_5_moe_text` language model, with a one-block vision tower."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

    text = hf_config(replace(spec, family=MULTIMODAL[spec.family]))
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=spec.hidden,
        patch_size=4,
        num_position_embeddings=16,
    )
    return Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False)


def gpt_oss_config(spec: ModelSpec, common: dict) -> PretrainedConfig:
    """gpt-oss in miniature: sliding-window and full attention alternating (a window of 8 tokens, so
    the tests' requests outgrow it), attention sinks, biased projections, a biased top-k router, and
    fused, transposed, biased experts with the clamped SwiGLU (alpha 1.702, limit 7)."""
    from transformers import GptOssConfig

    return GptOssConfig(
        intermediate_size=spec.intermediate,
        num_local_experts=spec.experts,
        head_dim=spec.hidden // spec.heads,
        sliding_window=8,
        **common,
    )


def ernie4_5_moe_config(spec: ModelSpec, common: dict) -> PretrainedConfig:
    """ERNIE 4.5 MoE in miniature: the first layer dense, then MoE layers with one shared expert
    beside the routed ones; a float32 softmax router whose choice adds a correction bias (drawn)."""
    from transformers import Ernie4_5_MoeConfig

    return Ernie4_5_MoeConfig(
        intermediate_size=spec.intermediate,
        moe_intermediate_size=spec.intermediate,
        moe_num_experts=spec.experts,
        moe_num_shared_experts=1,
        moe_layer_start_index=1 if spec.layers > 1 else 0,
        head_dim=spec.hidden // spec.heads,
        **common,
    )


def llama4_text_config(spec: ModelSpec, common: dict) -> PretrainedConfig:
    """Llama 4 in miniature, Maverick's shape: MoE on every other layer (dense MLPs between), the
    routed experts beside a shared expert, chunked attention (chunks of 8 tokens, so the tests'
    requests cross them) on the RoPE layers and every fourth layer global without RoPE, with
    temperature tuning; L2-normed q/k. The spec's top_k is kept (the published models route top-1)."""
    from transformers import Llama4TextConfig

    return Llama4TextConfig(
        intermediate_size=spec.intermediate,
        intermediate_size_mlp=spec.intermediate,
        num_local_experts=spec.experts,
        head_dim=spec.hidden // spec.heads,
        interleave_moe_layer_step=2 if spec.layers > 1 else 1,
        attention_chunk_size=8,
        **common,
    )


def llama4_config(spec: ModelSpec) -> PretrainedConfig:
    """Llama 4 as published: the vision-language wrapper (`Llama4ForConditionalGeneration`) around
    the `llama4_text` language model, with a one-layer vision tower."""
    from transformers import Llama4Config, Llama4VisionConfig

    text = hf_config(replace(spec, family=MULTIMODAL[spec.family]))
    vision = Llama4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=spec.hidden,
        pixel_shuffle_ratio=0.5,
    )
    return Llama4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False)


def deepseek_groups(experts: int) -> tuple[int, int]:
    """(n_group, topk_group): 4 groups, 2 of which routing may use, where the experts allow it."""
    if experts % 4 == 0 and experts >= 8:
        return 4, 2
    return 1, 1


def deepseek_config(spec: ModelSpec, common: dict) -> PretrainedConfig:
    """DeepSeek-V2 / V3 in miniature, shaped like the real ones.

    MLA attention (q and kv LoRA ranks, a decoupled RoPE part of the query/key heads), the first
    layer dense (`first_k_dense_replace`), shared experts beside the routed ones, group-limited
    routing. `intermediate` is one routed expert's width; the dense layer is twice that. V2 routes
    with softmax + `group_limited_greedy` and scales the weights by 16 (as DeepSeek-V2 does); V3
    with sigmoid scores + `e_score_correction_bias` (made non-zero in `make_model`), group-limited
    top-k, `norm_topk_prob` and a scale of 2.5.
    """
    head = spec.hidden // spec.heads
    groups, topk_group = deepseek_groups(spec.experts)
    shape = dict(
        common,
        num_key_value_heads=spec.heads,  # MLA expands its latent to every head: no grouped K/V
        intermediate_size=2 * spec.intermediate,
        moe_intermediate_size=spec.intermediate,
        n_routed_experts=spec.experts,
        first_k_dense_replace=1 if spec.layers > 1 else 0,
        q_lora_rank=max(spec.hidden // 2, 1),
        kv_lora_rank=max(spec.hidden // 4, 1),
        qk_nope_head_dim=head,
        qk_rope_head_dim=max(head // 2, 2),
        v_head_dim=head,
        n_group=groups,
        topk_group=topk_group,
    )
    if spec.family == "deepseek_v2":
        return DeepseekV2Config(
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=16.0,
            norm_topk_prob=False,
            **shape,
        )
    return DeepseekV3Config(
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,  # no multi-token-prediction layer (main never runs one)
        **shape,
    )


def glm4_moe_config(spec: ModelSpec, common: dict) -> PretrainedConfig:
    """GLM-4.5 / 4.6 (`glm4_moe`) in miniature: DeepSeek-V3's routing (sigmoid scores + a correction
    bias, group-limited top-k, normalised and scaled weights), grouped-query attention with partial
    rotary embeddings and q/k norms, the first layer dense, one shared expert."""
    groups, topk_group = deepseek_groups(spec.experts)
    return Glm4MoeConfig(
        **common,
        intermediate_size=2 * spec.intermediate,
        moe_intermediate_size=spec.intermediate,
        n_routed_experts=spec.experts,
        n_shared_experts=1,
        first_k_dense_replace=1 if spec.layers > 1 else 0,
        n_group=groups,
        topk_group=topk_group,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        head_dim=spec.hidden // spec.heads,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        num_nextn_predict_layers=0,  # no multi-token-prediction layer (main never runs one)
    )


# each family's transformers config from the spec and the keys every family shares
_CONFIGS: dict[str, Callable[[ModelSpec, dict], PretrainedConfig]] = {
    "mixtral": lambda s, c: MixtralConfig(intermediate_size=s.intermediate, num_local_experts=s.experts, **c),
    "qwen2_moe": lambda s, c: Qwen2MoeConfig(
        intermediate_size=s.intermediate,
        moe_intermediate_size=s.intermediate,
        shared_expert_intermediate_size=s.intermediate,
        num_experts=s.experts,
        **c,
    ),
    "qwen3_moe": lambda s, c: Qwen3MoeConfig(
        intermediate_size=s.intermediate,
        moe_intermediate_size=s.intermediate,
        num_experts=s.experts,
        head_dim=s.hidden // s.heads,
        **c,
    ),
    "olmoe": lambda s, c: OlmoeConfig(intermediate_size=s.intermediate, num_experts=s.experts, **c),
    **dict.fromkeys(DEEPSEEK, deepseek_config),
    "glm4_moe": glm4_moe_config,
    # Mixtral's layout; sparsemixer routing, LayerNorm, biased attention
    "phimoe": lambda s, c: PhimoeConfig(intermediate_size=s.intermediate, num_local_experts=s.experts, **c),
    **dict.fromkeys(("qwen3_next", "qwen3_5_moe_text"), qwen3_next_config),
    "qwen3_5_moe": lambda s, c: qwen3_5_moe_config(s),
    "gpt_oss": gpt_oss_config,
    "llama4_text": llama4_text_config,
    "llama4": lambda s, c: llama4_config(s),
    "ernie4_5_moe": ernie4_5_moe_config,
}
FAMILIES = tuple(_CONFIGS)  # every family the factory makes

CORPORA = ("stdlib", "demo")  # the interpreter's own sources | the shipped demo corpus


def corpus_documents(corpus: str = "stdlib", max_bytes: int = 2_000_000) -> list[str]:
    """The texts a tokenizer or a model learns from: `stdlib` reads the running interpreter's
    sources (up to max_bytes, so they differ between Python versions); `demo` is the corpus that
    ships with odmoe (odmoe.tools.demo_corpus), the same everywhere, whole (max_bytes does not apply)."""
    if corpus == "demo":
        from odmoe.tools.demo_corpus import documents

        return list(documents())
    if corpus != "stdlib":
        raise ValueError(f"corpus {corpus!r} is not one of {', '.join(CORPORA)}")
    return [Path(p).read_text(errors="replace") for p in corpus_files(max_bytes)]


@functools.lru_cache(maxsize=4)  # making several families in one process trains once
def build_tokenizer(vocab_size: int, max_positions: int, corpus: str = "stdlib") -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    if corpus == "stdlib":
        tok.train(corpus_files(), trainer)  # how every model before the demo corpus was made
    else:
        tok.train_from_iterator(corpus_documents(corpus), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_positions,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def add_chat_template(model_dir: str | Path) -> None:
    """Give a model odmoe saved before CHAT_TEMPLATE existed its template (no-op when it has one).
    The template changes no token id, so the cached weights stay valid and keep their name."""
    model_dir = Path(model_dir)
    config = model_dir / "tokenizer_config.json"
    has_inline = config.is_file() and "chat_template" in json.loads(config.read_text())
    if has_inline or (model_dir / CHAT_TEMPLATE_FILE).is_file():
        return
    tmp = model_dir / f".{CHAT_TEMPLATE_FILE}.tmp"
    tmp.write_text(CHAT_TEMPLATE)
    os.replace(tmp, model_dir / CHAT_TEMPLATE_FILE)


def make_model(spec: ModelSpec, out_dir: str | Path, max_shard_size: str | None = None) -> Path:
    """Write checkpoint + tokenizer into out_dir atomically (a crash never leaves half a model)."""
    torch.manual_seed(spec.seed)
    # a multimodal wrapper is made whole (AutoModelForCausalLM would make its language model alone)
    auto = AutoModelForImageTextToText if spec.family in MULTIMODAL else AutoModelForCausalLM
    model = auto.from_config(hf_config(spec), dtype=getattr(torch, spec.dtype))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(ROUTER_WEIGHTS) or (
                spec.family == "gpt_oss" and name.endswith("mlp.router.weight")
            ):
                param.mul_(ROUTER_SCALE)
            if spec.family == "gpt_oss" and name.endswith(("_proj_bias", "router.bias", "self_attn.sinks")):
                param.copy_(torch.randn(param.shape) * GPT_OSS_BIAS_STD)  # zero at init: make them count
        for name, bias in [*model.named_buffers(), *model.named_parameters()]:
            # DeepSeek-V3's choice bias (a buffer), ERNIE 4.5's (a parameter): zero at init
            if name.endswith(("mlp.gate.e_score_correction_bias", "moe_statics.e_score_correction_bias")):
                bias.copy_(torch.randn(bias.shape) * E_BIAS_STD)
    _save_atomically(model, spec, Path(out_dir), max_shard_size, asdict(spec))
    log.info("wrote %s model to %s", spec.family, out_dir)
    return Path(out_dir)


def _save_atomically(model, spec: ModelSpec, out_dir: Path, max_shard_size: str | None, meta: dict) -> None:
    """The model's weights (sharded at `max_shard_size`, None: transformers' default), its tokenizer
    and `odmoe_model.json` (meta) into out_dir, atomically (`built_beside`)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with built_beside(out_dir) as tmp:
        model.save_pretrained(tmp, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        build_tokenizer(spec.vocab, spec.max_positions).save_pretrained(tmp)
        (tmp / "odmoe_model.json").write_text(json.dumps(meta, indent=2))


@contextlib.contextmanager
def built_beside(out_dir: Path) -> Iterator[Path]:
    """An empty directory beside `out_dir` to write a checkpoint into; when the block ends without an
    error it takes `out_dir`'s place (an old one removed), else it is removed: a crash never leaves
    half a model. Every maker of checkpoints here writes through it."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        yield tmp
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


POOL_ELEMENTS = 1 << 24  # random values each wide tensor is cut from


def make_wide_model(
    spec: ModelSpec, out_dir: str | Path, max_shard_size: str = "4GB", std: float = 0.02
) -> Path:
    """A random-weight checkpoint of real width, fast: for speed benchmarks, not for recall.

    `make_model` initialises every tensor the way training would, one normal draw per element: at
    Mixtral's width (a bf16 expert is 3 x 4096 x 14336 x 2 B = 352 MB) that is minutes per layer on
    the CPU. Here the skeleton is allocated uninitialised and every matrix is filled with windows of
    one pool of `POOL_ELEMENTS` normal(0, std) values, each at its own seeded offset (memory-bound
    copies), norms with ones; then `save_pretrained` writes it sharded (`max_shard_size`) with the
    index, per-expert keys and tokenizer of a real download. Same spec, same bytes."""
    from accelerate import init_empty_weights

    dtype = getattr(torch, spec.dtype)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config(spec), dtype=dtype)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(spec.seed)
    pool = (torch.randn(POOL_ELEMENTS, generator=generator) * std).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _fill_from_pool(param, pool, name, generator)
    kept = {n for n, _ in model.named_parameters()}
    for name, buffer in model.named_buffers():  # persistent buffers saved with the weights
        if name not in kept and name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * E_BIAS_STD)
    out_dir = Path(out_dir)
    _save_atomically(model, spec, out_dir, max_shard_size, {**asdict(spec), "fill": "pool", "std": std})
    log.info("wrote a wide %s model to %s", spec.family, out_dir)
    return out_dir


def _fill_from_pool(param: torch.Tensor, pool: torch.Tensor, name: str, generator: torch.Generator) -> None:
    """Norm weights (1-D, named *norm*) are ones, other 1-D tensors zeros; matrices take windows of
    `pool` starting at seeded offsets (at most a pool's length each)."""
    flat = param.data.view(-1)
    if param.dim() == 1:
        flat.fill_(1.0 if "norm" in name else 0.0)
        return
    done, n = 0, flat.numel()
    while done < n:
        take = min(n - done, pool.numel() // 2)
        start = int(torch.randint(0, pool.numel() - take + 1, (1,), generator=generator))
        flat[done : done + take].copy_(pool[start : start + take])
        done += take
    if name.endswith("mlp.gate.weight"):
        param.data.mul_(ROUTER_SCALE)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "odmoe" / "models"


def ensure_default_model(cache_dir: Path | None = None, spec: ModelSpec = ModelSpec()) -> Path:
    """The tiny random-init model at cache_dir/spec.name, made on first use (a second or so);
    concurrent callers wait for one maker."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / spec.name
    with open(cache_dir / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "odmoe_model.json").is_file():
            log.info("creating the tiny model under %s (first use only)", target)
            make_model(spec, target)
        add_chat_template(target)
    return target
