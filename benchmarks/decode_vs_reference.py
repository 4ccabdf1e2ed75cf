"""Decode tokens/s and TTFT of a local odmoe cluster next to a single-process transformers run.

    python benchmarks/decode_vs_reference.py [--model DIR] [--workers 2 --group-size 2] [--tokens 64]

Prints a table and writes benchmarks/results/decode_vs_reference.json. Both sides run greedy on the
same prompts, same model, same dtype, on this machine; the cluster's tokens are checked equal.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import odmoe
from odmoe.model_factory import ensure_default_model

PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:\n    ", "    return sorted(items, key="]
RESULTS = Path(__file__).parent / "results"


def reference_run(path: str, prompt: str, tokens: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt")["input_ids"]
    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=2)  # warm-up
    start = time.perf_counter()
    first = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=1)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens)
    total = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    del first
    return {
        "ttft_s": ttft,
        "decode_tokens_per_s": (new - 1) / max(total - ttft, 1e-9),
        "token_ids": out[0, ids.shape[1] :].tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--overrides", nargs="*", default=[], help="cluster config words, e.g. ablation=case6"
    )
    args = parser.parse_args()
    path = args.model or str(ensure_default_model())
    torch.set_num_threads(1)  # the cluster's nodes share 2 cores; keep the reference comparable
    ref = [reference_run(path, p, args.tokens) for p in PROMPTS]
    with odmoe.LocalCluster(
        path, workers=args.workers, group_size=args.group_size, overrides=args.overrides
    ) as cluster:
        cluster.client.generate(PROMPTS[0], max_new_tokens=2)  # warm-up
        runs = [cluster.client.generate(p, max_new_tokens=args.tokens) for p in PROMPTS]
    identical = all(r.token_ids == f["token_ids"] for r, f in zip(runs, ref, strict=True))
    report = {
        "model": path,
        "overrides": args.overrides,
        "workers": args.workers,
        "group_size": args.group_size,
        "new_tokens": args.tokens,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s) for the reference",
        "tokens_identical": identical,
        "reference": {
            "decode_tokens_per_s": statistics.mean(r["decode_tokens_per_s"] for r in ref),
            "ttft_s": statistics.mean(r["ttft_s"] for r in ref),
        },
        "odmoe": {
            "decode_tokens_per_s": statistics.mean(r.stats["decode_tokens_per_s"] for r in runs),
            "ttft_s": statistics.mean(r.stats["ttft_s"] for r in runs),
            "worker_load_s_per_token": statistics.mean(
                r.stats["worker_load_s"] / r.stats["new_tokens"] for r in runs
            ),
            "worker_compute_s_per_token": statistics.mean(
                r.stats["worker_compute_s"] / r.stats["new_tokens"] for r in runs
            ),
        },
    }
    RESULTS.mkdir(exist_ok=True)
    name = "decode_vs_reference" + (
        "-" + "-".join(args.overrides).replace("=", "_") if args.overrides else ""
    )
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2))
    print(
        f"model {path}  ({args.workers} workers, group size {args.group_size}, {args.tokens} new tokens, "
        f"overrides: {' '.join(args.overrides) or 'none'})"
    )
    print(f"{'':22}{'decode tok/s':>14}{'TTFT ms':>10}")
    for name in ("reference", "odmoe"):
        print(f"{name:22}{report[name]['decode_tokens_per_s']:>14.1f}{report[name]['ttft_s'] * 1e3:>10.1f}")
    print(f"tokens identical: {identical}")


if __name__ == "__main__":
    main()
