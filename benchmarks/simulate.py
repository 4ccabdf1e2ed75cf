"""The pipeline simulator with the paper's hardware (Mixtral-8x7B, 8 RTX 3090 workers, 1 Gbit/s).

    python benchmarks/simulate.py

Prints predicted decode tokens/s as a fraction of the paper's full-speed baseline (Transformers with
every expert resident: 4.89 tokens/s, Table 2) over the two figures the paper does not give: the
host->device load bandwidth of a worker and the shadow's time per layer; then the same setting (10
nodes: main, shadow, 8 workers) with an expert cache of 0 / 4 / 8 / 16 GB per worker (worker.cache).
A cache's hit rate is estimated two ways: as the fraction of the experts it holds (routing spread
evenly over the experts, no help from prediction), and from the hit rate that fraction reached in
`odmoe-bench suite=cache` (benchmarks/results/cache.json, prediction-steered eviction on the
trained model) where that file exists. Writes benchmarks/results/simulate-paper.json. Every other
input is derived below, with its source; this is a model, not a measurement, and it is not yet
validated against a measured grid.
"""

from __future__ import annotations

import json

from odmoe.tools.pipeline_sim import PipelineParams, simulate
from odmoe_bench.results import RESULTS, write_report

LAYERS, GROUPS = 32, 4  # Mixtral-8x7B; 8 workers in groups of 2 (top-2)
EXPERT_BYTES = 3 * 4096 * 14336 * 2  # w1, w2, w3 in fp16: 352 MB
FULL_SPEED = 4.89  # tokens/s, Transformers with all experts cached (paper Table 2)
T_FULL_LAYER = 1 / FULL_SPEED / LAYERS  # 6.39 ms per layer at full speed
T_COMPUTE = EXPERT_BYTES / 936e9  # one token through one expert, memory-bound on a 3090 (936 GB/s)
T_MAIN = T_FULL_LAYER - 2 * T_COMPUTE  # the full-speed layer minus its two expert GEMVs
T_NET = 16e3 * 8 / 1e9 + 0.1e-3  # 16 KB per token per layer (paper) over 1 Gbit/s + 0.1 ms latency
LATE_DEPARTURE = 256e3 * 8 / 1e9  # KV alignment: 256 KB per iteration over 1 Gbit/s (paper)
RECALL = 0.9734  # the paper's INT8 shadow, token + KV alignment every iteration
WORKERS, EXPERTS = 8, 32 * 8
CACHE_GB = (0, 4, 8, 16)  # per worker
CACHE_LOAD_GBS, CACHE_SHADOW_S = 16, 2e-3  # the grid's middle: pinned-ish PCIe 4.0, a 2 ms shadow layer


def paper_params(load_gbs: float, shadow_layer_s: float, cache_hit: float = 0.0) -> PipelineParams:
    """The paper's setting with this host->device load bandwidth, shadow speed and cache hit rate."""
    return PipelineParams(
        layers=LAYERS,
        groups=GROUPS,
        t_main_s=T_MAIN,
        t_compute_s=T_COMPUTE,
        t_load_s=EXPERT_BYTES / (load_gbs * 1e9),
        t_net_s=T_NET,
        recall=RECALL,
        shadow_offset_s=LATE_DEPARTURE,
        t_shadow_layer_s=shadow_layer_s,
        cache_hit=cache_hit,
    )


def measured_hit_rate(fraction: float) -> float | None:
    """The hit rate suite=cache measured for odmoe (prediction) at this fraction of the experts' bytes,
    interpolated between its budgets; None without benchmarks/results/cache.json."""
    path = RESULTS / "cache.json"
    if not path.is_file():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"] if r["system"] == "odmoe"]
    points = sorted({(r["budget"], r["hit_rate"]) for r in rows if r.get("hit_rate") is not None})
    if not points:
        return None
    for (f0, h0), (f1, h1) in zip(points, points[1:], strict=False):
        if f0 <= fraction <= f1:
            return h0 + (h1 - h0) * (fraction - f0) / (f1 - f0) if f1 > f0 else h1
    return points[-1][1] if fraction >= points[-1][0] else points[0][1]


def cache_rows() -> list[dict]:
    per_worker = [int(gb * 1e9 // EXPERT_BYTES) for gb in CACHE_GB]
    print(
        f"\nwith a cache on each of the {WORKERS} workers (load {CACHE_LOAD_GBS} GB/s, shadow "
        f"{CACHE_SHADOW_S * 1e3:.0f} ms/layer); hit rate: even routing = the fraction cached, or as "
        "suite=cache measured at that fraction"
    )
    print(
        f"{'GB/worker':>10}{'experts':>9}{'cached':>8}{'hit':>7}{'tok/s':>8}{'x full':>8}"
        f"{'measured hit':>14}{'tok/s':>8}{'x full':>8}"
    )
    rows = []
    for gb, experts in zip(CACHE_GB, per_worker, strict=True):
        fraction = min(1.0, WORKERS * experts / EXPERTS)
        measured = measured_hit_rate(fraction) if 0 < fraction < 1 else fraction
        row = {"cache_gb_per_worker": gb, "experts_per_worker": experts, "fraction_cached": fraction}
        line = f"{gb:>10}{experts:>9}{fraction:>8.2f}"
        for name, hit in (("even", fraction), ("measured", measured)):
            if hit is None:
                line += f"{'-':>14}" if name == "measured" else ""
                continue
            result = simulate(paper_params(CACHE_LOAD_GBS, CACHE_SHADOW_S, cache_hit=hit))
            row[name] = {"hit_rate": hit, "tokens_per_s": result.tokens_per_s}
            row[name]["fraction_of_full_speed"] = result.tokens_per_s / FULL_SPEED
            width = 14 if name == "measured" else 7
            line += f"{hit:>{width}.2f}{result.tokens_per_s:>8.2f}{result.tokens_per_s / FULL_SPEED:>8.2f}"
        print(line)
        rows.append(row)
    return rows


def main() -> None:
    print(
        f"derived: full-speed layer {T_FULL_LAYER * 1e3:.2f} ms, main {T_MAIN * 1e3:.2f} ms, expert compute "
        f"{T_COMPUTE * 1e3:.2f} ms, network {T_NET * 1e3:.2f} ms one way, late departure "
        f"{LATE_DEPARTURE * 1e3:.2f} ms, recall {RECALL}"
    )
    bandwidths = [12, 16, 24]  # GB/s host->device (pageable ... pinned PCIe 4.0 x16)
    shadow_layers = [1e-3, 2e-3, 4e-3, T_FULL_LAYER]
    rows = []
    print("\nfraction of full speed; rows: load GB/s, columns: shadow ms per layer")
    print(f"{'':>8}" + "".join(f"{s * 1e3:>9.2f}" for s in shadow_layers))
    for gbs in bandwidths:
        line = f"{gbs:>8}"
        for t_shadow in shadow_layers:
            result = simulate(paper_params(gbs, t_shadow))
            rows.append(
                {
                    "load_gbytes_s": gbs,
                    "shadow_layer_s": t_shadow,
                    "tokens_per_s": result.tokens_per_s,
                    "fraction_of_full_speed": result.tokens_per_s / FULL_SPEED,
                    "stall_s_per_token": result.stall_s_per_token,
                }
            )
            line += f"{result.tokens_per_s / FULL_SPEED:>9.2f}"
        print(line)
    print("\nthe paper measured 3.69 tokens/s = 0.75 of full speed")
    cached = cache_rows()
    write_report(RESULTS / "simulate-paper.json", {"rows": rows, "paper_fraction": 0.7551, "cache": cached})


if __name__ == "__main__":
    main()
