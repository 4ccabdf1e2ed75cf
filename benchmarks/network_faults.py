"""Lossy links and black holes measured on a cluster in network namespaces (benchmarks/netns_lan.py).

    python benchmarks/network_faults.py [--model tiny|DIR] [--cases loss,black_hole] [--loss 0.03]
        [--jitter-ms 20] [--seconds 120] [--hole-s 30] [--cut-s 30] [--streams 4]
        [--words failover.beat_interval_s=0 ...]

Needs root, iproute2 and iptables. Clusters of 4 workers in groups of 2 + the shadow, every node in
its own namespace, run `--streams` requests at a time, again and again. `--cases`:
- `loss` and `black_hole` share one cluster: healthy, `--seconds`/4 (at least 10 s): tokens/s;
  `loss`: every node's link losing `--loss` of its packets both ways (iptables `statistic` in each
  namespace; the client's own link is spared), `--seconds`: tokens/s, requests, how many workers
  were declared lost (false losses: every process lives); `black_hole`: worker1's link dropping
  everything for `--hole-s` (its process lives), then healed: time to detect, the longest stall of
  a stream, time from the link's return to worker1 serving again.
- `jitter_loss`, a cluster of its own: a link relay (odmoe/tools/link_relay.py: no sch_netem here)
  in front of every worker and the shadow holds each chunk and beat 0..`--jitter-ms` each way, and
  every node's link (relayed hops and the client's included) loses `--loss`, for `--seconds`;
  against the same cluster through clean relays.
- `shadow_cut`, a cluster of its own (cacheless workers, fp32 shadow): main <-> shadow drops
  everything for `--cut-s` under load: when main calls the shadow lost, and from the link's return
  until a decode iteration uses predictions again.
- `straggler`: cacheless workers, every worker's expert loads over an emulated 25 Gbit/s + 0.2 ms
  link, worker3's 10x slower (as benchmarks/stragglers.py), `--seconds` each, healthy then slow:
  tokens/s against healthy, when main steered away from worker3.
- `client_cut`, on the first cluster: a client whose own link black-holes mid-stream, until main
  cancels its request. (`odmoe-bench suite=network` runs these cases, through `measure`.)
Every request's tokens are compared with transformers' greedy generate(). `--words` are more
odmoe-launch words for the clusters (e.g. the detector before issue 47:
`failover.beat_interval_s=0 failover.heartbeat_timeout_s=1.0`). Prints the figures and writes JSON
(benchmarks/results/network-faults.json).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import threading
import time

import httpx
from transformers import AutoConfig

import odmoe
from odmoe.launch.local_cluster import NodePlacement
from odmoe.models.open_model import load_tokenizer
from odmoe.tools.link_relay import Relay
from odmoe.tools.model_names import resolve_model
from odmoe.transport.security import TLS_NAME
from odmoe_bench.cluster_runs import link_words
from odmoe_bench.netns_lan import BRIDGE_ADDRESS, Lan
from odmoe_bench.results import RESULTS, write_report
from odmoe_bench.workload import prompt_ids, reference_tokens

WORKERS = 4
NODES = ["main", "shadow", *[f"worker{i}" for i in range(WORKERS)]]
NEW_TOKENS = 48
CASES = ("loss", "black_hole", "client_cut", "jitter_loss", "shadow_cut", "straggler")


class Load:
    """`streams` clients, each streaming requests back to back until `stop`: tokens checked
    against the reference, arrival times kept. `watch`: the clients ask with generate() instead
    (whose stats carry each decode iteration's recall) and keep per request its wall start and
    stats, so an iteration's time can be read back (`predicted_again`)."""

    def __init__(self, cluster, prompts: list[list[int]], wants: list[list[int]], watch: bool = False):
        self.cluster, self.prompts, self.wants, self.watch = cluster, prompts, wants, watch
        self.times: list[list[float]] = []
        self.runs: list[tuple[float, dict]] = []
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
            times, got, start = [], [], time.time()
            try:
                if self.watch:
                    result = self.cluster.client.generate(self.prompts[i], max_new_tokens=NEW_TOKENS)
                    self.runs.append((start, result.stats))
                    got = result.token_ids
                else:
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

    def predicted_again(self, since: float) -> float | None:
        """With `watch`: the wall time of the first decode iteration after `since` that used
        predictions (recall above 0), interpolated within its request (start + TTFT + the decode
        seconds shared evenly over its iterations); None if none did."""
        for start, stats in self.runs:
            per_token = {int(n): r for n, r in stats["recall"]["per_token"].items()}
            n_max = max(per_token, default=0)
            first = start + stats["ttft_s"]
            step = stats["decode"]["seconds"] / max(n_max, 1)
            for n in sorted(per_token):
                at = first + n * step
                if at >= since and per_token[n] > 0:
                    return at
        return None


def _figures(took: float, since: float, *loads: Load) -> dict:
    """What a case reports of its loads over `took` seconds: the longest stall of a stream after
    `since`, requests, tokens (and per second), requests whose tokens differ, requests lost."""
    tokens = sum(load.tokens for load in loads)
    return {
        "longest_stall_s": round(max(load.longest_stall_s(since) for load in loads), 3),
        "requests": sum(load.requests for load in loads),
        "tokens": tokens,
        "tokens_per_s": round(tokens / took, 2),
        "different": sum(load.different for load in loads),
        "lost_requests": sum(len(load.errors) for load in loads),
    }


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
        **_figures(took, start, load),
        "errors": load.errors[:3],
        "workers_declared_lost": sum(e["event"] == "lost" for e in _events(cluster, wall)),
        "events": _events(cluster, wall),
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
        **_figures(took, start, load),
    }


