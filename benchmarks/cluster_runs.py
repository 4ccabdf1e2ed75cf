"""Requests through a real local cluster (main, shadow, workers as processes), summarised.

`run_cluster(model, words, prompts, new_tokens)` starts one `LocalCluster` with the suite's words,
sends one warm-up request and then one request per prompt, and returns every request's stats with
the nodes' peak memory and the CPU time each node spent on each request (`cpu_per_token`).
`summarise` pools them the way the paper reports: recall over all decode tokens (Eq. 3), tokens/s
as mean and spread over requests.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import odmoe
from odmoe_bench.config import BenchConfig


def cluster_words(cfg: BenchConfig, *extra: str) -> list[str]:
    """The odmoe-launch words every cluster of a suite shares, then the suite's own (after the
    preset, so they win over it). A suite's cluster is a lab one (`lab=on`: the emulated link, and
    what a suite adds: faults, wrong predictions, resident experts)."""
    return [
        "lab=on",
        *([f"preset={cfg.cluster.preset}"] if cfg.cluster.preset else []),
        f"cluster.workers={cfg.cluster.workers}",
        f"cluster.group_size={cfg.cluster.group_size}",
        f"shadow.precision={cfg.cluster.shadow_precision}",
        f"emulation.link.bandwidth_gbps={cfg.link.bandwidth_gbps}",
        f"emulation.link.latency_ms={cfg.link.latency_ms}",
        *cfg.cluster.overrides,
        *extra,
    ]


def link_words(bandwidth_gbps: float, latency_ms: float) -> list[str]:
    """The odmoe-launch words of an emulated load link (the lab overlay's)."""
    return [
        "lab=on",
        f"emulation.link.bandwidth_gbps={bandwidth_gbps:g}",
        f"emulation.link.latency_ms={latency_ms:g}",
    ]


@dataclass
class ClusterRun:
    words: list[str]
    stats: list[dict] = field(default_factory=list)  # one per measured request
    token_ids: list[list[int]] = field(default_factory=list)
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)  # node name -> bytes
    # per measured request: CPU seconds each node (and "client": this process) spent on it, and its wall
    cpu_s: list[dict[str, float]] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    shadow_weight_bytes: int | None = None


def run_cluster(
    model_path: str,
    words: list[str],
    prompts: list[list[int]],
    new_tokens: int,
    warmup: bool = True,
    warmup_tokens: int = 4,
    per_prompt_tokens: list[int] | None = None,
    place=None,
) -> ClusterRun:
    """`place`: where each node runs (odmoe.launch.local_cluster.NodePlacement by node name)."""
    run = ClusterRun(words)
    lengths = per_prompt_tokens or [new_tokens] * len(prompts)
    with odmoe.LocalCluster(model_path, overrides=words, place=place) as cluster:
        if warmup:  # first-request costs (allocations, lazy imports) are not what we measure
            cluster.client.generate(prompts[0], max_new_tokens=min(new_tokens, warmup_tokens))
        for ids, tokens in zip(prompts, lengths, strict=True):
            before, client, start = cluster.cpu_seconds(), time.process_time(), time.perf_counter()
            result = cluster.client.generate(ids, max_new_tokens=tokens)
            run.wall_s.append(time.perf_counter() - start)
            used = {n: s - before[n] for n, s in cluster.cpu_seconds().items() if n in before}
            run.cpu_s.append({**used, "client": time.process_time() - client})
            run.stats.append(result.stats)
            run.token_ids.append(result.token_ids)
        run.peak_rss_bytes = cluster.peak_rss_bytes()
        run.shadow_weight_bytes = cluster.shadow_info.get("weight_bytes")
    return run


def cpu_per_token(run: ClusterRun) -> dict | None:
    """Where a cluster's CPU went, pooled over its measured requests: ms per generated token by node
    (workers summed; prefill included), the cores it kept busy on average, and the most tokens/s
    this machine's cores could give that work if every node's share packed them perfectly (a bound
    set by CPU alone, whatever the schedule)."""
    if not run.cpu_s:
        return None
    tokens = sum(len(ids) for ids in run.token_ids)
    by_node: dict[str, float] = {}
    for used in run.cpu_s:
        for name, seconds in used.items():
            key = "workers" if name.startswith("worker") else name
            by_node[key] = by_node.get(key, 0.0) + seconds
    total = sum(by_node.values())
    cores = len(os.sched_getaffinity(0))
    return {
        "ms_per_token": {k: v / tokens * 1e3 for k, v in sorted(by_node.items())},
        "total_ms_per_token": total / tokens * 1e3,
        "cores_busy": total / sum(run.wall_s),
        "cores": cores,
        "bound_tokens_per_s": cores * tokens / total if total else None,
        "tokens_per_s": tokens / sum(run.wall_s),  # the same basis: whole requests, prefill included
    }


def pooled_recall(stats: list[dict], key: str = "recall") -> float | None:
    """Eq. 3 over every decode token of every request: hits / activated, pooled (not a mean of means)."""
    rows = [s[key] for s in stats if s.get(key) and s[key].get("activated")]
    total = sum(r["activated"] for r in rows)
    return sum(r["overall"] * r["activated"] for r in rows) / total if total else None


def recall_per_token(stats: list[dict]) -> dict[int, float]:
    """recall(n) of Eq. 2, averaged over requests for each output-token index n."""
    per: dict[int, list[float]] = {}
    for s in stats:
        for n, r in ((s.get("recall") or {}).get("per_token") or {}).items():
            per.setdefault(int(n), []).append(r)
    return {n: statistics.mean(v) for n, v in sorted(per.items())}


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), extremes and the values themselves."""
    return {
        "mean": statistics.mean(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def summarise(run: ClusterRun) -> dict:
    s = run.stats
    decode_tokens = [x["new_tokens"] - 1 for x in s]
    return {
        "words": run.words,
        "requests": len(s),
        "decode_tokens_per_s": spread([x["decode_tokens_per_s"] for x in s]),
        "ttft_s": spread([x["ttft_s"] for x in s]),
        "overall_tokens_per_s": spread([x["new_tokens"] / x["total_s"] for x in s]),
        "recall": pooled_recall(s),
        "timely_recall": pooled_recall(s, "timely_recall"),
        "stall_ms_per_token": statistics.mean(
            x["stall_s"] * 1e3 / max(d, 1) for x, d in zip(s, decode_tokens, strict=True)
        ),
        "reloads_per_token": statistics.mean(
            x["reloads"] / max(d, 1) for x, d in zip(s, decode_tokens, strict=True)
        ),
        "lookahead_layers_mean": mean_of(s, "lookahead_layers_mean"),
        "late_departure_ms_mean": _scaled(mean_of(s, "late_departure_s_mean"), 1e3),
        "peak_rss_bytes": run.peak_rss_bytes,
        "shadow_weight_bytes": run.shadow_weight_bytes,
    }


def mean_of(stats: list[dict], key: str) -> float | None:
    """The mean of `key` over the stats that have it (None where none has)."""
    values = [x[key] for x in stats if x.get(key) is not None]
    return statistics.mean(values) if values else None


def _scaled(x: float | None, factor: float) -> float | None:
    return None if x is None else x * factor
