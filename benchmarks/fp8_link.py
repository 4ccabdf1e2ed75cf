"""Link bytes of FP8 experts against bf16: the same DeepSeek-V3-style model stored in bf16 and as the
FP8 releases store it (transformers' own quantizer, `odmoe-make-model --fp8`), each decoding through
a local cluster with the paper's cacheless workers (every expert crosses the link as it is stored).

python -m odmoe.benchmarks.fp8_link [--tokens 32] [--block 32] [--out benchmarks/results/fp8-link.json]

Prints, per format: the experts' bytes as stored (one expert), bytes loaded per decode token and per
load, and whether the tokens equal transformers loading that checkpoint in one process.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from odmoe import LocalCluster
from odmoe.models.checkpoint import Checkpoint
from odmoe.tools.fp8_checkpoint import quantize_fp8
from odmoe.tools.model_factory import ModelSpec, make_model

SPEC = ModelSpec(family="deepseek_v3", hidden=64, intermediate=32, experts=16, top_k=4, dtype="bfloat16")
PROMPT = "def fibonacci(n):"


def reference(path: str, tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # as every node of the local cluster computes
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens)
    return out[0, ids.shape[1] :].tolist()


def run(path: str, tokens: int) -> dict:
    with LocalCluster(path, workers=2, group_size=2, overrides=["preset=paper"]) as cluster:
        got = cluster.client.generate(PROMPT, max_new_tokens=tokens)
    s = got.stats
    checkpoint = Checkpoint(path)
    key = (checkpoint.moe_layers[0], 0)
    stored = (
        checkpoint.quantized_expert(*key).nbytes
        if checkpoint.fp8_experts
        else checkpoint.expert(*key).nbytes  # as stored: bf16
    )
    return {
        "expert_bytes_stored": stored,
        "bytes_loaded_per_token": s["bytes_loaded"] / max(s["new_tokens"], 1),
        "bytes_per_load": s["bytes_loaded"] / max(s["experts_loaded"], 1),
        "experts_loaded": s["experts_loaded"],
        "tokens_equal_transformers": got.token_ids == reference(path, tokens),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m odmoe.benchmarks.fp8_link", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--block", type=int, default=32, help="FP8 scale block (the releases: 128)")
    parser.add_argument("--out", default="benchmarks/results/fp8-link.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = make_model(SPEC, Path(tmp) / "bf16")
        fp8 = quantize_fp8(bf16, Path(tmp) / "fp8", (args.block, args.block))
        rows = {"bf16": run(str(bf16), args.tokens), "fp8": run(str(fp8), args.tokens)}
    ratio = rows["fp8"]["bytes_loaded_per_token"] / rows["bf16"]["bytes_loaded_per_token"]
    print(f"{'format':<8}{'expert B':>10}{'B/token':>12}{'B/load':>10}{'loads':>8}  tokens = transformers")
    for name, r in rows.items():
        print(
            f"{name:<8}{r['expert_bytes_stored']:>10}{r['bytes_loaded_per_token']:>12.0f}"
            f"{r['bytes_per_load']:>10.0f}{r['experts_loaded']:>8}  {r['tokens_equal_transformers']}"
        )
    print(f"fp8 / bf16 link bytes per token: {ratio:.3f}")
    report = {
        "spec": SPEC.name,
        "block": args.block,
        "tokens": args.tokens,
        "rows": rows,
        "fp8_over_bf16": ratio,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
