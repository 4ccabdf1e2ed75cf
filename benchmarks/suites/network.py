"""Suite `network`: what a home network's faults cost a loaded cluster, and that they cost no token.

Every node runs in a network namespace of its own (benchmarks/netns_lan.py: veths into a 1 Gbit/s
bridge); `network.streams` clients stream 48-token requests back to back through each phase of
`network_faults.measure` (its docstring and the module's say how each case is made): healthy
(`network.seconds`/4, at least 10 s), then each of `network.cases`: `loss` (every link,
`network.loss`), `black_hole` (worker1, `network.hole_s`), `client_cut` (one more client through a
relay that black-holes mid-stream), `jitter_loss` (relays jittering 0..`network.jitter_ms` and every
link lossy), `shadow_cut` (main <-> shadow, `network.cut_s`) and `straggler` (worker3's emulated
load link `network.slower` times slower, `network.straggler_s`); the last three on clusters of
their own, each against its own healthy run.
Per case: tokens/s against its healthy baseline, the longest gap between two tokens of a stream,
time to detect (the black hole: main's membership event; the cut client: its request cancelled;
the shadow cut: main calling the shadow lost; the straggler: main steering away from it), time to
recover (from the link's return to the worker, or the predictions, in use again), false losses
(workers declared lost where every worker stays reachable), tokens checked, and requests whose
tokens differ from transformers' greedy generate() (must be 0).
Needs root, iproute2 and iptables; anywhere else it says why and measures nothing.
"""

from __future__ import annotations

from odmoe.models.open_model import load_tokenizer
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words
from odmoe_bench.config import BenchConfig
from odmoe_bench.netns_lan import Lan
from odmoe_bench.network_faults import NEW_TOKENS, measure, missing
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, prompts
from odmoe_bench.workload import reference_tokens

TABLE = Table(
    "case:<28:case",
    "tokens/s:9.2f:tokens_per_s",
    "vs healthy:11.2f:vs_healthy",
    "stall s:9.3f:longest_stall_s",
    "detect s:9.3f:detect_s",
    "recover s:10.3f:recover_s",
    "false losses:13d:false_losses",
    "requests:9d:requests",
    "tokens:8d:tokens_checked",
    "different:10d:different",
)


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.network
    if why := missing():
        print(f"suite network skipped: {why}", flush=True)
        return {"skipped": why}
    streams = prompts(load_tokenizer(model_path), suite.streams, length=16)
    wants = [reference_tokens(model_path, p, NEW_TOKENS) for p in streams]
    nodes = ["main", "shadow", *[f"worker{i}" for i in range(cfg.cluster.workers)]]
    with Lan(nodes, 1.0, 0.1) as lan:
        measured = measure(lan, model_path, cluster_words(cfg), streams, wants, ["healthy", *suite.cases],
                           suite.loss, suite.seconds, suite.hole_s, suite.jitter_ms, suite.cut_s,
                           suite.straggler_s, suite.slower)  # fmt: skip
    cases = {  # report key: the row's case (a case on a cluster of its own carries its own baseline)
        "healthy": "healthy",
        "lossy": f"loss {suite.loss:.0%}",
        "black_hole": f"worker1 black-holed {suite.hole_s:g} s",
        "client_cut": "a client black-holed",
        "jitter_loss": f"loss {suite.loss:.0%} + jitter 0-{suite.jitter_ms:g} ms",
        "shadow_cut": f"main-shadow cut {suite.cut_s:g} s",
        "straggler": f"worker3 {suite.slower:g}x slower link",
    }
    healthy = measured["healthy"]["tokens_per_s"]
    rows = [
        _row(case, measured[key], measured[key].get("healthy_tokens_per_s", healthy))
        for key, case in cases.items()
        if key in measured
    ]
    TABLE.header()
    for r in rows:
        TABLE.record(r)
    report = {
        "loss": suite.loss,
        "hole_s": suite.hole_s,
        "jitter_ms": suite.jitter_ms,
        "cut_s": suite.cut_s,
        "slower": suite.slower,
        "streams": suite.streams,
        "rows": rows,
    }
    out.write("network", "network", report)
    lan = f"1 Gbit/s bridge, {suite.streams} streams, {suite.loss:.0%} loss per link"
    plots.network(rows, out.path("network", "png"), f"{out.describe(NEW_TOKENS)}; {lan}")
    return report


def _row(case: str, measured: dict, healthy: float) -> dict:
    found = "detect_s" in measured  # a case with something to detect
    return {
        "case": case,
        "tokens_per_s": measured["tokens_per_s"],
        "healthy_tokens_per_s": healthy,
        "vs_healthy": round(measured["tokens_per_s"] / max(healthy, 1e-9), 3),
        "longest_stall_s": measured["longest_stall_s"],
        "detect_s": measured["detect_s"] if found else None,
        "detected_by": measured.get("detected_by"),
        "recover_s": measured["serving_again_s"] if found else None,
        # a black-holed worker's loss is wanted (none counted there); elsewhere, the shadow cut and the
        # straggler included, every worker stays reachable: each one declared lost is a false loss
        "false_losses": measured.get("workers_declared_lost"),
        "tokens_checked": measured.get("tokens"),
        "requests": measured["requests"],
        "different": measured["different"],
        "lost_requests": measured["lost_requests"],
    }
