"""Heatmaps of an alignment sweep (the paper's Fig. 9): decode tokens/s and recall over
token_period x kv_period, from the results.csv an `odmoe-launch -m` sweep leaves.

    odmoe-launch -m role=local alignment.token_period=1,2,4,8,16 alignment.kv_period=1,2,4,8,16 \\
        hydra.sweep.dir=multirun/alignment
    python benchmarks/plot_alignment.py multirun/alignment/results.csv [--out FILE.png]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def grid(rows: list[dict], key: str) -> tuple[list[int], list[int], list[list[float]]]:
    tokens = sorted({int(r["token_period"]) for r in rows})
    kvs = sorted({int(r["kv_period"]) for r in rows})
    cell = {
        (int(r["token_period"]), int(r["kv_period"])): float(r[key]) for r in rows if r[key] not in ("", None)
    }
    return tokens, kvs, [[cell.get((t, k), float("nan")) for k in kvs] for t in tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "alignment.png"))
    args = parser.parse_args()
    rows = list(csv.DictReader(open(args.csv)))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, (key, title, fmt) in zip(
        axes,
        [("decode_tokens_per_s", "decode tokens/s", "{:.1f}"), ("recall", "recall (Eq. 3)", "{:.3f}")],
        strict=True,
    ):
        tokens, kvs, values = grid(rows, key)
        image = ax.imshow(values, cmap="viridis", origin="lower")
        ax.set_xticks(range(len(kvs)), [str(k) for k in kvs])
        ax.set_yticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set_xlabel("KV alignment period")
        ax.set_ylabel("token alignment period")
        ax.set_title(title)
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                ax.text(j, i, fmt.format(v), ha="center", va="center", color="white", fontsize=8)
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f"alignment sweep: {Path(args.csv).stem}, {len(rows)} runs, one request each")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    for key in ("decode_tokens_per_s", "recall"):
        tokens, kvs, values = grid(rows, key)
        print(f"\n{key}: rows token_period {tokens}, columns kv_period {kvs}")
        for t, row in zip(tokens, values, strict=True):
            print(f"{t:>4} " + " ".join(f"{v:8.3f}" for v in row))


if __name__ == "__main__":
    main()
