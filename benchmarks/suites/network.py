"""Suite `network`: what a home network's faults cost a loaded cluster, and that they cost no token.

Every node runs in a network namespace of its own (benchmarks/netns_lan.py: veths into a 1 Gbit/s
bridge); `network.streams` clients stream 48-token requests back to back through each phase
(benchmarks/network_faults.py):
1) healthy, `network.seconds`/4 (at least 10 s): the baseline tokens/s;
2) case `loss`: every node's link drops `network.loss` of its packets both ways (iptables
   `statistic`), `network.seconds`;
3) case `black_hole`: worker1's link drops everything for `network.hole_s` while its process lives,
   then heals;
4) case `client_cut`: one more client streams through a relay (odmoe/tools/link_relay.py) whose
   link black-holes mid-stream: time until main cancels its request (its pings go unanswered).
Per case: tokens/s against the healthy baseline, the longest gap between two tokens of a stream,
time to detect (the black hole: main's membership event; the cut client: its request cancelled;
loss: none is wanted, the workers
wrongly declared lost are counted instead), time to recover (from the link's return to the worker
serving again) and requests whose tokens differ from transformers' greedy generate() (must be 0).
Needs root, iproute2 and iptables; anywhere else it says why and measures nothing.
"""

from __future__ import annotations

from transformers import AutoConfig

from odmoe.benchmarks import plots
from odmoe.benchmarks.cluster_runs import cluster_words
from odmoe.benchmarks.config import BenchConfig
from odmoe.benchmarks.netns_lan import Lan
from odmoe.benchmarks.network_faults import NEW_TOKENS, black_hole, client_cut, missing, phase
from odmoe.benchmarks.results import ResultsDir, fmt
from odmoe.benchmarks.workload import prompt_ids, reference_tokens
from odmoe.models.open_model import load_tokenizer

PROMPT_TOKENS = 16


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.network
    if why := missing():
        print(f"suite network skipped: {why}", flush=True)
        return {"skipped": why}
    import odmoe

    tok = load_tokenizer(model_path)
    prompts = [prompt_ids(tok, i, PROMPT_TOKENS) for i in range(suite.streams)]
    wants = [reference_tokens(model_path, p, NEW_TOKENS) for p in prompts]
    nodes = ["main", "shadow", *[f"worker{i}" for i in range(cfg.cluster.workers)]]
    rows = []
    with (
        Lan(nodes, 1.0, 0.1) as lan,
        odmoe.LocalCluster(model_path, overrides=cluster_words(cfg), place=lan.placement) as cluster,
    ):
        cluster.client.generate(prompts[0], max_new_tokens=4)  # warm
        healthy = phase(cluster, prompts, wants, max(suite.seconds / 4, 10))
        rows.append(_row("healthy", healthy, healthy))
        if "loss" in suite.cases:
            for node in nodes:
                lan.drop(node, suite.loss)
            lossy = phase(cluster, prompts, wants, suite.seconds)
            for node in nodes:
                lan.heal(node)
            rows.append(_row(f"loss {suite.loss:.0%}", lossy, healthy))
        if "black_hole" in suite.cases:
            hole = black_hole(lan, cluster, prompts, wants, suite.hole_s)
            rows.append(_row(f"worker1 black-holed {suite.hole_s:g} s", hole, healthy))
        if "client_cut" in suite.cases:
            context = AutoConfig.from_pretrained(model_path).max_position_embeddings
            cut = client_cut(cluster, prompts, wants, context)
            rows.append(_row("a client black-holed", cut, healthy))
    print(
        f"{'case':<28}{'tokens/s':>9}{'vs healthy':>11}{'stall s':>9}{'detect s':>9}{'recover s':>10}"
        f"{'false losses':>13}{'requests':>9}{'different':>10}",
        flush=True,
    )
    for r in rows:
        print(
            f"{r['case']:<28}{r['tokens_per_s']:9.2f}{r['vs_healthy']:11.2f}{fmt(r['longest_stall_s'], 9)}"
            f"{fmt(r['detect_s'], 9)}{fmt(r['recover_s'], 10)}{fmt(r['false_losses'], 13, 'd')}"
            f"{r['requests']:9d}{r['different']:10d}",
            flush=True,
        )
    report = {"loss": suite.loss, "hole_s": suite.hole_s, "streams": suite.streams, "rows": rows}
    out.write("network", "network", report)
    lan = f"1 Gbit/s bridge, {suite.streams} streams, {suite.loss:.0%} loss per link"
    plots.network(rows, out.path("network", "png"), f"{out.describe(NEW_TOKENS)}; {lan}")
    return report


def _row(case: str, measured: dict, healthy: dict) -> dict:
    hole = "detect_s" in measured  # a case with something to detect: no false losses counted
    return {
        "case": case,
        "tokens_per_s": measured["tokens_per_s"],
        "vs_healthy": round(measured["tokens_per_s"] / max(healthy["tokens_per_s"], 1e-9), 3),
        "longest_stall_s": measured["longest_stall_s"],
        "detect_s": measured["detect_s"] if hole else None,
        "detected_by": measured.get("detected_by"),
        "recover_s": measured["serving_again_s"] if hole else None,
        # a black-holed worker's loss is wanted; anywhere else every declared loss is a false one
        "false_losses": None if hole else measured["workers_declared_lost"],
        "requests": measured["requests"],
        "different": measured["different"],
        "lost_requests": measured["lost_requests"],
    }
