"""Suite `soak`: many requests from concurrent clients while workers and the shadow fail at random.

One local cluster (`soak.workers` workers, the shadow) serves `soak.requests` requests from
`soak.clients` client threads, each a prompt drawn from `soak.prompts` whose reference tokens are
known. Meanwhile a chaos thread, every `chaos_every_s` (random in that range), picks a worker or the
shadow that is up and kills it (restarting it after `down_s`) or freezes it (resuming it after
`down_s`); several nodes may be down at once, but a worker is taken down only while at least
`keep_serving` others stay live in main's own view and untouched (a restarted or resumed worker
counts as down until main has taken it back), so every layer keeps a live holder (every worker
stores every layer here). Reported:
requests lost (failed), requests whose tokens differ, faults injected, and each node's RSS growth
after `warmup_requests` (main and the nodes that lived through the whole run; a restarted node is a
new process). The picture shows throughput and RSS over time with the faults marked.

With `soak.network` (issue 47) main reaches every worker and the shadow through a link relay
(odmoe/tools/link_relay.py), and the chaos also makes network faults on a node's links, the process
living on: a straggler (delay and jitter), a black hole (every TCP byte held, every beat dropped)
or a loss burst (TCP chunks late by retransmission timeouts, beats dropped at random). A network
fault takes its node down for the rule above too, until main has it live again. A killed node is
restarted behind its relay (retargeted to the new port; it does not announce itself, so main's
probes of the relay's address take it back), so later network faults reach it too.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections import Counter

import psutil

import odmoe
from odmoe.launch.local_cluster import ClusterStartError
from odmoe.models.open_model import load_tokenizer
from odmoe.tools.link_relay import Relay
from odmoe_bench import plots
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import prompts
from odmoe_bench.workload import reference_tokens


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.soak
    tokenizer = load_tokenizer(model_path)
    requests = prompts(tokenizer, suite.prompts, length=16)  # short: the soak is about many requests
    wanted = [reference_tokens(model_path, p, suite.new_tokens) for p in requests]
    words = [f"cluster.workers={suite.workers}", "cluster.group_size=2", *cfg.cluster.overrides]
    report = soak(model_path, words, requests, wanted, suite)
    print(summary(report, suite.requests), flush=True)
    for name, growth in report["rss_growth"].items():
        print(
            f"  RSS {name}: {growth['warm_mib']:.0f} -> {growth['end_mib']:.0f} MiB ({growth['pct']:+.1f} %)"
        )
    out.write("soak", "soak", report)
    what = f"{suite.workers} workers (groups of 2) + shadow"
    what += f", {suite.clients} clients x {suite.new_tokens} tokens"
    what += ", kills, freezes and network faults" if suite.network else ", kills and freezes"
    plots.soak(report["samples"], report["events"], out.path("soak", "png"), what)
    return report


ACTIONS = {  # what the chaos may do to a node, and how the report counts it
    "kill": "kills",
    "stop": "freezes",
    "died": "died",
    "straggle": "stragglers",
    "hole": "black_holes",
    "loss": "loss_bursts",
}


def summary(report: dict, requests: int) -> str:
    faults = ", ".join(f"{report[key]} {key.replace('_', ' ')}" for key in ACTIONS.values() if key in report)
    back, never = report["back_s_max"], len(report["never_back"])
    return (
        f"requests {report['completed']}/{requests} completed, lost {report['lost']}, "
        f"tokens differ {report['differ']}, faults {len(report['events'])} ({faults}) "
        f"in {report['seconds']:.0f} s; main declared a worker lost {report['main_lost']} times and "
        f"took one back {report['main_rejoined']} times ({report['main_left_none_live']} losses left "
        f"none live; why: {report['main_loss_reasons']}); a worker was live again at most "
        f"{'-' if back is None else f'{back:.1f}'} s after its fault ended ({never} never)"
    )


def soak(model_path: str, words: list[str], prompts, wanted, suite) -> dict:
    rng = random.Random(suite.seed)
    start = time.monotonic()
    relays: dict[str, list[Relay]] = {}  # node name -> the relays in front of it (the shadow: 2)

    def through(name: str, address: str) -> str:
        relay = Relay(address, seed=suite.seed + sum(map(len, relays.values())))
        relays.setdefault(name, []).append(relay)
        return relay.address

    cluster = odmoe.LocalCluster(model_path, overrides=words, through=through if suite.network else None)
    try:
        with cluster:
            report = _chaos_run(cluster, relays, prompts, wanted, suite, rng, start)
    finally:
        for relay in (r for rs in relays.values() for r in rs):
            relay.close()
    return report


def _chaos_run(cluster, relays: dict[str, list[Relay]], prompts, wanted, suite, rng, start) -> dict:
    results = {"completed": 0, "lost": 0, "differ": 0, "errors": []}
    lock, stop = threading.Lock(), threading.Event()
    counter = iter(range(suite.requests))
    events, samples = [], []
    warm_rss: dict[str, float] = {}
    first_pids = {n.name: n.process.pid for n in cluster.nodes}

    def client(seed: int) -> None:
        crng = random.Random(seed)
        with odmoe.Client(cluster.main_addresses, credentials=cluster.credentials) as c:
            while next(counter, None) is not None:
                i = crng.randrange(len(prompts))
                try:
                    got = c.generate(prompts[i], max_new_tokens=suite.new_tokens).token_ids
                except Exception as exc:  # counted: a lost request
                    with lock:
                        results["lost"] += 1
                        results["errors"].append(f"{type(exc).__name__}: {str(exc)[:200]}")
                    continue
                with lock:
                    results["completed"] += 1
                    results["differ"] += got != wanted[i]

    down: set[str] = set()

    def fail(name: str, action: str, seconds: float, event: dict) -> None:
        try:
            if action == "died":
                restart(name)
            elif action == "kill":
                cluster.kill(name)
                time.sleep(seconds)
                restart(name)
            elif action == "stop":
                cluster.freeze(name)
                time.sleep(seconds)
                cluster.resume(name)
            else:
                network_fault(name, action, seconds)
            if name.startswith("worker"):  # down until main has taken it back
                index, ended = int(name.removeprefix("worker")), time.monotonic()
                while not (back := index in live_workers()) and time.monotonic() < ended + 60:
                    time.sleep(0.2)
                event["back_s"] = round(time.monotonic() - ended, 2) if back else None  # after the fault
        finally:
            with lock:
                down.discard(name)

    info_lock = threading.Lock()

    def live_workers() -> list[int]:
        with info_lock:  # cluster.client is this thread's and fail()'s only
            return cluster.client.info()["live_workers"]

    def restart(name: str) -> None:
        """A new process on a new port (it announces itself; behind relays, they are retargeted and
        main's probes take it back); tried again if it fails to start."""
        for attempt in range(3):
            try:  # fail() waits for workers itself
                cluster.restart(name, until_used=False, announce=not relays)
                if name == "shadow":
                    targets = [cluster.shadow_info["address"], cluster.shadow_info["pub_address"]]
                else:
                    targets = [cluster.worker_addresses[int(name.removeprefix("worker"))]]
                for relay, target in zip(relays.get(name, []), targets, strict=False):
                    relay.retarget(target)
                return
            except ClusterStartError as exc:
                print(f"  soak: {name} failed to restart (attempt {attempt + 1}): {exc}", flush=True)

    def network_fault(name: str, action: str, seconds: float) -> None:
        """Its links slow, silent or lossy for `seconds`, then healthy again."""
        mine = relays[name]
        if action == "hole":
            for relay in mine:
                relay.black_hole(True)
        else:
            low, high = suite.straggler_delay_s if action == "straggle" else suite.loss
            value = rng.uniform(low, high)
            for relay in mine:
                if action == "straggle":
                    relay.set(delay_s=value, jitter_s=value)
                else:
                    relay.set(loss=value)
        time.sleep(seconds)
        for relay in mine:
            relay.set()
            relay.black_hole(False)

    def duration(action: str) -> float:
        if action in ("kill", "stop"):
            return rng.uniform(*suite.down_s)
        return rng.uniform(*(suite.hole_s if action == "hole" else suite.network_s))

    def chaos() -> None:
        nodes = [f"worker{i}" for i in range(suite.workers)] + ["shadow"]
        recovering = []
        kinds, bag = ["kill", "stop"] + (["straggle", "hole", "loss"] if relays else []), []
        while not stop.wait(rng.uniform(*suite.chaos_every_s)):
            for name in nodes:  # a node that died by itself (not ours to kill) is brought back
                with lock:
                    dead = name not in down and cluster.node(name).process.poll() is not None
                    if dead:
                        down.add(name)
                if dead:
                    events.append({"t_s": time.monotonic() - start, "node": name, "action": "died"})
                    recovering.append(threading.Thread(target=fail, args=(name, "died", 0.0, events[-1])))
                    recovering[-1].start()
            live = live_workers()
            with lock:
                up = [n for n in nodes if n not in down]
                serving = [w for w in live if f"worker{w}" not in down]
                if len(serving) <= suite.keep_serving:  # main must keep a live worker for every layer
                    up = [n for n in up if not n.startswith("worker")]
                if not up:
                    continue
                if not bag:  # each kind once in every len(kinds) faults, in a random order
                    bag.extend(rng.sample(kinds, len(kinds)))
                name, action = rng.choice(up), bag.pop()
                down.add(name)
            seconds = duration(action)
            events.append({"t_s": time.monotonic() - start, "node": name, "action": action, "s": seconds})
            recovering.append(threading.Thread(target=fail, args=(name, action, seconds, events[-1])))
            recovering[-1].start()
        for t in recovering:
            t.join()

    def sample() -> None:
        while not stop.wait(1.0):
            rss = {}
            for node in cluster.nodes:
                try:
                    rss[node.name] = psutil.Process(node.process.pid).memory_info().rss / 2**20
                except psutil.Error:
                    pass
            with lock:
                done = results["completed"]
            if done >= suite.warmup_requests and not warm_rss:
                warm_rss.update(rss)
            if samples and done // 50 > samples[-1]["completed"] // 50:  # progress on long runs
                print(f"  soak: {done}/{suite.requests} requests, {len(events)} faults", flush=True)
            samples.append({"t_s": time.monotonic() - start, "completed": done, "rss_mib": rss})

    threads = [threading.Thread(target=client, args=(k,)) for k in range(suite.clients)]
    helpers = [threading.Thread(target=chaos), threading.Thread(target=sample)]
    for t in threads + helpers:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    for t in helpers:
        t.join()
    survivors = {n.name for n in cluster.nodes if first_pids.get(n.name) == n.process.pid}
    end_rss = samples[-1]["rss_mib"] if samples else {}
    growth = {
        name: {
            "warm_mib": warm_rss[name],
            "end_mib": end_rss[name],
            "pct": 100 * (end_rss[name] / warm_rss[name] - 1),
        }
        for name in sorted(survivors)
        if name in warm_rss and name in end_rss
    }
    counts = {key: sum(e["action"] == action for e in events) for action, key in ACTIONS.items()}
    if not relays:
        counts = {k: v for k, v in counts.items() if k in ("kills", "freezes", "died")}
    seconds = time.monotonic() - start
    main_log = cluster.node("main").log_file.read_text(errors="replace")  # main is never taken down
    back = [e["back_s"] for e in events if e.get("back_s") is not None]
    losses = re.findall(r"^.*worker \d+ \(.*?\) lost: (.*); live: (\[.*\])$", main_log, re.M)
    return {
        **results,
        "seconds": seconds,
        "events": events,
        **counts,
        # workers main declared lost / took back (by beats, heartbeats or failed calls), and how
        # long after a fault on a worker ended main had it live again (None: not within 60 s)
        "main_lost": len(losses),
        "main_loss_reasons": dict(Counter(re.sub(r"[\d.]+", "N", why) for why, _ in losses)),
        "main_left_none_live": sum(live == "[]" for _, live in losses),
        "main_rejoined": len(re.findall(r"^.*worker \d+ \(.*\) is back", main_log, re.M)),
        "back_s_max": max(back, default=None),
        "never_back": [e for e in events if "back_s" in e and e["back_s"] is None],
        "rss_growth": growth,
        "samples": samples,
    }
