"""The shadow, measured: recall per precision x alignment, lookahead, and decode speed of the
paper's ablation cases 1-6, on one model, on this machine.

    python benchmarks/shadow.py [--model DIR] [--tokens 48] [--part recall|ablation|all]

Prints two tables and writes benchmarks/results/shadow.json. Each row is its own local cluster
(main + shadow + 2 workers as processes); recall is the paper's Eq. 3 over the decode tokens of
three prompts; decode tokens/s is the mean of those prompts after one warm-up request.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import odmoe
from odmoe.model_factory import ensure_default_model

PROMPTS = ["def fibonacci(n):", "import os\n\nclass Config:\n    ", "    return sorted(items, key="]
PRECISIONS = ["fp32", "bf16", "fp16", "int8_dynamic", "int8", "nf4"]
ALIGNMENTS = {"token+KV": (1, 1), "token": (1, 0), "KV": (0, 1), "none": (0, 0)}
RESULTS = Path(__file__).parent / "results"


def measure(path: str, tokens: int, overrides: list[str]) -> dict:
    with odmoe.LocalCluster(path, workers=2, group_size=2, overrides=overrides) as cluster:
        cluster.client.generate(PROMPTS[0], max_new_tokens=4)  # warm-up
        runs = [cluster.client.generate(p, max_new_tokens=tokens).stats for p in PROMPTS]
        weight_bytes = cluster.shadow_info.get("weight_bytes")

    def pooled(key: str) -> float | None:
        rows = [r[key] for r in runs if r.get(key) and r[key]["activated"]]
        total = sum(r["activated"] for r in rows)
        return sum(r["overall"] * r["activated"] for r in rows) / total if total else None

    lookahead = [r["lookahead_layers_mean"] for r in runs if r.get("lookahead_layers_mean") is not None]
    late = [r["late_departure_s_mean"] for r in runs if r.get("late_departure_s_mean") is not None]
    return {
        "overrides": overrides,
        "recall": pooled("recall"),
        "timely_recall": pooled("timely_recall"),
        "decode_tokens_per_s": statistics.mean(r["decode_tokens_per_s"] for r in runs),
        "decode_tokens_per_s_stdev": statistics.stdev(r["decode_tokens_per_s"] for r in runs),
        "stall_ms_per_token": statistics.mean(r["stall_s"] * 1e3 / r["new_tokens"] for r in runs),
        "reloads_per_token": statistics.mean(r["reloads"] / r["new_tokens"] for r in runs),
        "lookahead_layers_mean": statistics.mean(lookahead) if lookahead else None,
        "late_departure_ms_mean": statistics.mean(late) * 1e3 if late else None,
        "shadow_weight_bytes": weight_bytes,
    }


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="checkpoint dir; 'trained' = the trained benchmark model"
    )
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--part", choices=["recall", "ablation", "all"], default="all")
    parser.add_argument(
        "--overrides",
        nargs="*",
        default=[],
        help="added to every cluster, e.g. worker.link.bandwidth_gbps=0.5 (an emulated load link)",
    )
    parser.add_argument("--name", default="", help="suffix of the results file")
    args = parser.parse_args()
    if args.model == "trained":
        from odmoe.training import ensure_trained_model

        path = str(ensure_trained_model())
    else:
        path = args.model or str(ensure_default_model())
    report: dict = {
        "model": path,
        "new_tokens": args.tokens,
        "overrides": args.overrides,
        "recall": [],
        "ablation": [],
    }
    if args.part in ("recall", "all"):
        print(
            f"{'precision':14}{'alignment':10}{'recall':>9}{'in time':>9}{'ahead':>7}{'late ms':>9}"
            f"{'tok/s':>8}{'MiB':>8}",
            flush=True,
        )
        for precision in PRECISIONS:
            for name, (p, q) in ALIGNMENTS.items():
                row = measure(
                    path,
                    args.tokens,
                    [
                        *args.overrides,
                        f"shadow.precision={precision}",
                        f"alignment.token_period={p}",
                        f"alignment.kv_period={q}",
                    ],
                )
                row.update(precision=precision, alignment=name)
                report["recall"].append(row)
                mib = row["shadow_weight_bytes"] / 2**20 if row["shadow_weight_bytes"] else None
                print(
                    f"{precision:14}{name:10}{fmt(row['recall'], '9.4f')}{fmt(row['timely_recall'], '9.4f')}"
                    f"{fmt(row['lookahead_layers_mean'], '7.2f')}{fmt(row['late_departure_ms_mean'], '9.2f')}"
                    f"{row['decode_tokens_per_s']:8.1f}{fmt(mib, '8.2f')}",
                    flush=True,
                )
    if args.part in ("ablation", "all"):
        print(
            f"\n{'case':6}{'decode tok/s':>14}{'± stdev':>9}{'recall':>9}"
            f"{'stall ms/tok':>14}{'reloads/tok':>13}"
        )
        for case in range(1, 7):
            row = measure(path, args.tokens, [*args.overrides, f"ablation=case{case}"])
            row["case"] = case
            report["ablation"].append(row)
            print(
                f"{case:<6}{row['decode_tokens_per_s']:14.1f}{row['decode_tokens_per_s_stdev']:9.1f}"
                f"{fmt(row['recall'], '9.4f')}{row['stall_ms_per_token']:14.3f}"
                f"{row['reloads_per_token']:13.2f}",
                flush=True,
            )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"shadow-{args.part}{'-' + args.name if args.name else ''}.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
