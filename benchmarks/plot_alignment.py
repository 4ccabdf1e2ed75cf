"""Heatmaps of an `odmoe-launch -m` alignment sweep (the paper's Fig. 9): decode tokens/s and recall
over token_period x kv_period, from the results.csv the sweep leaves. (`odmoe-bench suite=alignment`
runs such a sweep with repeats and draws the same picture.)

    odmoe-launch -m role=local alignment.token_period=1,2,4,8,16 alignment.kv_period=1,2,4,8,16 \\
        hydra.sweep.dir=multirun/alignment
    python benchmarks/plot_alignment.py multirun/alignment/results.csv [--out FILE.png]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from odmoe.benchmarks.plots import heatmaps

KEYS = [("decode_tokens_per_s", "decode tokens/s", "{:.1f}"), ("recall", "recall (Eq. 3)", "{:.3f}")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "alignment.png"))
    args = parser.parse_args()
    rows = list(csv.DictReader(open(args.csv)))
    title = f"alignment sweep: {Path(args.csv).stem}, {len(rows)} runs, one request each"
    for (key, _, _), (tokens, kvs, values) in zip(
        KEYS, heatmaps(rows, KEYS, Path(args.out), title), strict=True
    ):
        print(f"\n{key}: rows token_period {tokens}, columns kv_period {kvs}")
        for t, row in zip(tokens, values, strict=True):
            print(f"{t:>4} " + " ".join(f"{v:8.3f}" for v in row))


if __name__ == "__main__":
    main()
