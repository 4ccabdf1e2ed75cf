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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="odmoe-make-model", description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default="mixtral")
    parser.add_argument("--out", required=True, help="directory to write (replaced if it exists)")
    for f in fields(ModelSpec):
        if f.name != "family":
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--max-shard-size", default=None, help='e.g. "200KB": write a sharded checkpoint')
    parser.add_argument(
        "--fast-fill",
        action="store_true",
        help="real-width random weights in seconds, not minutes (speed benchmarks; GPU suite): every "
        "matrix cut from one seeded random pool; shards of --max-shard-size (default 4GB)",
    )
    parser.add_argument(
        "--train",
        action="store_true",
        help="train a benchmark model instead of random init: --family mixtral (default; ~15 M "
        "parameters), deepseek_v3 (~8 M) or qwen3_next (~10 M, hybrid attention); the size options "
        "are then fixed, only --seed applies",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        help="train the demo model (odmoe-launch's model.path=demo: ~2 min on 2 cores) into --out; "
        "the other options do not apply",
    )
    parser.add_argument(
        "--fp8",
        type=int,
        default=0,
        metavar="BLOCK",
        help="then store it as the block-wise FP8 releases are (DeepSeek-V3: 128), with BLOCK x BLOCK "
        "scale blocks, by transformers' own FP8 quantizer",
    )
    parser.add_argument(
        "--mxfp4",
        action="store_true",
        help="--family gpt_oss: then store its experts as gpt-oss's MXFP4 release does",
    )
    parser.add_argument(
        "--gguf",
        choices=GGUF_TYPES,
        default=None,
        metavar="TYPE",
        help="--family qwen2_moe / qwen3_moe: write it as one GGUF file of TYPE in --out "
        f"(model-TYPE.gguf), named and laid out as llama.cpp's converter does ({', '.join(GGUF_TYPES)}); "
        "K-quant blocks need --hidden and --intermediate multiples of 256",
    )
    parser.add_argument("--gguf-shards", type=int, default=1, help="--gguf: split into N shard files")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="--train: optimizer steps (default: mixtral 850, ~10 min on 2 cores; deepseek_v3 400)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level="INFO", format="%(message)s")
    args = parse_args(argv)
    try:
        spec = ModelSpec(**{f.name: getattr(args, f.name) for f in fields(ModelSpec)})
    except ValueError as exc:
        print(f"odmoe-make-model: {exc}", file=sys.stderr)
        return 2
    if args.demo:
        from odmoe.tools.training import DEMO_SPEC, train_demo

        spec = DEMO_SPEC
        out = train_demo(args.out)  # as model.path=demo trains it: the same weights
    elif args.train:
        from dataclasses import replace

        from odmoe.tools.training import TRAINED_SETTINGS, TRAINED_SPECS, train_model

        if spec.family not in TRAINED_SPECS:
            print(f"odmoe-make-model: --train makes {' or '.join(TRAINED_SPECS)} models", file=sys.stderr)
            return 2
        settings = replace(TRAINED_SETTINGS[spec.family], seed=args.seed)
        if args.steps is not None:
            settings = replace(settings, steps=args.steps)
        spec = TRAINED_SPECS[spec.family]
        out = train_model(args.out, spec, settings)
    elif args.fast_fill:
        from odmoe.tools.model_factory import make_wide_model

        out = make_wide_model(spec, args.out, max_shard_size=args.max_shard_size or "4GB")
    else:
        out = make_model(spec, args.out, max_shard_size=args.max_shard_size)
    if args.fp8:
        from odmoe.tools.fp8_checkpoint import quantize_fp8

        out = quantize_fp8(out, out, (args.fp8, args.fp8))
    if args.mxfp4:
        if spec.family != "gpt_oss":
            print("odmoe-make-model: --mxfp4 stores gpt-oss's experts (--family gpt_oss)", file=sys.stderr)
            return 2
        from odmoe.tools.mxfp4_checkpoint import quantize_mxfp4

        out = quantize_mxfp4(out, out)
    from odmoe.models.main_model import resolve_dtype

    if args.gguf:
        out = _as_gguf(out, args.gguf, args.gguf_shards, args.seed)
        if out is None:
            return 2
    ckpt = open_checkpoint(out)
    expert, form = ckpt.expert(ckpt.moe_layers[0], 0), ckpt.quantized_experts
    saved_dtype = resolve_dtype("auto", ckpt)  # an FP8 expert comes dequantized to float32
    expert_bytes = (expert.gate_up.numel() + expert.down.numel()) * saved_dtype.itemsize
    total = sum(math.prod(ckpt.tensor_info(k).shape) for k in ckpt.weight_map)  # headers only
    print(
        f"{out}: {spec.family}, {total / 1e6:.2f} M parameters, {len(ckpt.moe_layers)} MoE layers x "
        f"{ckpt.num_experts} experts of {expert_bytes / 1024:.0f} KiB"
        + (f" ({_stored_bytes(ckpt) / 1024:.0f} KiB as stored in {form.upper()})" if form else "")
    )
    return 0


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
