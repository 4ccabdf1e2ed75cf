"""Lossy links and black holes measured on a cluster in network namespaces (benchmarks/netns_lan.py).

    python benchmarks/network_faults.py [--model tiny|DIR] [--loss 0.03] [--seconds 120]
        [--hole-s 30] [--streams 4] [--words failover.beat_interval_s=0 ...]

Needs root, iproute2 and iptables. One cluster (4 workers in groups of 2, every node in its own
namespace) runs `--streams` requests at a time, again and again:
1. healthy, `--seconds`/4: decode tokens/s;
2. every node's link losing `--loss` of its packets both ways (iptables `statistic` in each
   namespace; the client's own link is spared), `--seconds`: tokens/s, requests, how many workers
   were declared lost (false losses: every process lives);
3. worker1's link dropping everything for `--hole-s` (its process lives), then healed: time to
   detect, the longest stall of a stream, time from the link's return to worker1 serving again.
(`odmoe-bench suite=network` runs these phases, and `client_cut`: a client whose own link
black-holes mid-stream, until main cancels its request.)
Every request's tokens are compared with transformers' greedy generate(). `--words` are more
odmoe-launch words for the cluster (e.g. the detector before issue 47:
`failover.beat_interval_s=0 failover.heartbeat_timeout_s=1.0`). Prints the figures and writes JSON
(benchmarks/results/network-faults.json).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx

import odmoe
from odmoe.benchmarks.netns_lan import Lan
from odmoe.benchmarks.results import write_report
from odmoe.benchmarks.workload import prompt_ids, reference_tokens
from odmoe.models.open_model import load_tokenizer
from odmoe.tools.link_relay import Relay
from odmoe.tools.model_names import resolve_model
from odmoe.transport.security import TLS_NAME

RESULTS = Path(__file__).parent / "results"
WORKERS = 4
NODES = ["main", "shadow", *[f"worker{i}" for i in range(WORKERS)]]
NEW_TOKENS = 48


class Load:
    """`streams` clients, each streaming requests back to back until `stop`: tokens checked
    against the reference, arrival times kept."""

    def __init__(self, cluster, prompts: list[list[int]], wants: list[list[int]]):
        self.cluster, self.prompts, self.wants = cluster, prompts, wants
        self.times: list[list[float]] = []
        self.tokens = self.requests = self.different = 0
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(len(prompts))
        ]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        while not self.stopping.is_set():
            times, got = [], []
            try:
                for piece in self.cluster.client.stream(self.prompts[i], max_new_tokens=NEW_TOKENS):
                    got.append(piece.token_id)
                    times.append(time.monotonic())
            except Exception as exc:  # a lost request: counted, the load goes on
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            self.times.append(times)
            self.requests += 1
            self.tokens += len(got)
            self.different += got != self.wants[i]

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=300)

    def longest_stall_s(self, since: float) -> float:
        gaps = [b - a for ts in self.times for a, b in zip(ts, ts[1:], strict=False) if b >= since]
        return max(gaps, default=0.0)


def missing() -> str:
    """Why the namespace LAN cannot be made here ("" when it can): root, iproute2 and iptables."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and iptables)"
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {package})"
    probe = subprocess.run(["ip", "netns", "add", "odmoe-probe"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", "odmoe-probe"], capture_output=True)
    if probe.returncode != 0:
        return f"cannot create network namespaces here: {probe.stderr.strip()[:200]}"
    return ""


def _events(cluster, since: float) -> list[dict]:
    return [e for e in cluster.client.info()["membership_events"] if e["at_us"] / 1e6 >= since]


def phase(cluster, prompts, wants, seconds: float) -> dict:
    """`seconds` of load as the network is now: tokens/s, requests, losses declared, stall."""
    start, wall = time.monotonic(), time.time()
    load = Load(cluster, prompts, wants)
    time.sleep(seconds)
    load.stop()
    took = time.monotonic() - start
    return {
        "seconds": round(took, 1),
        "requests": load.requests,
        "tokens_per_s": round(load.tokens / took, 2),
        "different": load.different,
        "lost_requests": len(load.errors),
        "errors": load.errors[:3],
        "workers_declared_lost": sum(e["event"] == "lost" for e in _events(cluster, wall)),
        "events": _events(cluster, wall),
        "longest_stall_s": round(load.longest_stall_s(start), 3),
    }


def black_hole(lan: Lan, cluster, prompts, wants, hole_s: float) -> dict:
    """worker1's link drops everything for `hole_s` under load, then heals: detection, stall,
    serving again, tokens/s over the whole run (3 s before, the hole, the return, 3 s after)."""
    load = Load(cluster, prompts, wants)
    time.sleep(3)
    holed, start = time.time(), time.monotonic()
    lan.drop("worker1")
    time.sleep(hole_s)
    healed = time.time()
    lan.heal("worker1")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and 1 not in cluster.client.info()["live_workers"]:
        time.sleep(0.05)
    time.sleep(3)
    load.stop()
    took = time.monotonic() - start + 3  # the 3 s of load before the hole count too
    events = _events(cluster, holed)
    lost = [e for e in events if e["event"] == "lost" and e["worker"] == 1]
    back = [e for e in events if e["event"] == "rejoined" and e["worker"] == 1 and e["at_us"] / 1e6 >= healed]
    return {
        "hole_s": hole_s,
        "detect_s": round(lost[0]["at_us"] / 1e6 - holed, 3) if lost else None,
        "detected_by": lost[0]["reason"] if lost else None,
        "serving_again_s": round(back[0]["at_us"] / 1e6 - healed, 3) if back else None,
        "longest_stall_s": round(load.longest_stall_s(start), 3),
        "requests": load.requests,
        "tokens_per_s": round(load.tokens / took, 2),
        "different": load.different,
        "lost_requests": len(load.errors),
    }


CANCELLED = 'odmoe:requests_total{finish_reason="cancelled"}'


def _metric(cluster, name: str) -> float:
    # main's certificate names TLS_NAME and loopback, not the namespace's address: checked by name
    extensions = {"sni_hostname": TLS_NAME} if cluster.credentials else {}
    with httpx.Client(**cluster.http_auth) as http:
        page = http.send(http.build_request("GET", f"{cluster.http_url}/metrics", extensions=extensions)).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", page, re.M)
    return float(found.group(1)) if found else 0.0


def client_cut(cluster, prompts, wants, context: int) -> dict:
    """One more client streams through a relay (odmoe/tools/link_relay.py) beside the load, and
    its link black-holes mid-stream (no FIN, no RST): how long until main cancels its request
    (its pings unanswered, server.client_ping_s + client_ping_timeout_s), the load's tokens/s and
    longest stall meanwhile. The cut request asks for as many tokens as the model's `context`
    (positions) allows (ignore_eos), so it cannot end by itself first."""
    load = Load(cluster, prompts, wants)
    relay = Relay(f"tcp://{cluster.address}")
    cut = odmoe.Client(relay.address.removeprefix("tcp://"), keepalive_s=600, credentials=cluster.credentials)
    start = time.monotonic()
    try:
        stream = cut.stream(prompts[0], max_new_tokens=context - len(prompts[0]) - 1, ignore_eos=True)
        first = [next(stream).token_id for _ in range(3)]
        cancelled = _metric(cluster, CANCELLED)
        holed = time.monotonic()
        relay.black_hole(True)
        detect_s = None
        while time.monotonic() - holed < 60:
            if _metric(cluster, CANCELLED) > cancelled:
                detect_s = time.monotonic() - holed
                break
            time.sleep(0.05)
        time.sleep(3)
    finally:
        load.stop()
        relay.close()
        cut.close()
    took = time.monotonic() - start
    return {
        "detect_s": None if detect_s is None else round(detect_s, 3),
        "detected_by": "main's pings to the client" if detect_s is not None else None,
        "serving_again_s": None,
        "longest_stall_s": round(load.longest_stall_s(holed), 3),
        "requests": load.requests,
        "tokens_per_s": round(load.tokens / took, 2),
        "different": load.different + (first != wants[0][:3]),
        "lost_requests": len(load.errors),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--loss", type=float, default=0.03, help="share of packets each node's link drops")
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--hole-s", type=float, default=30)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--words", nargs="*", default=[])
    parser.add_argument("--out", default=str(RESULTS / "network-faults.json"))
    args = parser.parse_args()
    if why := missing():
        raise SystemExit(f"network_faults: {why}")
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    prompts = [prompt_ids(tok, i, 16) for i in range(args.streams)]
    wants = [reference_tokens(path, p, NEW_TOKENS) for p in prompts]
    report: dict = {"model": path, "loss_per_link": args.loss, "words": args.words, "streams": args.streams}
    words = [f"cluster.workers={WORKERS}", "cluster.group_size=2", *args.words]
    with (
        Lan(NODES, 1.0, 0.1) as lan,
        odmoe.LocalCluster(path, overrides=words, place=lan.placement) as cluster,
    ):
        cluster.client.generate(prompts[0], max_new_tokens=4)  # warm
        report["healthy"] = phase(cluster, prompts, wants, max(args.seconds / 4, 10))
        for node in NODES:
            lan.drop(node, args.loss)
        report["lossy"] = phase(cluster, prompts, wants, args.seconds)
        for node in NODES:
            lan.heal(node)
        report["lossy"]["tokens_per_s_vs_healthy"] = round(
            report["lossy"]["tokens_per_s"] / max(report["healthy"]["tokens_per_s"], 1e-9), 3
        )
        if args.hole_s > 0:
            report["black_hole"] = black_hole(lan, cluster, prompts, wants, args.hole_s)
    for name in ("healthy", "lossy", "black_hole"):
        if name in report:
            row = {k: v for k, v in report[name].items() if k not in ("events", "errors")}
            print(f"{name:11} {row}")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
