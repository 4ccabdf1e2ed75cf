"""Suite `timeline` (the paper's Fig. 2 and 5, measured): what every node did, layer by layer.

One local cluster runs with `trace_dir` set: main records its own work per layer and its waits on
the workers, the shadow its late departure (how long after main it started the iteration), its idle
wait for alignment and each layer up to its router (where it publishes), each
worker every expert load (hatched when the prediction went unused) and compute, and every message
main <-> worker as a flow. After a warm-up request (whose spans are dropped) one request is traced;
the merged Chrome trace (open it in chrome://tracing or ui.perfetto.dev) and a PNG of the chosen
decode iterations are written, with per-iteration figures printed.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import odmoe
from odmoe.models.open_model import load_tokenizer
from odmoe.tools.trace import merge
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import prompts

IDLE_FLUSH_S = 1.5  # workers write their spans out after 1 s idle


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.timeline
    tokenizer = load_tokenizer(model_path)
    (prompt,) = prompts(tokenizer, 1)
    trace_dir = Path(tempfile.mkdtemp(prefix="odmoe-trace-"))
    try:
        words = cluster_words(cfg, f"trace_dir={trace_dir}")
        with odmoe.LocalCluster(model_path, overrides=words) as cluster:
            cluster.client.generate(prompt, max_new_tokens=4)  # warm-up
            time.sleep(IDLE_FLUSH_S)
            for part in trace_dir.glob("*.jsonl"):
                part.unlink()
            result = cluster.client.generate(prompt, max_new_tokens=suite.new_tokens)
            time.sleep(IDLE_FLUSH_S)
        trace = merge(trace_dir)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    trace_path = out.path("timeline-trace", "json")
    trace_path.write_text(json.dumps(trace))
    print(f"wrote {trace_path} (open in chrome://tracing or ui.perfetto.dev)")
    events = _named_lanes(trace["traceEvents"])
    per_iteration = summarise(events)
    for n, row in sorted(per_iteration.items()):
        print(
            f"iteration {n}: main {row['main_ms']:.2f} ms own work + "
            f"{row['wait_ms']:.2f} ms waiting on workers; "
            f"shadow late departure {row['late_departure_ms']:.2f} ms (idle {row['shadow_idle_ms']:.2f} ms); "
            f"loads {row['loads']} "
            f"({row['unused_loads']} unused), mean load {row['load_ms_mean']:.2f} ms"
        )
    window = _window(events, suite.iterations)
    report = {
        "new_tokens": suite.new_tokens,
        "iterations_drawn": suite.iterations,
        "stats": {
            k: result.stats.get(k) for k in ("decode_tokens_per_s", "recall", "timely_recall", "stall_s")
        },
        "per_iteration": per_iteration,
        "chrome_trace": str(trace_path),
    }
    out.write("timeline", "timeline", report)
    if window:
        plots.timeline(
            events,
            window,
            out.path("timeline", "png"),
            f"decode iterations {suite.iterations} (paper Fig. 2/5, measured): "
            f"{out.describe(suite.new_tokens)}",
        )
    return report


def _named_lanes(events: list[dict]) -> list[dict]:
    """Chrome events with a readable `lane_name` ("worker0 load") from the metadata events."""
    process = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    named = []
    for e in events:
        if e["ph"] == "M":
            continue
        node, lane = process[e["pid"]], thread[(e["pid"], e["tid"])]
        named.append({**e, "lane_name": node if lane == node else f"{node} {lane}"})
    return named


def summarise(events: list[dict]) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for e in events:
        n = e.get("args", {}).get("iteration")
        if e["ph"] != "X" or n is None or n < 1:
            continue
        row = rows.setdefault(
            n,
            {
                "main_ms": 0.0,
                "wait_ms": 0.0,
                "late_departure_ms": 0.0,
                "shadow_idle_ms": 0.0,
                "loads": 0,
                "unused_loads": 0,
                "_load": [],
            },
        )
        ms = e["dur"] / 1e3
        if e["lane_name"] == "main":
            row["wait_ms" if e["name"].startswith("wait") else "main_ms"] += ms
        elif e["name"] == "late departure":
            row["late_departure_ms"] += ms
        elif e["name"] == "waiting for alignment":
            row["shadow_idle_ms"] += ms
        elif e["name"].startswith("load"):
            row["loads"] += 1
            row["unused_loads"] += not e["args"].get("used", True)
            row["_load"].append(ms)
    for row in rows.values():
        loads = row.pop("_load")
        row["load_ms_mean"] = statistics.mean(loads) if loads else 0.0
    return rows


def _window(events: list[dict], iterations: list[int]) -> tuple[float, float] | None:
    main = [
        e
        for e in events
        if e["lane_name"] == "main" and e["ph"] == "X" and e["args"].get("iteration") in iterations
    ]
    if not main:
        return None
    return min(e["ts"] for e in main), max(e["ts"] + e["dur"] for e in main)