class Relays:
    """A link relay (odmoe/tools/link_relay.py) in front of every worker and the shadow, listening
    on the bridge's address so the nodes' namespaces reach it: pass `through` to LocalCluster.
    Every link main has then runs through one (main <-> worker, main <-> shadow, and the shadow's
    predictions to the workers, whose address main hands them), and `set` jitters them all."""

    def __init__(self) -> None:
        self.relays: list[Relay] = []

    def through(self, name: str, address: str) -> str:
        relay = Relay(address, host=BRIDGE_ADDRESS, seed=len(self.relays))
        self.relays.append(relay)
        return relay.address

    def set(self, delay_s: float = 0.0, jitter_s: float = 0.0) -> None:
        for relay in self.relays:
            relay.set(delay_s=delay_s, jitter_s=jitter_s)

    def close(self) -> None:
        for relay in self.relays:
            relay.close()


def healthy_seconds(seconds: float) -> float:
    """How long a healthy baseline runs beside a case of `seconds`: a quarter, 10 to 60 s."""
    return min(max(seconds / 4, 10), 60)


def jitter_and_loss(lan: Lan, path: str, words: list[str], prompts, wants, loss: float, jitter_s: float,
                    seconds: float) -> dict:  # fmt: skip
    """A cluster of its own whose every link both jitters and loses packets, under load.

    Jitter: a relay in front of every worker and the shadow holds each chunk and beat a uniformly
    random 0..`jitter_s` each way (no sch_netem here). Loss: every node's link drops `loss` of its
    packets both ways (iptables), its relayed traffic included (`Lan.drop(bridge=True)`: the relays
    listen on the bridge's address), so the client's link to main is lossy too. The baseline is the
    same cluster through the same relays, clean, for `healthy_seconds`; the faulty phase `seconds`."""
    relays = Relays()
    try:
        with odmoe.LocalCluster(
            path, overrides=words, place=lan.placement, through=relays.through
        ) as cluster:
            cluster.client.generate(prompts[0], max_new_tokens=4)  # warm
            healthy = phase(cluster, prompts, wants, healthy_seconds(seconds))
            relays.set(jitter_s=jitter_s)
            for node in lan.nodes:
                lan.drop(node, loss, bridge=True)
            try:
                faulty = phase(cluster, prompts, wants, seconds)
            finally:
                for node in lan.nodes:
                    lan.heal(node)
    finally:
        relays.close()
    faulty["healthy_tokens_per_s"] = healthy["tokens_per_s"]
    faulty["tokens_per_s_vs_healthy"] = round(faulty["tokens_per_s"] / max(healthy["tokens_per_s"], 1e-9), 3)
    return {"healthy": healthy, "jitter_loss": faulty, "loss": loss, "jitter_s": jitter_s}


