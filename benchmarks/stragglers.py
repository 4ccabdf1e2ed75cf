"""One worker of four on a 10x slower link: decode tokens/s against the healthy cluster, steering off and on.

    python benchmarks/stragglers.py [--model DIR] [--bandwidth-gbps 25] [--latency-ms 0.2] [--slower 10]
        [--requests 3] [--new-tokens 64] [--cases healthy-off,slow-off,healthy-on,slow-on]
        [--rounds 2] [--cache 0] [--wire-ms 0] [--words WORD ...]

A cacheless cluster (the paper's: `worker.cache=0`), 4 workers in groups of 2, every worker's expert
loads over an emulated link (`emulation.link`: `--bandwidth-gbps`, `--latency-ms`); in the `slow`
cases worker3's link alone is `--slower` times slower in rate and latency (its own
`emulation.link` words, LocalCluster's `place`). `off`/`on`: `failover.steer_stragglers` (main
steers loads away from a worker consistently slower than its group's others: odmoe.main.stragglers).
`--cache SIZE` gives the workers caches instead (`worker.cache`, a size: 48MiB keeps 8 experts of the
default model; a bare number is bytes, so `--cache 8` keeps none but still gives every expert a home):
with steering on, a straggler's homes move to its peer when main finds that it pays (the stats'
`stragglers.home_moves`).
`--wire-ms MS`: worker3 is slow on its *network* link instead: its loads as fast as the others',
main reaches it through a link relay (odmoe/tools/link_relay.py) holding each chunk MS ms each way,
a Wi-Fi box (main judges it by its round trips less the worker's own time).
Each case is one cluster answering `--requests` prompts one at a time; decode tokens/s is the
requests' decode tokens over their decode seconds (the DoneEvent's), after one warm-up request.
The cases run `--rounds` times, interleaved (every other round in reverse order), and each case's
figure is the mean of its rounds: a shared machine's load drifts, and drifts for every case alike.
Every request's tokens are compared with transformers' greedy generate(). Without `--model`, a
Mixtral-shaped model of 8 MoE layers, 8 experts of 6 MiB (hidden 512, intermediate 1024, fp32) is
made with odmoe-make-model --fast-fill under /tmp. Prints the figures and writes JSON
(benchmarks/results/stragglers.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import odmoe
from odmoe.launch.local_cluster import NodePlacement
from odmoe.models.open_model import load_tokenizer
from odmoe.tools.link_relay import Relay
from odmoe_bench.cluster_runs import link_words
from odmoe_bench.results import RESULTS, write_report
from odmoe_bench.workload import prompt_ids, reference_tokens

SLOW = "worker3"
SHAPE = ["--layers", "8", "--hidden", "512", "--intermediate", "1024", "--experts", "8", "--top-k", "2"]


def make_model(out: Path) -> str:
    if not (out / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "odmoe.launch.make_model", "--family", "mixtral", "--out", str(out),
             *SHAPE, "--heads", "8", "--kv-heads", "4", "--vocab", "2048", "--fast-fill"],
            check=True,
        )  # fmt: skip
    return str(out)


def run_case(
    path: str, words: list[str], slow: list[str], prompts, wants, new_tokens: int, wire_s: float = 0.0
) -> dict:
    """One cluster, `prompts` one at a time: decode tokens/s, tokens checked, where the loads went.
    `slow`: the slow worker's own words; `wire_s`: main reaches it through a relay holding each chunk
    that long each way."""
    relays: list[Relay] = []

    def place(name: str) -> NodePlacement:
        return NodePlacement(words=slow if name == SLOW else [])

    def through(name: str, address: str) -> str:
        if name != SLOW or wire_s <= 0:
            return address
        relays.append(Relay(address))
        relays[-1].set(delay_s=wire_s)
        return relays[-1].address

    try:
        return _measure(path, words, place, through, prompts, wants, new_tokens)
    finally:
        for relay in relays:
            relay.close()


def _measure(path: str, words: list[str], place, through, prompts, wants, new_tokens: int) -> dict:
    with odmoe.LocalCluster(
        path, workers=4, group_size=2, overrides=words, place=place, through=through
    ) as cluster:
        cluster.client.generate(prompts[0], max_new_tokens=8)  # warm
        tokens = seconds = different = 0.0
        experts: dict[str, float] = {}
        load_s: dict[str, float] = {}
        rates, steered, recall = [], [], []
        reloads = stall_s = 0.0
        for p, want in zip(prompts, wants, strict=True):
            got = cluster.client.generate(p, max_new_tokens=new_tokens)
            stats = got.stats
            different += got.token_ids != want
            tokens += stats["decode"]["tokens"]
            seconds += stats["decode"]["seconds"]
            rates.append(round(stats["decode_tokens_per_s"], 2))
            steered.append(stats.get("stragglers", {}))
            reloads += stats["reloads"]  # decode experts loaded only after main asked (misses)
            stall_s += stats["stall_s"]  # decode: per layer, the longest main waited for a load
            recall.append(stats["timely_recall"]["overall"])
            for name, row in stats["per_worker"].items():
                experts[name] = experts.get(name, 0) + row["experts"]
                load_s[name] = load_s.get(name, 0) + row["load_s"]
    return {
        "decode_tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
        "per_request_tokens_per_s": rates,
        "different": int(different),
        "reloads": int(reloads),
        "stall_ms_per_token": round(1e3 * stall_s / tokens, 2) if tokens else 0.0,
        "timely_recall": recall,
        "experts_per_worker": {k: round(v, 1) for k, v in sorted(experts.items())},
        "load_s_per_expert": {k: round(load_s[k] / experts[k], 4) for k in sorted(experts) if experts[k]},
        "stragglers": steered[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--bandwidth-gbps", type=float, default=25.0)
    parser.add_argument("--latency-ms", type=float, default=0.2)
    parser.add_argument("--slower", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cases", default="healthy-off,slow-off,healthy-on,slow-on")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache", default="0", help="worker.cache (0: the paper's cacheless workers)")
    parser.add_argument("--wire-ms", type=float, default=0.0, help="slow on its network link instead")
    parser.add_argument("--words", nargs="*", default=[])
    parser.add_argument("--out", default=str(RESULTS / "stragglers.json"))
    args = parser.parse_args()
    path = args.model or make_model(Path("/tmp/odmoe-stragglers-model"))
    tok = load_tokenizer(path)
    prompts = [prompt_ids(tok, i, 16) for i in range(args.requests)]
    wants = [reference_tokens(path, p, args.new_tokens) for p in prompts]
    base = link_words(args.bandwidth_gbps, args.latency_ms)
    slow = link_words(args.bandwidth_gbps / args.slower, args.latency_ms * args.slower)
    if args.wire_ms > 0:
        slow = []  # its loads as the others'; its network link slow
    report: dict = {
        "model": path,
        "link": {"bandwidth_gbps": args.bandwidth_gbps, "latency_ms": args.latency_ms},
        "slow_worker": SLOW,
        "slower": args.slower if args.wire_ms <= 0 else None,
        "slow_wire_ms_each_way": args.wire_ms,
        "words": args.words,
        "worker_cache": args.cache,
        "cases": {},
    }
    cases = args.cases.split(",")
    runs: dict[str, list[dict]] = {case: [] for case in cases}
    for r in range(args.rounds):  # the cases interleaved, every other round reversed: a machine
        for case in cases if r % 2 == 0 else cases[::-1]:  # whose load drifts drifts for them all
            health, steer = case.split("-")
            steering = f"failover.steer_stragglers={steer == 'on'}"
            words = [f"worker.cache={args.cache}", *base, steering, *args.words]
            start, load = time.monotonic(), os.getloadavg()[0]
            slowed = health == "slow"
            result = run_case(
                path, words, slow if slowed else [], prompts, wants, args.new_tokens,
                args.wire_ms / 1e3 if slowed else 0.0,
            )  # fmt: skip
            result["wall_s"] = round(time.monotonic() - start, 1)
            result["load_average"] = [round(load, 2), round(os.getloadavg()[0], 2)]  # 1-min, before/after
            runs[case].append(result)
            print(f"round {r} {case}", result, flush=True)
    for case, results in runs.items():
        rates = [x["decode_tokens_per_s"] for x in results]
        report["cases"][case] = {
            "decode_tokens_per_s": round(statistics.mean(rates), 2),
            "decode_tokens_per_s_per_round": rates,
            "different": sum(x["different"] for x in results),
            "runs": results,
        }
    for steer in ("off", "on"):
        healthy, slowed = report["cases"].get(f"healthy-{steer}"), report["cases"].get(f"slow-{steer}")
        if healthy and slowed:
            ratio = slowed["decode_tokens_per_s"] / max(healthy["decode_tokens_per_s"], 1e-9)
            report[f"slow_vs_healthy_{steer}"] = round(ratio, 3)
            print(f"steering {steer}: slow/healthy decode tokens/s = {ratio:.3f}", flush=True)
    on, off = report["cases"].get("healthy-on"), report["cases"].get("healthy-off")
    if on and off:
        report["healthy_on_vs_off"] = round(
            on["decode_tokens_per_s"] / max(off["decode_tokens_per_s"], 1e-9), 3
        )
        print(f"healthy cluster, steering on/off: {report['healthy_on_vs_off']:.3f}", flush=True)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
