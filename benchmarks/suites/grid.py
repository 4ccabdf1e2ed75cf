"""Suite `grid` (the paper's Table 2): (input, output) tokens x systems on one model and one link.

Systems: `odmoe` (main + shadow + workers, token + KV alignment every iteration); `resident_workers`
(the same cluster, every expert kept on the workers' devices, no shadow: the cost of being cacheless,
isolated); `single_process` (transformers with every expert resident: the upper bound);
`lru_offloader` (one process, an LRU cache of `grid.lru_experts` experts, misses loaded over the same
emulated link). Per cell: TTFT, decode tokens/s, overall tokens/s; per system: every node's peak RSS
and the device bytes each holds (the paper's GPU memory). Every system must produce the same tokens.

Then the pipeline simulator (odmoe.tools.pipeline_sim) is fed the timings each cluster measured (main's
per-layer time, expert compute, load, network, shadow speed and late departure, share of preloaded
experts) and its predicted decode tokens/s is set against the measured one: the simulator's error.
"""

from __future__ import annotations

import statistics

from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.tools.pipeline_sim import PipelineParams, simulate
from odmoe_bench import plots
from odmoe_bench.baselines import run_in_child
from odmoe_bench.cluster_runs import cluster_words, run_cluster
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, prompts

CLUSTER_SYSTEMS = {
    "odmoe": ["alignment.token_period=1", "alignment.kv_period=1"],
    "resident_workers": ["emulation.resident=true", "shadow.enabled=false"],
}


def cells(cfg: BenchConfig, tokenizer) -> list[dict]:
    g = cfg.grid
    return [
        {
            "name": f"{n_in}/{n_out}",
            "input": n_in,
            "output": n_out,
            "prompts": prompts(tokenizer, g.repeats, n_in, first=100),
            "new_tokens": n_out,
        }
        for n_in in g.inputs
        for n_out in g.outputs
    ]


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    tokenizer = load_tokenizer(model_path)
    grid = cells(cfg, tokenizer)
    moe_layers = len(open_checkpoint(model_path).moe_layers)
    systems = {}
    for system in cfg.grid.systems:
        print(f"-- {system}", flush=True)
        if system in CLUSTER_SYSTEMS:
            systems[system] = _cluster_system(cfg, model_path, system, grid, moe_layers)
        else:
            systems[system] = _process_system(cfg, model_path, system, grid)
    identical = _tokens_identical(systems)
    _print_table(grid, systems)
    print(f"tokens identical across systems: {identical}")
    validation = [
        {"system": name, "cell": c["name"], **c["simulated"]}
        for name, s in systems.items()
        for c in s["cells"]
        if c.get("simulated")
    ]
    if validation:
        errors = [abs(v["error"]) for v in validation]
        print(
            f"simulator vs measured decode tokens/s: mean |error| {statistics.mean(errors) * 100:.1f} %, "
            f"max {max(errors) * 100:.1f} %"
        )
    report = {
        "cells": [{k: v for k, v in c.items() if k != "prompts"} for c in grid],
        "systems": systems,
        "tokens_identical": identical,
        "simulator_validation": validation,
    }
    out.write("grid", "grid", report)
    plots.grid(grid, systems, out.path("grid", "png"), out.describe(max(cfg.grid.outputs)))
    return report


def _cluster_system(cfg: BenchConfig, model_path: str, system: str, grid: list[dict], layers: int) -> dict:
    result: dict = {"cells": [], "peak_rss_bytes": {}, "device_bytes": {}}
    words = cluster_words(cfg, *CLUSTER_SYSTEMS[system])
    # One cluster serves every cell (nodes start once); its peak memory is the largest cell's.
    prompts = [ids for cell in grid for ids in cell["prompts"]]
    lengths = [cell["new_tokens"] for cell in grid for _ in cell["prompts"]]
    run = run_cluster(model_path, words, prompts, max(lengths), per_prompt_tokens=lengths)
    i = 0
    for cell in grid:
        stats = run.stats[i : i + len(cell["prompts"])]
        tokens = run.token_ids[i : i + len(cell["prompts"])]
        i += len(cell["prompts"])
        entry = {
            "name": cell["name"],
            "runs": [
                {
                    "ttft_s": s["ttft_s"],
                    "decode_tokens_per_s": s["decode_tokens_per_s"],
                    "overall_tokens_per_s": s["new_tokens"] / s["total_s"],
                    "new_tokens": s["new_tokens"],
                    "token_ids": ids,
                    "recall": (s.get("recall") or {}).get("overall"),
                    "stall_s": s["stall_s"],
                }
                for s, ids in zip(stats, tokens, strict=True)
            ],
            "simulated": simulator_check(stats, cfg, layers),
        }
        result["cells"].append(entry)
    result["peak_rss_bytes"] = run.peak_rss_bytes
    device = dict(run.stats[-1]["device_bytes"])
    if run.shadow_weight_bytes:
        device["shadow"] = run.shadow_weight_bytes
    result["device_bytes"] = device
    return result


