"""Tokens/s of one code version against another, on the same box: an A/B for a refactor of the data
path (the tokens must be the same, the speed within noise).

    git worktree add /tmp/ab_old <commit>                      # the old code beside this checkout
    (cd /tmp/ab_old/odmoe && ln -s ../nodes nodes && ln -s ../launch launch && ln -s ../conf conf)
    cd /tmp   # not the checkout: `python -m` puts the working directory first on sys.path
    for i in 1 2 3; do
        PYTHONPATH=/tmp/ab_old python -m odmoe_bench.code_ab MODEL   # A: the old code
        python -m odmoe_bench.code_ab MODEL                          # B: this checkout
    done

Each run starts a LocalCluster (2 workers, the defaults) on MODEL (a checkpoint directory: the
demo model `~/.cache/odmoe/models/demo-mixtral-...`), warms it with one short request, then
generates 64 tokens for each of three prompts, one after another (a request alone) or with
`--together` all at once (continuous batching: the batched decode pass), and prints one JSON line:
which code ran (check it: the `code` path), the tokens, wall and decode tokens/s and each prompt's
first 8 token ids (A and B must print the same ids). `--in-process`: main's engine over in-process
workers instead (one process, no sockets, one torch thread: the engine's and the executor's own
cost), one request, `--tokens` tokens five times after a warm-up, the best and median rate.
The symlinks make `odmoe.nodes` / `odmoe.launch` / `odmoe.conf` resolve inside the old tree too
(the installed package maps them from the checkout's top-level folders); node processes inherit
PYTHONPATH, so every node runs the version under test. Alternate A and B: the box's load drifts.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import odmoe
from odmoe.launch.local_cluster import LocalCluster

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint directory")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--together", action="store_true", help="the three prompts at once")
    parser.add_argument("--in-process", action="store_true", help="the engine over in-process workers")
    args = parser.parse_args(argv)
    if args.in_process:
        return in_process(args.model, args.tokens)
    with LocalCluster(args.model, workers=2) as cluster:
        cluster.client.generate(PROMPTS[0], max_new_tokens=4)  # warm: loads, first shapes

        def timed(prompt: str):
            start = time.perf_counter()
            return cluster.client.generate(prompt, max_new_tokens=args.tokens), time.perf_counter() - start

        start = time.perf_counter()
        with ThreadPoolExecutor(len(PROMPTS) if args.together else 1) as pool:
            runs = list(pool.map(timed, PROMPTS))
        wall = time.perf_counter() - start
    tokens = sum(len(got.token_ids) for got, _ in runs)
    # together, the requests' decode seconds overlap: the wall clock is the measure
    decode_s = 0.0 if args.together else sum(got.stats["decode"]["seconds"] for got, _ in runs)
    print(
        json.dumps(
            {
                "code": odmoe.__file__,
                "tokens": tokens,
                "together": args.together,
                "wall_tokens_per_s": round(tokens / wall, 1),
                "decode_tokens_per_s": round(tokens / decode_s, 1) if decode_s else None,
                "first_ids": [got.token_ids[:8] for got, _ in runs],
            }
        )
    )


def in_process(model: str, tokens: int) -> None:
    import torch  # noqa: PLC0415 (the cluster mode's processes import their own)

    from odmoe.main.engine import GenerateRequest, TokenEvent  # noqa: PLC0415
    from odmoe.main.inprocess import engine_in_process  # noqa: PLC0415

    torch.set_num_threads(1)
    engine, _ = engine_in_process(model)

    def run(prompt: str, n: int) -> tuple[list[int], float]:
        start = time.perf_counter()
        events = engine.generate(GenerateRequest(prompt=prompt, max_new_tokens=n))
        ids = [e.token_id for e in events if isinstance(e, TokenEvent)]
        return ids, time.perf_counter() - start

    run("warm", 8)
    rates, ids = [], []
    for _ in range(5):
        ids, seconds = run(PROMPTS[0], tokens)
        rates.append(len(ids) / seconds)
    rates.sort()
    print(
        json.dumps(
            {
                "code": odmoe.__file__,
                "in_process": True,
                "best_tokens_per_s": round(rates[-1], 1),
                "median_tokens_per_s": round(rates[2], 1),
                "first_ids": [ids[:8]],
            }
        )
    )


if __name__ == "__main__":
    main()
