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
   link black-holes mid-stream: time until main cancels its request (its pings go unanswered);
5) case `jitter_loss`, a cluster of its own: a relay in front of every worker and the shadow holds
   each chunk and beat 0..`network.jitter_ms` each way, and every node's link (the relayed hops
   and the client's too) drops `network.loss` of its packets, for `network.seconds`; against the
   same cluster through clean relays;
6) case `shadow_cut`, a cluster of its own (cacheless workers, fp32 shadow): main <-> shadow drops
   everything for `network.cut_s`; recover is from the link's return to the first decode iteration
   that used predictions again; against the same cluster healthy (10 s);
7) case `straggler`: cacheless workers (`worker.cache=0`, where main steers), every worker's expert
   loads over an emulated 25 Gbit/s + 0.2 ms link, worker3's `network.slower` times slower in rate
   and latency, for `network.straggler_s`; against the same clusters with every link fast; detect
   is from the load's start until main names worker3 a straggler; nothing to recover.
Per case: tokens/s against its healthy baseline (the first cluster's, or the case's own), the
longest gap between two tokens of a stream, time to detect (the black hole: main's membership
event; the cut client: its request cancelled; the shadow cut: main calling the shadow lost; the
straggler: main steering away from it), time to recover (from the link's return to the worker, or
the predictions, in use again), false losses (workers declared lost where every worker stays
reachable), tokens checked, and requests whose tokens differ from transformers' greedy generate()
(must be 0).
Needs root, iproute2 and iptables; anywhere else it says why and measures nothing.
"""

from __future__ import annotations

from transformers import AutoConfig

from odmoe.models.open_model import load_tokenizer
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words
from odmoe_bench.config import BenchConfig
from odmoe_bench.netns_lan import Lan
from odmoe_bench.network_faults import (
    NEW_TOKENS,
    black_hole,
    client_cut,
    jitter_and_loss,
    missing,
    phase,
    shadow_cut,
    straggler,
)
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
    import odmoe

    tok = load_tokenizer(model_path)
    streams = prompts(tok, suite.streams, length=16)
    wants = [reference_tokens(model_path, p, NEW_TOKENS) for p in streams]
    nodes = ["main", "shadow", *[f"worker{i}" for i in range(cfg.cluster.workers)]]
    rows = []
    words = cluster_words(cfg)
    with Lan(nodes, 1.0, 0.1) as lan:
        with odmoe.LocalCluster(model_path, overrides=words, place=lan.placement) as cluster:
            cluster.client.generate(streams[0], max_new_tokens=4)  # warm
            healthy = phase(cluster, streams, wants, max(suite.seconds / 4, 10))
            rows.append(_row("healthy", healthy, healthy))
            if "loss" in suite.cases:
                for node in nodes:
                    lan.drop(node, suite.loss)
                lossy = phase(cluster, streams, wants, suite.seconds)
                for node in nodes:
                    lan.heal(node)
                rows.append(_row(f"loss {suite.loss:.0%}", lossy, healthy))
            if "black_hole" in suite.cases:
                hole = black_hole(lan, cluster, streams, wants, suite.hole_s)
                rows.append(_row(f"worker1 black-holed {suite.hole_s:g} s", hole, healthy))
            if "client_cut" in suite.cases:
                context = AutoConfig.from_pretrained(model_path).max_position_embeddings
                cut = client_cut(cluster, streams, wants, context)
                rows.append(_row("a client black-holed", cut, healthy))
        if "jitter_loss" in suite.cases:
            both = jitter_and_loss(
                lan, model_path, words, streams, wants, suite.loss, suite.jitter_ms / 1e3, suite.seconds
            )
            case = f"loss {suite.loss:.0%} + jitter 0-{suite.jitter_ms:g} ms"
            rows.append(_row(case, both["jitter_loss"], both["healthy"]))
        if "shadow_cut" in suite.cases:
            cut = shadow_cut(lan, model_path, words, streams, wants, suite.cut_s)
            rows.append(
                _row(f"main-shadow cut {suite.cut_s:g} s", cut, {"tokens_per_s": cut["healthy_tokens_per_s"]})
            )
        if "straggler" in suite.cases:
            both = straggler(lan, model_path, words, streams, wants, suite.straggler_s, suite.slower)
            rows.append(_row(f"worker3 {suite.slower:g}x slower link", both["straggler"], both["healthy"]))
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


def _row(case: str, measured: dict, healthy: dict) -> dict:
    found = "detect_s" in measured  # a case with something to detect
    return {
        "case": case,
        "tokens_per_s": measured["tokens_per_s"],
        "healthy_tokens_per_s": healthy["tokens_per_s"],
        "vs_healthy": round(measured["tokens_per_s"] / max(healthy["tokens_per_s"], 1e-9), 3),
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