def _log_times(cluster, node: str, pattern: str) -> list[float]:
    """Wall-clock times of the lines of `node`'s log matching `pattern` (logging's asctime: local)."""
    text = cluster.node(node).log_file.read_text(errors="replace")
    stamps = re.findall(rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) .*{pattern}", text, re.M)
    return [datetime.datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f").timestamp() for t in stamps]


def shadow_cut(lan: Lan, path: str, words: list[str], prompts, wants, cut_s: float) -> dict:
    """A cluster of its own (cacheless workers, so every expert waits on a prediction or a load
    after routing; an fp32 shadow, so a prediction that arrives is right): main <-> shadow alone
    drops everything for `cut_s` under load (main still reaches the workers, the shadow too), then
    heals. Detect: main's log calls the shadow lost; recover: from the link's return to the first
    decode iteration of the watched client that used predictions again."""
    words = [*words, "worker.cache=0", "shadow.precision=fp32"]
    with odmoe.LocalCluster(path, overrides=words, place=lan.placement) as cluster:
        cluster.client.generate(prompts[0], max_new_tokens=4)  # warm
        healthy = phase(cluster, prompts, wants, 10)
        load, watched = (
            Load(cluster, prompts[1:], wants[1:]),
            Load(cluster, prompts[:1], wants[:1], watch=True),
        )
        start = time.monotonic()
        time.sleep(5)
        cut = time.time()
        lan.drop("shadow", peer="main")
        time.sleep(cut_s)
        healed = time.time()
        lan.heal("shadow")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and watched.predicted_again(healed) is None:
            time.sleep(0.2)
        time.sleep(3)
        load.stop()
        watched.stop()
        took = time.monotonic() - start
        lost = [t for t in _log_times(cluster, "main", r"shadow \(.*\) lost") if t >= cut]
        back = [t for t in _log_times(cluster, "main", r"shadow \(.*\) answers beats again") if t >= healed]
        again = watched.predicted_again(healed)
        events = _events(cluster, cut)
    return {
        "cut_s": cut_s,
        "detect_s": round(lost[0] - cut, 3) if lost else None,
        "detected_by": "main's beats to the shadow" if lost else None,
        "beats_answered_again_s": round(back[0] - healed, 3) if back else None,
        "serving_again_s": None if again is None else round(again - healed, 3),
        **_figures(took, start, load, watched),
        "healthy_tokens_per_s": healthy["tokens_per_s"],
        "workers_declared_lost": sum(e["event"] == "lost" for e in events),
    }


def straggler(lan: Lan, path: str, words: list[str], prompts, wants, seconds: float, slower: float = 10.0,
              bandwidth_gbps: float = 25.0, latency_ms: float = 0.2) -> dict:  # fmt: skip
    """One worker of four on a `slower`x slower link, as benchmarks/stragglers.py makes it:
    cacheless workers (`worker.cache=0`: steering applies to them), every worker's expert loads over
    an emulated link (`emulation.link`), worker3's alone `slower` times slower in rate and latency;
    main steers (`failover.steer_stragglers`, the default). Two clusters in the namespaces, healthy
    then worker3 slow, each under load for `seconds`. Detect: from the load's start to main's log
    naming worker3 a straggler. Recover: none (its link stays slow)."""
    words = [*words, "worker.cache=0", *link_words(bandwidth_gbps, latency_ms)]
    slow = link_words(bandwidth_gbps / slower, latency_ms * slower)

    def run(slow_words: list[str]) -> dict:
        def place(name: str) -> NodePlacement:
            at = lan.placement(name)
            return NodePlacement(
                prefix=at.prefix, words=[*at.words, *(slow_words if name == "worker3" else [])]
            )

        with odmoe.LocalCluster(path, overrides=words, place=place) as cluster:
            cluster.client.generate(prompts[0], max_new_tokens=4)  # warm
            start = time.time()
            measured = phase(cluster, prompts, wants, seconds)
            steered = [t for t in _log_times(cluster, "main", r"stragglers now \[3\]") if t >= start]
        measured["steered_after_s"] = round(steered[0] - start, 3) if steered else None
        return measured

    healthy, slowed = run([]), run(slow)
    slowed["healthy_tokens_per_s"] = healthy["tokens_per_s"]
    slowed["tokens_per_s_vs_healthy"] = round(slowed["tokens_per_s"] / max(healthy["tokens_per_s"], 1e-9), 3)
    slowed["detect_s"] = slowed.pop("steered_after_s")
    slowed["detected_by"] = "main's straggler watch" if slowed["detect_s"] is not None else None
    slowed["serving_again_s"] = None
    return {"healthy": healthy, "straggler": slowed, "slower": slower}


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
        **_figures(took, holed, load),
        "tokens": load.tokens + len(first),  # the cut request's first tokens too (not in tokens/s)
        "different": load.different + (first != wants[0][:3]),
    }


