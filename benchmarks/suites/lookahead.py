"""Suite `lookahead` (issue 13): do predictions reach main in time, and what does it buy?

Part 1, clusters: for each shadow precision, the same prompts through one local cluster per system,
on the suite's emulated link (the grid's settings):
- `wait`: the paper's alignment, token + K/V every iteration (the shadow waits for main's data);
- `speculative`: `alignment.mode=speculative` (never waits, rolls back on a different token);
- `hedged`: speculative + hedged prefetch (`shadow.hedge_margin`, one more device slot per worker);
- `tuned`: wait mode with `alignment.tune=true` (periods adapted from the wrong predictions seen);
- `resident_workers`: the same cluster with every expert resident and no shadow (the ceiling);
- `resident_with_shadow` (not in the default list, a diagnosis): resident experts *and* a speculative
  shadow: what the shadow's CPU time and the prediction protocol cost without any load;
- `lru_offloader`: one process with an LRU expert cache over the same link (the grid's baseline).
Per system: timely recall (predictions that were at main when it needed them), recall, reloads
per decoded token, decode tokens/s against resident, lookahead (layers and iterations), rollbacks,
hedge bytes, the periods a tuned plan chose. With `pin`, the speculative, hedged and resident
clusters run again pinned with `taskset`: the shadow alone on CPU 1, main and the workers on CPU 0.
On two shared cores the shadow's CPU time competes with main's; giving it a core of its own (as a
shadow box of its own would) shows how much of a result that decides. Main and the workers take
turns (main waits for the workers, they wait for main), so they share a core at little cost.
Per cluster also what bounds its speed: the CPU time each node spent per generated token (every
thread, from /proc), the cores it kept busy and the bound that CPU alone sets (this machine's cores
divided by the CPU a token takes); and the busiest worker's link time per token (its loads, each as
long as the emulated link makes it) and the bound that sets. Both against the resident cluster.

Part 2, hedging without the clock (benchmarks/replay.py): each precision's shadow re-played on
main's greedy trajectory with token + K/V alignment; recall with and without the hedges of each
margin, and the extra expert loads the hedges cost (experts of a layer are equal in size, so that
is also the extra bytes).
"""

from __future__ import annotations

import math
import shutil
import statistics

from odmoe.launch.local_cluster import NodePlacement
from odmoe.main.alignment import AlignmentSchedule
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.shadow.hedging import shadow_hedges
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words, cpu_per_token, mean_of, pooled_recall, run_cluster
from odmoe_bench.config import BenchConfig
from odmoe_bench.replay import load_reference, load_shadow, reference_trajectory, replay_shadow
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, prompts


def _systems(cfg: BenchConfig) -> dict[str, list[str]]:
    s = cfg.lookahead
    slots = f"worker.slots={s.hedge_slots}"
    return {
        "wait": ["alignment.token_period=1", "alignment.kv_period=1"],
        "speculative": ["alignment.mode=speculative", f"alignment.max_ahead={s.max_ahead}"],
        "hedged": [
            "alignment.mode=speculative",
            f"alignment.max_ahead={s.max_ahead}",
            f"shadow.hedge_margin={s.hedge_margin}",
            slots,
        ],
        "tuned": ["alignment.tune=true", "alignment.token_period=1", "alignment.kv_period=1"],
        "resident_workers": ["emulation.resident=true", "shadow.enabled=false"],
        # a diagnosis, not a system: every expert resident, yet a speculative shadow running and
        # main doing all of its prediction bookkeeping (the workers ignore predictions): what the
        # shadow's CPU and protocol cost without a single load
        "resident_with_shadow": ["emulation.resident=true", "alignment.mode=speculative"],
    }


PINNED = ("speculative", "hedged", "resident_workers")
SYSTEMS = Table(
    "system:<28:system",
    "shadow:>13:precision",
    "decode tok/s:>16:speed",
    "vs resident:12.3f:vs_resident",
    "timely:8.4f:timely_recall",
    "recall:8.4f:recall",
    "reloads/tok:12.3f:reloads_per_token",
    "stall ms/tok:13.2f:stall_ms_per_token",
    "ahead L:8.2f:lookahead_layers",
    "ahead it:9.2f:lookahead_iterations",
    "rollbacks:10d:rollbacks",
    "hedge MiB:10.2f:hedge_mib",
)
HEDGES = Table(
    "shadow:<14:precision",
    "margin:>8g:margin",
    "recall:>9.4f:recall",
    "with hedges:>13.5f:recall_with_hedges",
    "95% low:>9.5f:recall_with_hedges_low95",
    "misses:>14:misses",
    "extra loads:>13.1%:extra_loads",
)


