"""`odmoe-make-model`: write a small random-init MoE checkpoint + tokenizer to a directory.

odmoe-make-model --demo --out /tmp/demo   # the demo model (what model.path=demo trains on first use)
odmoe-make-model --family qwen2_moe --out /tmp/qwen-tiny --layers 4 --experts 8 --top-k 2 --seed 1
odmoe-make-model --family deepseek_v3 --out /tmp/ds3-tiny --experts 16 --top-k 4 --intermediate 32
odmoe-make-model --train --family deepseek_v3 --out /tmp/ds3-trained   # the DeepSeek benchmark model
odmoe-make-model --family deepseek_v3 --dtype bfloat16 --fp8 32 --out /tmp/ds3-fp8   # as FP8 releases are
odmoe-make-model --family gpt_oss --dtype bfloat16 --mxfp4 --out /tmp/oss-mxfp4   # as gpt-oss is released
odmoe-make-model --family qwen3_moe --hidden 256 --intermediate 768 --gguf Q4_K_M --out /tmp/q3-gguf
                                        # a GGUF file as llama.cpp writes one (odmoe[gguf])
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from dataclasses import fields

from odmoe.models.open_model import open_checkpoint
from odmoe.tools.gguf_export import GGUF_TYPES
from odmoe.tools.model_factory import FAMILIES, ModelSpec, make_model

# the options beside --family, --out and ModelSpec's fields, in --help's order
_OPTIONS: dict[str, dict] = {
    "--max-shard-size": dict(default=None, help='e.g. "200KB": write a sharded checkpoint'),
    "--fast-fill": dict(
        action="store_true",
        help="real-width random weights in seconds, not minutes (speed benchmarks; GPU suite): every "
        "matrix cut from one seeded random pool; shards of --max-shard-size (default 4GB)",
    ),
    "--train": dict(
        action="store_true",
        help="train a benchmark model instead of random init: --family mixtral (default; ~15 M "
        "parameters), deepseek_v3 (~8 M) or qwen3_next (~10 M, hybrid attention); the size options "
        "are then fixed, only --seed applies",
    ),
    "--demo": dict(
        action="store_true",
        help="train the demo model (odmoe-launch's model.path=demo: ~2 min on 2 cores) into --out; "
        "the other options do not apply",
    ),
    "--fp8": dict(
        type=int,
        default=0,
        metavar="BLOCK",
        help="then store it as the block-wise FP8 releases are (DeepSeek-V3: 128), with BLOCK x BLOCK "
        "scale blocks, by transformers' own FP8 quantizer",
    ),
    "--mxfp4": dict(
        action="store_true", help="--family gpt_oss: then store its experts as gpt-oss's MXFP4 release does"
    ),
    "--gguf": dict(
        choices=GGUF_TYPES,
        default=None,
        metavar="TYPE",
        help="--family qwen2_moe / qwen3_moe: write it as one GGUF file of TYPE in --out "
        f"(model-TYPE.gguf), named and laid out as llama.cpp's converter does ({', '.join(GGUF_TYPES)}); "
        "K-quant blocks need --hidden and --intermediate multiples of 256",
    ),
    "--gguf-shards": dict(type=int, default=1, help="--gguf: split into N shard files"),
    "--steps": dict(
        type=int,
        default=None,
        help="--train: optimizer steps (default: mixtral 850, ~10 min on 2 cores; deepseek_v3 400)",
    ),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="odmoe-make-model", description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="mixtral")
    parser.add_argument("--out", required=True, help="directory to write (replaced if it exists)")
    for f in fields(ModelSpec):
        if f.name != "family":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    for flag, options in _OPTIONS.items():
        parser.add_argument(flag, **options)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level="INFO", format="%(message)s")
    args = parse_args(argv)
    try:
        spec = ModelSpec(**{f.name: getattr(args, f.name) for f in fields(ModelSpec)})
    except ValueError as exc:
        print(f"odmoe-make-model: {exc}", file=sys.stderr)
        return 2
    if (made := _make(spec, args)) is None:
        return 2
    spec, out = made
    if args.fp8:
        from odmoe.tools.fp8_checkpoint import quantize_fp8

        out = quantize_fp8(out, out, (args.fp8, args.fp8))
    if args.mxfp4:
        if spec.family != "gpt_oss":
            print("odmoe-make-model: --mxfp4 stores gpt-oss's experts (--family gpt_oss)", file=sys.stderr)
            return 2
        from odmoe.tools.mxfp4_checkpoint import quantize_mxfp4

        out = quantize_mxfp4(out, out)
    if args.gguf:
        out = _as_gguf(out, args.gguf, args.gguf_shards, args.seed)
        if out is None:
            return 2
    print(_summary(out, spec.family))
    return 0


def _make(spec: ModelSpec, args: argparse.Namespace):
    """The checkpoint the options ask for, as (its spec, its directory), or None (a refusal printed)."""
    if args.demo:
        from odmoe.tools.training import DEMO_SPEC, train_demo

        return DEMO_SPEC, train_demo(args.out)  # as model.path=demo trains it: the same weights
    if args.train:
        from dataclasses import replace

        from odmoe.tools.training import TRAINED_SETTINGS, TRAINED_SPECS, train_model

        if spec.family not in TRAINED_SPECS:
            print(f"odmoe-make-model: --train makes {' or '.join(TRAINED_SPECS)} models", file=sys.stderr)
            return None
        settings = replace(TRAINED_SETTINGS[spec.family], seed=args.seed)
        if args.steps is not None:
            settings = replace(settings, steps=args.steps)
        spec = TRAINED_SPECS[spec.family]
        return spec, train_model(args.out, spec, settings)
    if args.fast_fill:
        from odmoe.tools.model_factory import make_wide_model

        return spec, make_wide_model(spec, args.out, max_shard_size=args.max_shard_size or "4GB")
    return spec, make_model(spec, args.out, max_shard_size=args.max_shard_size)


def _summary(out, family: str) -> str:
    """One line on the checkpoint written: its size, MoE layers, experts and their bytes."""
    from odmoe.models.main_model import resolve_dtype

    ckpt = open_checkpoint(out)
    expert, form = ckpt.expert(ckpt.moe_layers[0], 0), ckpt.quantized_experts
    saved_dtype = resolve_dtype("auto", ckpt)  # an FP8 expert comes dequantized to float32
    expert_bytes = (expert.gate_up.numel() + expert.down.numel()) * saved_dtype.itemsize
    total = sum(math.prod(ckpt.tensor_info(k).shape) for k in ckpt.weight_map)  # headers only
    return (
        f"{out}: {family}, {total / 1e6:.2f} M parameters, {len(ckpt.moe_layers)} MoE layers x "
        f"{ckpt.num_experts} experts of {expert_bytes / 1024:.0f} KiB"
        + (f" ({_stored_bytes(ckpt) / 1024:.0f} KiB as stored in {form.upper()})" if form else "")
    )


def _as_gguf(model_dir, qtype: str, shards: int, seed: int):
    """The model in `model_dir` rewritten as a GGUF file in its place (the file's path), or None."""
    import shutil
    import tempfile
    from pathlib import Path

    from odmoe.tools.gguf_export import write_gguf

    model_dir = Path(model_dir)
    source = Path(tempfile.mkdtemp(prefix=".safetensors-", dir=model_dir.parent))
    try:
        shutil.rmtree(source)
        model_dir.rename(source)
        return write_gguf(source, model_dir, qtype, shards=shards, seed=seed)
    except ImportError:
        print("odmoe-make-model: --gguf needs the gguf package: pip install 'odmoe[gguf]'", file=sys.stderr)
        return None
    except ValueError as exc:
        print(f"odmoe-make-model: {exc}", file=sys.stderr)
        return None
    finally:
        shutil.rmtree(source, ignore_errors=True)


def _stored_bytes(ckpt) -> int:
    return ckpt.quantized_expert(ckpt.moe_layers[0], 0).nbytes


if __name__ == "__main__":
    sys.exit(main())
