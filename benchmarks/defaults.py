"""odmoe's defaults against the paper's configuration (`preset=paper`) on the demo model: the
README's first command, measured over more than one answer.

    python -m odmoe_bench.defaults            # 2 rounds, each: a cluster per configuration
    python -m odmoe_bench.defaults --rounds 3 --new-tokens 64

Each round starts one local cluster per configuration (2 workers, the demo model, no emulated
link, as `odmoe-launch role=local` runs), sends an 8-token warm-up request, then four prompts of
`--new-tokens` tokens, and prints the mean decode tokens/s and TTFT, the predictions that arrived
in time, experts loaded and served from a cache, and whether the shadow ran. Every answer is
checked against the first configuration's tokens (they must be identical).
"""

from __future__ import annotations

import argparse
import statistics

import odmoe
from odmoe.tools.training import ensure_demo_model

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n", "def parse(text):"]
CONFIGS = {"preset=paper": ["preset=paper"], "defaults": []}


def measure(path: str, words: list[str], new_tokens: int) -> tuple[dict, list[list[int]]]:
    with odmoe.LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        cluster.client.generate(PROMPTS[0], max_new_tokens=8)  # warm-up: first-request costs, caches
        results = [cluster.client.generate(p, max_new_tokens=new_tokens) for p in PROMPTS]
    stats = [r.stats for r in results]
    timely = [(s.get("timely_recall") or {}).get("overall") for s in stats]
    row = {
        "decode_tokens_per_s": statistics.mean(s["decode_tokens_per_s"] for s in stats),
        "ttft_ms": statistics.mean(s["ttft_s"] for s in stats) * 1e3,
        "timely_recall": statistics.mean(t for t in timely if t is not None) if any(timely) else None,
        "experts_computed": sum(s["experts_loaded"] for s in stats),
        "cache_hits": sum(s["cache"]["hits"] for s in stats),
        "shadow_ran": sum(bool(s["shadow"]) for s in stats),
    }
    return row, [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    path = str(ensure_demo_model())
    print(f"demo model {path}; {len(PROMPTS)} prompts x {args.new_tokens} tokens per cluster")
    print(f"{'round':>5} {'config':<14}{'decode tok/s':>13}{'TTFT ms':>9}{'in time':>9}"
          f"{'computed':>10}{'cached':>8}{'shadow':>8}  same tokens")  # fmt: skip
    wanted = None
    for round_ in range(1, args.rounds + 1):
        for name, words in CONFIGS.items():
            row, tokens = measure(path, words, args.new_tokens)
            wanted = wanted or tokens
            timely = f"{row['timely_recall']:.3f}" if row["timely_recall"] is not None else "-"
            print(
                f"{round_:>5} {name:<14}{row['decode_tokens_per_s']:>13.1f}{row['ttft_ms']:>9.1f}{timely:>9}"
                f"{row['experts_computed']:>10}{row['cache_hits']:>8.0f}"
                f"{row['shadow_ran']:>6}/{len(PROMPTS)}  {tokens == wanted}",
                flush=True,
            )


if __name__ == "__main__":
    main()