def _pinned(name: str) -> NodePlacement:
    """The shadow alone on CPU 1; main and every worker on CPU 0."""
    return NodePlacement(prefix=["taskset", "-c", "1" if name == "shadow" else "0"])


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.lookahead
    tokenizer = load_tokenizer(model_path)
    requests = prompts(tokenizer, suite.prompts, suite.prompt_tokens, first=300)
    systems = _systems(cfg)
    rows: list[dict] = []
    pin = suite.pin and shutil.which("taskset") is not None
    for precision in suite.precisions:
        for name in suite.systems:
            variants = [False, True] if pin and name in PINNED else [False]
            if suite.pinned_only:
                variants = [True] if pin and name in PINNED else []
            if name == "resident_workers" and precision != suite.precisions[0]:
                continue  # no shadow: one run serves every precision
            for pinned in variants:
                if name == "lru_offloader":
                    if precision == suite.precisions[0] and not pinned:
                        rows.append(_lru_row(cfg, model_path, requests))
                    continue
                words = cluster_words(cfg, f"shadow.precision={precision}", *systems[name])
                label = name + (" (pinned)" if pinned else "")
                print(f"-- {precision} {label}", flush=True)
                run_ = run_cluster(
                    model_path, words, requests, suite.new_tokens, place=_pinned if pinned else None
                )
                rows.append(_row(label, precision, run_))
    identical = None  # lookahead.systems=[]: part 2 alone, no cluster ran
    if rows:
        _ratios(rows)
        identical = len({tuple(map(tuple, r.pop("token_ids"))) for r in rows}) == 1
        _print_table(rows)
        print(f"tokens identical across systems: {identical}")
        _print_vs_lru(rows)
        _print_bounds(rows)
    hedging = _hedging(cfg, model_path, tokenizer) if suite.hedging else []
    pinning = "the shadow on CPU 1, main and the workers on CPU 0" if pin else None
    report = {"rows": rows, "tokens_identical": identical, "hedging": hedging, "pinned": pinning}
    out.write("lookahead", "lookahead", report)
    subtitle = out.describe(suite.new_tokens, shadow=f"shadow {' / '.join(suite.precisions)}")
    if not rows:
        subtitle = (
            f"hedging on main's trajectory: {suite.replay_prompts} prompts x {suite.replay_tokens} tokens, "
            "token + K/V aligned every iteration (no cluster, no clock)"
        )
    plots.lookahead(report, out.path("lookahead", "png"), subtitle)
    return report


def _row(label: str, precision: str, run) -> dict:
    stats = run.stats
    decode = [s["decode_tokens_per_s"] for s in stats]
    tokens = sum(max(s["new_tokens"] - 1, 0) for s in stats)
    shadowed = [s for s in stats if s.get("shadow")]
    hedging = [s.get("hedging") or {} for s in stats]
    return {
        "system": label,
        "precision": precision if shadowed else "-",
        "decode_tokens_per_s": statistics.mean(decode),
        "decode_sd": statistics.stdev(decode) if len(decode) > 1 else 0.0,
        "decode_per_request": decode,  # in prompt order, as every system gets them
        "timely_recall": pooled_recall(stats, "timely_recall") if shadowed else None,
        "recall": pooled_recall(stats) if shadowed else None,
        "reloads_per_token": sum(s["reloads"] for s in stats) / tokens if tokens else None,
        "stall_ms_per_token": 1e3 * sum(s["stall_s"] for s in stats) / tokens if tokens else None,
        "lookahead_layers": mean_of(shadowed, "lookahead_layers_mean"),
        "lookahead_iterations": mean_of(shadowed, "lookahead_iterations_mean"),
        "rollbacks": sum(s.get("shadow_rollbacks") or 0 for s in stats),
        "hedge_loads": sum(h.get("hedge_loads", 0) for h in hedging),
        "hedge_bytes": sum(h.get("hedge_bytes", 0) for h in hedging),
        "bytes_loaded": sum(s["bytes_loaded"] for s in stats),
        "periods": [s["alignment"] for s in stats if s.get("alignment", {}).get("tuned")],
        "cpu": cpu_per_token(run),
        "link_ms_per_token": _busiest_link(stats),
        "token_ids": run.token_ids,
    }


