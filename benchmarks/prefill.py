"""TTFT of batched prefill for 16- and 128-token prompts across mini-batch sizes and placements,
beside a single-process transformers run of the same model on this machine.

    python benchmarks/prefill.py [--model DIR] [--workers 2]

Prints a table and writes benchmarks/results/prefill.json. Each configuration is its own local
cluster; TTFT is the median of 5 requests per prompt length after a warm-up. Rows marked
"not exact" compute each mini-batch on arrival (prefill.compute_per_mini_batch=true), which is not
bit-identical to the reference; every other row is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import odmoe
from odmoe.model_factory import ensure_default_model

LENGTHS = [16, 128]
REPEATS = 5
RESULTS = Path(__file__).parent / "results"
CONFIGS = [
    ("0", "modulo", False),
    ("4", "modulo", False),
    ("16", "modulo", False),
    ("64", "modulo", False),
    ("0", "balanced", False),
    ("16", "balanced", False),
    ("4", "modulo", True),
    ("16", "modulo", True),
]


def prompt(n: int) -> list[int]:
    return [(7 * i + 11) % 1000 + 4 for i in range(n)]


def reference_ttft(path: str) -> dict[int, float]:
    torch.set_num_threads(1)  # as each cluster node runs
    model = AutoModelForCausalLM.from_pretrained(path)
    out = {}
    for n in LENGTHS:
        x = torch.tensor([prompt(n)])
        model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=1)
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=1)
            times.append(time.perf_counter() - start)
        out[n] = statistics.median(times)
    return out


def cluster_ttft(path: str, workers: int, mini_batch: str, placement: str, per_part: bool) -> dict:
    overrides = [
        f"prefill.mini_batch={mini_batch}",
        f"prefill.placement={placement}",
        f"prefill.compute_per_mini_batch={str(per_part).lower()}",
        "shadow.enabled=false",
    ]
    result = {}
    with odmoe.LocalCluster(path, workers=workers, group_size=2, overrides=overrides) as cluster:
        cluster.client.generate(prompt(16), max_new_tokens=1)
        for n in LENGTHS:
            runs = [cluster.client.generate(prompt(n), max_new_tokens=1).stats for _ in range(REPEATS)]
            mid = sorted(runs, key=lambda s: s["ttft_s"])[REPEATS // 2]
            result[n] = {
                "ttft_s": mid["ttft_s"],
                "split": {k: v for k, v in mid["prefill"].items() if k != "experts_per_layer"},
            }
    return result


def prompt_kv_effect(path: str, workers: int) -> dict:
    """Recall of the first decode iterations with and without handing the shadow main's prompt K/V
    (token alignment every iteration, no periodic KV alignment, a quantized shadow)."""
    out = {}
    for prefill_kv in (False, True):
        overrides = [
            "shadow.precision=int8_dynamic",
            "alignment.token_period=1",
            "alignment.kv_period=0",
            f"alignment.prefill_kv={str(prefill_kv).lower()}",
        ]
        with odmoe.LocalCluster(path, workers=workers, group_size=2, overrides=overrides) as cluster:
            runs = [
                cluster.client.generate(prompt(n), max_new_tokens=9).stats["recall"] for n in (16, 64, 128)
            ]
        out[str(prefill_kv)] = {
            t: statistics.mean(r["per_token"][t] for r in runs) for t in ("1", "2", "4", "8")
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--part", choices=["ttft", "prompt-kv", "all"], default="all")
    args = parser.parse_args()
    path = args.model or str(ensure_default_model())
    if args.part in ("prompt-kv", "all"):
        report_prompt_kv(path, args.workers)
    if args.part == "prompt-kv":
        return
    ref = reference_ttft(path)
    rows = []
    print(
        f"TTFT ms (median of {REPEATS}); reference single process: "
        + ", ".join(f"{n} tokens {ref[n] * 1e3:.1f}" for n in LENGTHS)
    )
    print(
        f"{'mini_batch':>10} {'placement':9} {'exact':6}"
        + "".join(f"{f'{n} tok':>9}" for n in LENGTHS)
        + f"{'experts/layer 16|128':>22}"
    )
    for mini_batch, placement, per_part in CONFIGS:
        res = cluster_ttft(path, args.workers, mini_batch, placement, per_part)
        rows.append({"mini_batch": int(mini_batch), "placement": placement, "bit_exact": not per_part, **res})
        experts = "|".join(f"{res[n]['split']['experts_per_layer_mean']:.2f}" for n in LENGTHS)
        print(
            f"{mini_batch:>10} {placement:9} {'yes' if not per_part else 'no':6}"
            + "".join(f"{res[n]['ttft_s'] * 1e3:9.1f}" for n in LENGTHS)
            + f"{experts:>22}",
            flush=True,
        )
    best = min(rows, key=lambda r: r[128]["ttft_s"])
    split = best[128]["split"]
    print(
        f"\nsplit of the fastest 128-token TTFT (mini_batch {best['mini_batch']}, {best['placement']}): "
        f"main {split['main_s'] * 1e3:.1f} ms, "
        f"critical load+compute {split['critical_load_compute_s'] * 1e3:.1f} ms"
        f" (load {split['load_s'] * 1e3:.1f}, compute {split['compute_s'] * 1e3:.1f} summed over workers), "
        f"transfer/queueing {split['transfer_s'] * 1e3:.1f} ms"
    )
    RESULTS.mkdir(exist_ok=True)
    report = {"model": path, "workers": args.workers, "reference_ttft_s": ref, "rows": rows}
    (RESULTS / "prefill.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {RESULTS / 'prefill.json'}")


def report_prompt_kv(path: str, workers: int) -> None:
    kv = prompt_kv_effect(path, workers)
    print(
        "shadow recall at decode tokens 1/2/4/8 (int8_dynamic shadow, token alignment only, no periodic KV):"
    )
    for key, label in (("False", "its own prompt K/V"), ("True", "main's prompt K/V")):
        print(f"  {label:18}: " + " ".join(f"{kv[key][t]:.4f}" for t in ("1", "2", "4", "8")))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefill-prompt-kv.json").write_text(
        json.dumps({"model": path, "recall_per_token": kv}, indent=2)
    )


if __name__ == "__main__":
    main()
