"""The real-width Mixtral-shaped bf16 checkpoint the benchmarks share (share_pull, join_cluster,
gguf_link, suite memory): its command-line options and its spec (`odmoe.tools.model_factory.make_wide_model`
makes it: random weights, real width)."""

from __future__ import annotations

import argparse

from odmoe.tools.model_factory import ModelSpec


def add_wide_model_args(parser: argparse.ArgumentParser, layers: int = 8) -> None:
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3584)
    parser.add_argument("--experts", type=int, default=8)


def wide_spec(shape, **changes) -> ModelSpec:
    """`shape`: anything with layers, hidden, intermediate and experts (the parsed options, a suite's
    config); `changes` win over it and the defaults (family, vocab, ...)."""
    widths = {k: getattr(shape, k) for k in ("layers", "hidden", "intermediate", "experts")}
    defaults = {
        "family": "mixtral",
        "top_k": 2,
        "heads": 16,
        "kv_heads": 4,
        "vocab": 4096,
        "dtype": "bfloat16",
    }
    return ModelSpec(**{**defaults, **widths, **changes})
