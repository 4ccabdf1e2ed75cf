"""Suite `cache`: the workers' spare memory as one expert cache (worker.cache), by budget.

Budgets are fractions of every expert's bytes, cluster-wide (`cache.budgets`: 0 = cacheless, the
paper's; 1 = room for every expert once): each worker gets budget x all experts' bytes / workers.
Per budget:
- `odmoe`: the cluster, its caches steered by the shadow's predictions (worker.cache_policy=prediction);
- `odmoe_lru`: the same cluster and budget, least-recently-used eviction (what prediction adds);
- `lru_offloader`: one process whose LRU cache holds as many experts as the cluster's caches and
  just-in-time slots together (the same total device memory), misses over the same emulated link;
and once, `resident_workers` (every expert kept on the workers, nothing loaded: the ceiling).
With `cache.skew` s > 0 the workers' rooms differ (even-numbered workers (1 + s) x the per-worker
budget, odd ones (1 - s) x: boxes of unequal memory in one group), and `odmoe_even_homes` is odmoe
with the same rooms but homes dealt evenly (`cluster.homes=even`): what homes by room add.
Each system serves the same prompts after a warm-up request (caches start cold and warm over the
requests, as a server's do). Reported: decode tokens/s, the share of experts computed from a cache
(hit rate), bytes loaded per generated token, and whether every system's tokens equal transformers'.
"""

from __future__ import annotations

import statistics

from odmoe.models.load_dtypes import expert_dtype
from odmoe.models.main_model import resolve_dtype
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe_bench import plots
from odmoe_bench.baselines import run_in_child
from odmoe_bench.cluster_runs import cluster_words, pooled_recall, run_cluster
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, prompts
from odmoe_bench.workload import reference_tokens

TABLE = Table(
    "budget:>7g:budget",
    "system:<16:system",
    "experts:>8:capacity_experts",
    "decode tok/s:>13.1f:decode_tokens_per_s",
    "vs resident:>12.3f:vs_resident",
    "hit rate:>9.3f:hit_rate",
    "MiB/token:>10.3f:mib_per_token",
    "vs cacheless:>13.3f:bytes_vs_cacheless",
    "differ:>7:differ",
    sep=" ",
)


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.cache
    tok = load_tokenizer(model_path)
    requests = prompts(tok, suite.prompts, suite.prompt_tokens, first=200)
    wanted = [reference_tokens(model_path, ids, suite.new_tokens) for ids in requests]
    expert_bytes, experts = _expert_size(model_path)
    workers = cfg.cluster.workers
    rows = []
    for budget in suite.budgets:
        per_worker = int(budget * experts * expert_bytes / workers)
        for system in suite.systems:
            if system == "resident_workers" and budget != max(suite.budgets):
                continue  # the ceiling: measured once
            print(f"-- budget {budget:g}: {system}", flush=True)
            row = _measure(cfg, model_path, system, per_worker, expert_bytes, requests, suite.new_tokens)
            row.update(budget=budget, system=system)
            row["differ"] = sum(a != b for a, b in zip(row.pop("token_ids"), wanted, strict=True))
            rows.append(row)
    resident = next((r["decode_tokens_per_s"] for r in rows if r["system"] == "resident_workers"), None)
    cacheless = next(
        (r["bytes_per_token"] for r in rows if r["system"] == "odmoe" and r["budget"] == 0), None
    )
    for r in rows:
        r["vs_resident"] = r["decode_tokens_per_s"] / resident if resident else None
        r["bytes_vs_cacheless"] = r["bytes_per_token"] / cacheless if cacheless else None
    report = {
        "experts": experts,
        "expert_bytes": expert_bytes,
        "workers": workers,
        "prompts": suite.prompts,
        "new_tokens": suite.new_tokens,
        "rows": rows,
        "identical": all(r["differ"] == 0 for r in rows),
    }
    _print(report)
    out.write("cache", "cache", report)
    plots.cache(report, out.path("cache", "png"), out.describe(suite.new_tokens))
    return report


def _expert_size(model_path: str) -> tuple[int, int]:
    """Bytes of one expert as the workers hold it, and how many routed experts the model has."""
    ckpt = open_checkpoint(model_path)
    dtype = expert_dtype(ckpt.config, resolve_dtype("auto", ckpt))
    one = ckpt.expert(ckpt.moe_layers[0], 0)
    return (one.gate_up.numel() + one.down.numel()) * dtype.itemsize, len(ckpt.moe_layers) * ckpt.num_experts