def simulator_check(stats: list[dict], cfg: BenchConfig, layers: int) -> dict | None:
    """The pipeline simulator fed this cell's measured timings, against its measured decode speed."""
    predicted, measured = [], []
    params = None
    for s in stats:
        d = s["decode"]
        if not d["tokens"] or not d["layers"] or not d["experts"]:
            continue
        used = s["preloaded"] + s["reloads"]
        t_compute = d["compute_s"] / d["experts"]
        per_layer_wait = d["wait_s"] / d["layers"]
        per_layer_stall = s["stall_s"] / d["layers"]
        forward = s.get("shadow_forward_s_mean")
        params = PipelineParams(
            layers=layers,
            groups=cfg.cluster.workers // cfg.cluster.group_size,
            t_main_s=(d["seconds"] - d["wait_s"]) / (d["tokens"] * layers),
            t_compute_s=t_compute,
            t_load_s=d["load_s"] / d["loads"] if d["loads"] else 0.0,
            t_net_s=max((per_layer_wait - per_layer_stall - t_compute) / 2, 0.0),
            recall=s["preloaded"] / used if used and s.get("shadow") else (1.0 if not d["loads"] else 0.0),
            shadow_offset_s=s.get("late_departure_s_mean") or 0.0,
            t_shadow_layer_s=forward / layers if forward else 0.0,
        )
        predicted.append(simulate(params).tokens_per_s)
        measured.append(s["decode_tokens_per_s"])
    if not predicted:
        return None
    p, m = statistics.mean(predicted), statistics.mean(measured)
    return {
        "predicted_tokens_per_s": p,
        "measured_tokens_per_s": m,
        "error": (p - m) / m,
        "params": vars(params),
    }


def _process_system(cfg: BenchConfig, model_path: str, system: str, grid: list[dict]) -> dict:
    report = run_in_child(
        system, model_path, grid, threads=cfg.grid.threads, lru_experts=cfg.grid.lru_experts,
        bandwidth_gbps=cfg.link.bandwidth_gbps, latency_ms=cfg.link.latency_ms,
    )  # fmt: skip
    return {
        "cells": report["cells"],
        "peak_rss_bytes": {system: report["peak_rss_bytes"]},
        "device_bytes": {system: report["device_bytes"]},
        "threads": report["threads"],
        "lru_experts": report["lru_experts"],
    }


def _tokens_identical(systems: dict) -> bool:
    seen = [[r["token_ids"] for c in s["cells"] for r in c["runs"]] for s in systems.values()]
    return all(other == seen[0] for other in seen[1:])


def cell_mean(cell: dict, key: str) -> float:
    return statistics.mean(r[key] for r in cell["runs"])


def _print_table(grid: list[dict], systems: dict) -> None:
    mib = 2**20
    speeds = Table(
        "system:<18",
        "in/out:>8",
        "TTFT ms:9.1f",
        "decode tok/s:14.1f",
        "overall tok/s:15.1f",
        "sim tok/s:11.1f",
    )
    speeds.header("\n")
    for name, s in systems.items():
        for cell in s["cells"]:
            sim = cell.get("simulated")
            speeds.row(
                name,
                cell["name"],
                cell_mean(cell, "ttft_s") * 1e3,
                cell_mean(cell, "decode_tokens_per_s"),
                cell_mean(cell, "overall_tokens_per_s"),
                sim["predicted_tokens_per_s"] if sim else None,
            )
    memory = Table("system:<18", "peak RSS MiB (per node):<50", "device MiB (per node):<0")
    memory.header("\n")
    for name, s in systems.items():
        rss = ", ".join(f"{k} {v / mib:.0f}" for k, v in s["peak_rss_bytes"].items())
        memory.row(name, rss, ", ".join(f"{k} {v / mib:.1f}" for k, v in s["device_bytes"].items()))