def _busiest_link(stats: list[dict]) -> float | None:
    """ms per generated token that the busiest worker spent loading experts (each load as long as the
    emulated link makes it), over the requests: its link can carry no more, so 1000 / this is the
    most tokens/s the links allow, whatever the CPU and schedule. Counts the loads main used
    (preloaded or reloaded); unused preloads also take the link, so the true figure is higher."""
    tokens = sum(s["new_tokens"] for s in stats)
    busy: dict[str, float] = {}
    for s in stats:
        for worker, row in (s.get("per_worker") or {}).items():
            busy[worker] = busy.get(worker, 0.0) + row["load_s"]
    busiest = max(busy.values(), default=0.0)
    return busiest / tokens * 1e3 if busiest > 0 and tokens else None  # none: resident (no loads)


def _lru_row(cfg: BenchConfig, model_path: str, prompts) -> dict:
    from odmoe_bench.suites.grid import _process_system

    cell = {"name": "lookahead", "prompts": prompts, "new_tokens": cfg.lookahead.new_tokens}
    result = _process_system(cfg, model_path, "lru_offloader", [cell])
    runs = result["cells"][0]["runs"]
    decode = [r["decode_tokens_per_s"] for r in runs]
    print("-- lru_offloader", flush=True)
    return {
        "system": "lru_offloader",
        "precision": "-",
        "decode_tokens_per_s": statistics.mean(decode),
        "decode_sd": statistics.stdev(decode) if len(decode) > 1 else 0.0,
        "decode_per_request": decode,
        "token_ids": [r["token_ids"] for r in runs],
    }


def _resident(system: str) -> str:
    """The resident cluster a system is measured against: pinned against pinned."""
    return "resident_workers (pinned)" if "pinned" in system else "resident_workers"


def _ratios(rows: list[dict]) -> None:
    """Each row against the resident cluster, and prompt by prompt against the LRU offloader (whose
    speed varies with the prompt, its cache hits, far more than a cluster's: means alone hide it)."""
    base = {r["system"]: r["decode_tokens_per_s"] for r in rows if r["system"].startswith("resident")}
    lru = next((r["decode_per_request"] for r in rows if r["system"] == "lru_offloader"), None)
    for r in rows:
        ref = base.get(_resident(r["system"]))
        r["vs_resident"] = r["decode_tokens_per_s"] / ref if ref else None
        mine = r.get("decode_per_request")
        if lru and mine and r["system"] != "lru_offloader" and len(mine) == len(lru):
            r["vs_lru_per_prompt"] = [a / b for a, b in zip(mine, lru, strict=True)]


def _print_table(rows: list[dict]) -> None:
    SYSTEMS.header("\n")
    for r in rows:
        speed = f"{r['decode_tokens_per_s']:.1f} ± {r['decode_sd']:.1f}"
        hedge = r.get("hedge_bytes", 0) / 2**20 if r.get("hedge_bytes") is not None else None
        SYSTEMS.record(r, speed=speed, hedge_mib=hedge)
        for periods in r.get("periods") or []:
            print(f"{'':<28}tuned periods: {periods}")


def _print_vs_lru(rows: list[dict]) -> None:
    compared = [r for r in rows if r.get("vs_lru_per_prompt")]
    if not compared:
        return
    print("\nagainst the LRU offloader, the same prompts: decode tokens/s ratio per prompt")
    for r in compared:
        ratios = r["vs_lru_per_prompt"]
        wins = sum(x > 1 for x in ratios)
        print(
            f"{r['system']:<28}{r['precision']:>13}  faster on {wins} of {len(ratios)} prompts; "
            + " ".join(f"{x:.2f}" for x in ratios)
        )