def measure(lan: Lan, path: str, words: list[str], prompts, wants, cases, loss: float, seconds: float,
            hole_s: float = 30, jitter_ms: float = 20, cut_s: float = 30, straggler_s: float | None = None,
            slower: float = 10.0) -> dict:  # fmt: skip
    """Each case of `cases` (CASES, "healthy" alone: the first cluster's baseline) on the namespaces of
    `lan`, measured under load, by report key: healthy, lossy, black_hole and client_cut share one
    cluster; healthy_relayed and jitter_loss, shadow_cut, healthy_cacheless and straggler their own."""
    report: dict = {}
    if {"healthy", "loss", "black_hole", "client_cut"} & set(cases):
        with odmoe.LocalCluster(path, overrides=words, place=lan.placement) as cluster:
            cluster.client.generate(prompts[0], max_new_tokens=4)  # warm
            healthy = report["healthy"] = phase(cluster, prompts, wants, max(seconds / 4, 10))
            if "loss" in cases:
                for node in lan.nodes:
                    lan.drop(node, loss)
                lossy = report["lossy"] = phase(cluster, prompts, wants, seconds)
                for node in lan.nodes:
                    lan.heal(node)
                lossy["tokens_per_s_vs_healthy"] = round(
                    lossy["tokens_per_s"] / max(healthy["tokens_per_s"], 1e-9), 3
                )
            if "black_hole" in cases:
                report["black_hole"] = black_hole(lan, cluster, prompts, wants, hole_s)
            if "client_cut" in cases:
                context = AutoConfig.from_pretrained(path).max_position_embeddings
                report["client_cut"] = client_cut(cluster, prompts, wants, context)
    if "jitter_loss" in cases:
        both = jitter_and_loss(lan, path, words, prompts, wants, loss, jitter_ms / 1e3, seconds)
        report["healthy_relayed"], report["jitter_loss"] = both["healthy"], both["jitter_loss"]
        report["jitter_loss"]["jitter_s"] = both["jitter_s"]
    if "shadow_cut" in cases:
        report["shadow_cut"] = shadow_cut(lan, path, words, prompts, wants, cut_s)
    if "straggler" in cases:
        both = straggler(lan, path, words, prompts, wants, straggler_s or seconds, slower)
        report["healthy_cacheless"], report["straggler"] = both["healthy"], both["straggler"]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--cases", default="loss,black_hole", help=f"some of {','.join(CASES)}")
    parser.add_argument("--loss", type=float, default=0.03, help="share of packets each node's link drops")
    parser.add_argument("--jitter-ms", type=float, default=20, help="jitter_loss: each hop's 0..J ms")
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--hole-s", type=float, default=30)
    parser.add_argument("--cut-s", type=float, default=30, help="shadow_cut: main <-> shadow cut this long")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--words", nargs="*", default=[])
    parser.add_argument("--out", default=str(RESULTS / "network-faults.json"))
    args = parser.parse_args()
    cases = args.cases.split(",")
    if bad := set(cases) - set(CASES):
        raise SystemExit(f"network_faults: unknown cases {sorted(bad)} (known: {', '.join(CASES)})")
    if why := missing():
        raise SystemExit(f"network_faults: {why}")
    path = resolve_model(args.model)
    prompts = [prompt_ids(load_tokenizer(path), i, 16) for i in range(args.streams)]
    wants = [reference_tokens(path, p, NEW_TOKENS) for p in prompts]
    report: dict = {"model": path, "loss_per_link": args.loss, "words": args.words, "streams": args.streams}
    words = [f"cluster.workers={WORKERS}", "cluster.group_size=2", *args.words]
    with Lan(NODES, 1.0, 0.1) as lan:
        measured = measure(lan, path, words, prompts, wants, cases, args.loss, args.seconds, args.hole_s,
                           args.jitter_ms, args.cut_s)  # fmt: skip
    for name, row in measured.items():
        print(f"{name:11} { {k: v for k, v in row.items() if k not in ('events', 'errors')} }", flush=True)
    write_report(args.out, {**report, **measured})


if __name__ == "__main__":
    main()
