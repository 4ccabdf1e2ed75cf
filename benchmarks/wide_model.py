"""The real-width Mixtral-shaped bf16 checkpoint the standalone benchmarks share (share_pull,
join_cluster): its command-line options and its spec (`odmoe.tools.model_factory.make_wide_model`
makes it: random weights, real width)."""

from __future__ import annotations

import argparse

from odmoe.tools.model_factory import ModelSpec


def add_wide_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3584)
    parser.add_argument("--experts", type=int, default=8)


def wide_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(
        family="mixtral", layers=args.layers, hidden=args.hidden, intermediate=args.intermediate,
        experts=args.experts, top_k=2, heads=16, kv_heads=4, vocab=4096, dtype="bfloat16",
    )  # fmt: skip