def _print_bounds(rows: list[dict]) -> None:
    rows = [r for r in rows if r.get("cpu")]
    if not rows:
        return
    base = {r["system"]: r["cpu"]["tokens_per_s"] for r in rows if r["system"].startswith("resident_workers")}
    cores = rows[0]["cpu"]["cores"]
    print(
        f"\nWhat bounds the speed. CPU ms per generated token (prefill included, every thread); its bound: "
        f"{cores} cores / CPU per token, as tokens/s and as a share of the resident cluster's (whole "
        "requests both). The busiest worker's link: ms of expert loads per generated token; its bound: "
        "1000 / that"
    )
    nodes = ("main", "shadow", "workers", "client")
    table = Table(
        "system:<28:system",
        "shadow:>13:precision",
        *(f"{n}:9.2f:cpu.ms_per_token.{n}" for n in nodes),
        "total:8.2f:cpu.total_ms_per_token",
        "cores busy:11.2f:cpu.cores_busy",
        "tok/s:8.1f:cpu.tokens_per_s",
        "bound:8.1f:cpu.bound_tokens_per_s",
        "bound vs resident:18.3f:share",
        "link ms/tok:12.2f:link_ms_per_token",
        "link bound:11.1f:link_bound",
        "vs resident:12.3f:link_share",
    )
    table.header()
    for r in rows:
        c = r["cpu"]
        ref = base.get(_resident(r["system"]))
        share = c["bound_tokens_per_s"] / ref if ref and c["bound_tokens_per_s"] else None
        link_bound = 1e3 / r["link_ms_per_token"] if r.get("link_ms_per_token") else None
        link_share = link_bound / ref if link_bound and ref else None
        table.record(r, share=share, link_bound=link_bound, link_share=link_share)


def _hedging(cfg: BenchConfig, model_path: str, tokenizer) -> list[dict]:
    """Recall with and without hedges per precision and margin, on main's trajectory (no clock)."""
    suite = cfg.lookahead
    ckpt = open_checkpoint(model_path)
    reference = load_reference(model_path)
    eos = {tokenizer.eos_token_id}
    trajs = [
        reference_trajectory(reference, p, suite.replay_tokens, ckpt.num_experts, ckpt.top_k, eos)
        for p in prompts(tokenizer, suite.replay_prompts, suite.prompt_tokens, first=400)
    ]
    rows = []
    HEDGES.header("\n")
    for precision in suite.hedge_precisions:
        shadow = load_shadow(model_path, precision)
        replays = []
        for traj in trajs:
            scores: dict = {}
            schedule = AlignmentSchedule(1, 1)
            predicted = replay_shadow(shadow, traj, schedule, ckpt.num_experts, scores, ckpt.top_k)
            replays.append((traj, predicted, scores))
        for margin in suite.hedge_margins:
            hits = hedged_hits = activated = predicted_n = hedges_n = 0
            for traj, predicted, scores in replays:
                for position, act in traj.activated.items():
                    pred = set(predicted.get(position, []))
                    candidates, probs, unmasked, limit = scores[position]
                    hedges = set(shadow_hedges(candidates, probs, ckpt.top_k, margin, unmasked, limit)) - pred
                    hits += len(pred & set(act))
                    hedged_hits += len((pred | hedges) & set(act))
                    activated += len(act)
                    predicted_n += len(pred)
                    hedges_n += len(hedges)
            row = {
                "precision": precision,
                "margin": margin,
                "recall": hits / activated,
                "recall_with_hedges": hedged_hits / activated,
                "recall_with_hedges_low95": wilson_low(hedged_hits, activated),
                "misses": activated - hedged_hits,
                "activated": activated,
                "extra_loads": hedges_n / predicted_n,
            }
            rows.append(row)
            HEDGES.record(row, misses=f"{row['misses']:>7}/{activated:<6}")
        del shadow
    return rows


def wilson_low(successes: int, n: int, z: float = 1.96) -> float:
    """The lower end of the Wilson score interval (95 % at z=1.96) of a proportion: how low the true
    recall could be, given this many activations. A goal is met when this clears it."""
    if n == 0:
        return 0.0
    p = successes / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n)
