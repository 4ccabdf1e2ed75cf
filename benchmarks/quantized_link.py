"""Link bytes of quantized experts against bf16, as the releases store them: a DeepSeek-V3-style
model in bf16 and in block-wise FP8 (transformers' own quantizer, `odmoe-make-model --fp8`), and a
gpt-oss-style model in bf16 and with MXFP4 experts (`--mxfp4`), each decoding through a local
cluster with the paper's cacheless workers (every expert crosses the link as it is stored).

python -m odmoe_bench.quantized_link [--tokens 32] [--block 32] [--out FILE]

Prints, per model and format: one expert's bytes as stored, bytes loaded per decode token and per
load, and whether the tokens equal transformers loading that checkpoint in one process.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from odmoe import LocalCluster
from odmoe.models.open_model import open_checkpoint
from odmoe.tools.fp8_checkpoint import quantize_fp8
from odmoe.tools.model_factory import ModelSpec, make_model
from odmoe.tools.mxfp4_checkpoint import quantize_mxfp4
from odmoe_bench.gguf_link import reference, stored_bytes
from odmoe_bench.results import write_report

SPEC = ModelSpec(family="deepseek_v3", hidden=64, intermediate=32, experts=16, top_k=4, dtype="bfloat16")
GPT_OSS = ModelSpec(family="gpt_oss", dtype="bfloat16")
PROMPT = "def fibonacci(n):"


def run(path: str, tokens: int) -> dict:
    with LocalCluster(path, workers=2, group_size=2, overrides=["preset=paper"]) as cluster:
        got = cluster.client.generate(PROMPT, max_new_tokens=tokens)
    s = got.stats
    checkpoint = open_checkpoint(path)
    return {
        "expert_bytes_stored": stored_bytes(checkpoint, [(checkpoint.moe_layers[0], 0)]),
        "bytes_loaded_per_token": s["bytes_loaded"] / max(s["new_tokens"], 1),
        "bytes_per_load": s["bytes_loaded"] / max(s["experts_loaded"], 1),
        "experts_loaded": s["experts_loaded"],
        "tokens_equal_transformers": got.token_ids == reference(path, tokens, prompt=PROMPT),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m odmoe_bench.quantized_link", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--block", type=int, default=32, help="FP8 scale block (the releases: 128)")
    parser.add_argument("--out", default="benchmarks/results/quantized-link.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ds, oss = make_model(SPEC, Path(tmp) / "ds-bf16"), make_model(GPT_OSS, Path(tmp) / "oss-bf16")
        models = {
            "deepseek_v3 bf16": ds,
            "deepseek_v3 fp8": quantize_fp8(ds, Path(tmp) / "ds-fp8", (args.block, args.block)),
            "gpt_oss bf16": oss,
            "gpt_oss mxfp4": quantize_mxfp4(oss, Path(tmp) / "oss-mxfp4"),
        }
        rows = {name: run(str(path), args.tokens) for name, path in models.items()}
    ratios = {
        "fp8_over_bf16": rows["deepseek_v3 fp8"]["bytes_loaded_per_token"]
        / rows["deepseek_v3 bf16"]["bytes_loaded_per_token"],
        "mxfp4_over_bf16": rows["gpt_oss mxfp4"]["bytes_loaded_per_token"]
        / rows["gpt_oss bf16"]["bytes_loaded_per_token"],
    }
    print(f"{'model':<18}{'expert B':>10}{'B/token':>12}{'B/load':>10}{'loads':>8}  tokens = transformers")
    for name, r in rows.items():
        print(
            f"{name:<18}{r['expert_bytes_stored']:>10}{r['bytes_loaded_per_token']:>12.0f}"
            f"{r['bytes_per_load']:>10.0f}{r['experts_loaded']:>8}  {r['tokens_equal_transformers']}"
        )
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.3f} of the link bytes per token")
    report = {
        "specs": [SPEC.name, GPT_OSS.name],
        "fp8_block": args.block,
        "tokens": args.tokens,
        "rows": rows,
        **ratios,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