def _rooms(cfg, per_worker: int) -> list[int]:
    """Each worker's cache bytes: the per-worker budget, skewed by `cache.skew` (even / odd workers)."""
    s = cfg.cache.skew
    return [int(per_worker * (1 + s if w % 2 == 0 else 1 - s)) for w in range(cfg.cluster.workers)]


def _measure(cfg, model_path, system, per_worker, expert_bytes, prompts, new_tokens) -> dict:
    rooms = _rooms(cfg, per_worker)
    if system == "lru_offloader":
        # the cluster's device memory for experts: its caches and its just-in-time slots
        slots = cfg.cluster.workers * 2
        lru_experts = slots + sum(r // expert_bytes for r in rooms)
        return _offloader(cfg, model_path, prompts, new_tokens, lru_experts)
    extra = {
        "odmoe": [f"worker.cache={per_worker}", "worker.cache_policy=prediction"],
        "odmoe_even_homes": [
            f"worker.cache={per_worker}",
            "worker.cache_policy=prediction",
            "cluster.homes=even",
        ],
        "odmoe_lru": [f"worker.cache={per_worker}", "worker.cache_policy=lru"],
        "resident_workers": ["emulation.resident=true", "shadow.enabled=false"],
    }[system]
    place = None
    if cfg.cache.skew and system != "resident_workers":
        from odmoe.launch.local_cluster import NodePlacement

        def place(name: str) -> NodePlacement:  # the worker's own room, after the cluster's words
            w = int(name[len("worker") :]) if name.startswith("worker") else None
            return NodePlacement(words=[] if w is None else [f"worker.cache={rooms[w]}"])

    words = cluster_words(cfg, *extra, *cfg.cache.overrides)
    run = run_cluster(model_path, words, prompts, new_tokens, place=place)
    s = run.stats
    new = sum(x["new_tokens"] for x in s)
    decode_experts = sum(x["decode"]["experts"] for x in s)
    hits = sum(x["cache"]["hits"] for x in s)
    computed = sum(x["experts_loaded"] for x in s)
    return {
        "decode_tokens_per_s": statistics.mean(x["decode_tokens_per_s"] for x in s),
        "hit_rate": hits / computed if computed and system != "resident_workers" else None,
        "bytes_per_token": sum(x["bytes_loaded"] for x in s) / new,
        "decode_experts": decode_experts,
        "stall_ms_per_token": statistics.mean(x["stall_s"] * 1e3 / max(x["new_tokens"] - 1, 1) for x in s),
        "timely_recall": pooled_recall(s, "timely_recall"),
        "capacity_experts": sum(r // expert_bytes for r in rooms) // len(rooms),
        "token_ids": run.token_ids,
    }


def _offloader(cfg, model_path, prompts, new_tokens, lru_experts) -> dict:
    cells = [{"name": "cache", "prompts": prompts, "new_tokens": new_tokens}]
    link = cfg.link
    report = run_in_child(
        "lru_offloader", model_path, cells, threads=1, lru_experts=lru_experts,
        bandwidth_gbps=link.bandwidth_gbps, latency_ms=link.latency_ms,
    )  # fmt: skip
    cell = report["cells"][0]
    new = sum(r["new_tokens"] for r in cell["runs"])
    return {
        "decode_tokens_per_s": statistics.mean(r["decode_tokens_per_s"] for r in cell["runs"]),
        "hit_rate": cell["lru_hit_rate"],
        "bytes_per_token": cell["bytes_loaded"] / new,
        "capacity_experts": lru_experts,
        "token_ids": [r["token_ids"] for r in cell["runs"]],
    }


def _print(report: dict) -> None:
    print(
        f"\nexpert cache: {report['experts']} experts of {report['expert_bytes'] / 2**20:.2f} MiB, "
        f"{report['workers']} workers; budget = share of every expert's bytes, cluster-wide"
    )
    TABLE.header()
    for r in report["rows"]:
        TABLE.record(r, mib_per_token=r["bytes_per_token"] / 2**20)
    print(f"tokens identical to transformers everywhere: {report['identical']}")
