"""Suite `faults`: what losing each kind of node costs one streamed request, and that it costs no token.

For each case (a worker, the shadow, main; killed or frozen) one local cluster streams
`faults.new_tokens` tokens of one prompt while the node's own fault trigger fires at decode
iteration `faults.at_token` (main's case runs a standby main beside it). From the fault's own
record (wall clock) and the stream's arrival times it reports:
- detect_s: fault -> the loss noticed (main's membership event for a worker, main's shadow link
  for the shadow, the client's failover for main);
- stall_s: the inter-token gap across the fault minus the median gap before it;
- recovery_s: fault -> the token after which `3` gaps in a row are within 1.5x the median before;
- tokens_equal: the stream equals transformers' own greedy generate(); with `faults.streams` > 1
  that many streams run at once (continuous batching: the fault lands while all of them decode),
  and every one must equal its reference.
A frozen worker or shadow is resumed after `faults.resume_after_s` (it then rejoins); a frozen
main stays frozen (the client has moved on).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import odmoe
from odmoe.models.open_model import load_tokenizer
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, prompts
from odmoe_bench.workload import reference_tokens

TABLE = Table(
    "node:<9:node",
    "action:<7:action",
    "detect s:9.3f:detect_s",
    "stall s:9.3f:stall_s",
    "recovery s:11.3f:recovery_s",
    "gap before ms:14.1f:gap_ms",
    "tokens equal:>13:tokens_equal",
    none="n/a",
)


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.faults

    tok = load_tokenizer(model_path)
    streams = prompts(tok, max(suite.streams, 1))
    wants = [reference_tokens(model_path, p, suite.new_tokens) for p in streams]
    TABLE.header()
    rows = []
    for case in suite.cases:
        node, action = case.split(":")
        row = _one(cfg, model_path, streams, wants, node, action)
        rows.append(row)
        TABLE.record(row, gap_ms=row["median_gap_before_s"] * 1e3)
    report = {
        "new_tokens": suite.new_tokens,
        "at_token": suite.at_token,
        "streams": suite.streams,
        "rows": rows,
    }
    out.write("faults", "faults", report)
    plots.faults(rows, out.path("faults", "png"), out.describe(suite.new_tokens))
    return report


def _one(cfg: BenchConfig, model_path: str, prompts: list, wants: list, node: str, action: str):
    suite = cfg.faults
    with tempfile.TemporaryDirectory(prefix="odmoe-faults-") as scratch:
        record = Path(scratch) / "fault.jsonl"
        resume = suite.resume_after_s if action == "stop" and node != "main" else 0.0
        words = cluster_words(
            cfg,
            f"fault.node={node}",
            f"fault.action={action}",
            f"fault.iteration={suite.at_token}",
            f"fault.resume_after_s={resume}",
            f"fault.record={record}",
        )
        standby = 1 if node == "main" else 0
        with odmoe.LocalCluster(model_path, overrides=words, standby_mains=standby) as cluster:
            others: dict[int, list[int]] = {}

            def stream(i: int) -> None:  # another user's stream, decoding beside the measured one
                with odmoe.Client(cluster.main_addresses, credentials=cluster.credentials) as client:
                    others[i] = [
                        p.token_id for p in client.stream(prompts[i], max_new_tokens=suite.new_tokens)
                    ]

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(1, len(prompts))]
            for t in threads:
                t.start()
            arrivals, tokens, stats = [], [], {}
            for reply in cluster.client._replies(prompts[0], suite.new_tokens):
                if reply.WhichOneof("kind") == "token":
                    arrivals.append(time.time() * 1e6)
                    tokens.append(reply.token.token_id)
                else:
                    stats = json.loads(reply.done.stats_json)
            for t in threads:
                t.join(timeout=300)
            fired = json.loads(record.read_text().splitlines()[0])
            failovers = list(cluster.client.failover_log)
    equal = tokens == wants[0] and all(others.get(i) == wants[i] for i in range(1, len(prompts)))
    return {**_measure(node, action, fired, arrivals, equal, stats, failovers), "streams": len(prompts)}


def _measure(node, action, fired, arrivals, equal, stats, failovers) -> dict:
    at = fired["at_us"]
    if node == "main":
        detected = failovers[0]["at_us"] if failovers else None
    elif node == "shadow":
        detected = stats.get("shadow_lost_at_us")
    else:
        lost = [e for e in stats.get("failover", {}).get("events", []) if e["event"] == "lost"]
        detected = lost[0]["at_us"] if lost else None
    gaps = [(b - a) / 1e6 for a, b in zip(arrivals, arrivals[1:], strict=False)]
    after = next((i for i, t in enumerate(arrivals) if t > at), len(arrivals))  # first token after
    before = gaps[: max(after - 2, 1)]
    median = statistics.median(before) if before else 0.0
    stall = gaps[after - 1] - median if 0 < after <= len(gaps) else None
    recovery = None
    for i in range(after, len(gaps) - 2):
        if all(g <= 1.5 * median for g in gaps[i : i + 3]):
            recovery = (arrivals[i] - at) / 1e6
            break
    return {
        "node": node,
        "action": action,
        "fired_at_token": after,
        "detect_s": None if detected is None else (detected - at) / 1e6,
        "stall_s": stall,
        "recovery_s": recovery,
        "median_gap_before_s": median,
        "tokens_equal": equal,
        "gaps_s": gaps,
        "resumed_tokens": stats.get("resumed_tokens", 0),
    }
