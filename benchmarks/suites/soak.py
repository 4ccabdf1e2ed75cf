"""Suite `soak`: many requests from concurrent clients while workers and the shadow fail at random.

One local cluster (`soak.workers` workers, the shadow) serves `soak.requests` requests from
`soak.clients` client threads, each a prompt drawn from `soak.prompts` whose reference tokens are
known. Meanwhile a chaos thread, every `chaos_every_s` (random in that range), picks a worker or the
shadow that is up and kills it (restarting it after `down_s`) or freezes it (resuming it after
`down_s`); several nodes may be down at once, but a worker is taken down only while another one is
live in main's own view (a restarted or resumed worker counts as down until main has taken it
back), so every layer keeps a live holder (every worker stores every layer here). Reported:
requests lost (failed), requests whose tokens differ, faults injected, and each node's RSS growth
after `warmup_requests` (main and the nodes that lived through the whole run; a restarted node is a
new process). The picture shows throughput and RSS over time with the faults marked.
"""

from __future__ import annotations

import random
import threading
import time

import psutil

import odmoe
from odmoe.benchmarks import plots
from odmoe.benchmarks.config import BenchConfig
from odmoe.benchmarks.results import ResultsDir
from odmoe.benchmarks.workload import prompt_ids, reference_tokens
from odmoe.launch.local_cluster import ClusterStartError
from odmoe.models.checkpoint import load_tokenizer

PROMPT_TOKENS = 16


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.soak
    tokenizer = load_tokenizer(model_path)
    prompts = [prompt_ids(tokenizer, i, PROMPT_TOKENS) for i in range(suite.prompts)]
    wanted = [reference_tokens(model_path, p, suite.new_tokens) for p in prompts]
    words = [f"cluster.workers={suite.workers}", "cluster.group_size=2", *cfg.cluster.overrides]
    report = soak(model_path, words, prompts, wanted, suite)
    print(
        f"requests {report['completed']}/{suite.requests} completed, lost {report['lost']}, "
        f"tokens differ {report['differ']}, faults {len(report['events'])} "
        f"({report['kills']} kills, {report['freezes']} freezes, {report['died']} died by themselves) "
        f"in {report['seconds']:.0f} s",
        flush=True,
    )
    for name, growth in report["rss_growth"].items():
        print(
            f"  RSS {name}: {growth['warm_mib']:.0f} -> {growth['end_mib']:.0f} MiB ({growth['pct']:+.1f} %)"
        )
    out.write("soak", "soak", report)
    what = f"{suite.workers} workers (groups of 2) + shadow"
    what += f", {suite.clients} clients x {suite.new_tokens} tokens"
    plots.soak(report["samples"], report["events"], out.path("soak", "png"), what)
    return report


def soak(model_path: str, words: list[str], prompts, wanted, suite) -> dict:
    rng = random.Random(suite.seed)
    results = {"completed": 0, "lost": 0, "differ": 0, "errors": []}
    lock, stop = threading.Lock(), threading.Event()
    counter = iter(range(suite.requests))
    events, samples = [], []
    warm_rss: dict[str, float] = {}
    start = time.monotonic()
    with odmoe.LocalCluster(model_path, overrides=words) as cluster:
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

        def fail(name: str, action: str, seconds: float) -> None:
            try:
                if action == "died":
                    restart(name)
                elif action == "kill":
                    cluster.kill(name)
                    time.sleep(seconds)
                    restart(name)
                else:
                    cluster.freeze(name)
                    time.sleep(seconds)
                    cluster.resume(name)
                if name.startswith("worker"):  # down until main has taken it back
                    index, deadline = int(name.removeprefix("worker")), time.monotonic() + 60
                    while index not in live_workers() and time.monotonic() < deadline:
                        time.sleep(0.2)
            finally:
                with lock:
                    down.discard(name)

        info_lock = threading.Lock()

        def live_workers() -> list[int]:
            with info_lock:  # cluster.client is this thread's and fail()'s only
                return cluster.client.info()["live_workers"]

        def restart(name: str) -> None:
            """A new process on a new port (it announces itself); tried again if it fails to start."""
            for attempt in range(3):
                try:
                    cluster.restart(name, until_used=False)  # fail() waits for workers itself
                    return
                except ClusterStartError as exc:
                    print(f"  soak: {name} failed to restart (attempt {attempt + 1}): {exc}", flush=True)

        def chaos() -> None:
            nodes = [f"worker{i}" for i in range(suite.workers)] + ["shadow"]
            recovering = []
            while not stop.wait(rng.uniform(*suite.chaos_every_s)):
                for name in nodes:  # a node that died by itself (not ours to kill) is brought back
                    with lock:
                        dead = name not in down and cluster.node(name).process.poll() is not None
                        if dead:
                            down.add(name)
                    if dead:
                        events.append({"t_s": time.monotonic() - start, "node": name, "action": "died"})
                        recovering.append(threading.Thread(target=fail, args=(name, "died", 0.0)))
                        recovering[-1].start()
                live = live_workers()
                with lock:
                    up = [n for n in nodes if n not in down]
                    serving = [w for w in live if f"worker{w}" not in down]
                    if len(serving) < 2:  # main must keep a live worker for every layer
                        up = [n for n in up if not n.startswith("worker")]
                    if not up:
                        continue
                    name, action = rng.choice(up), rng.choice(["kill", "stop"])
                    down.add(name)
                events.append({"t_s": time.monotonic() - start, "node": name, "action": action})
                seconds = rng.uniform(*suite.down_s)
                recovering.append(threading.Thread(target=fail, args=(name, action, seconds)))
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
    return {
        **results,
        "seconds": time.monotonic() - start,
        "events": events,
        "kills": sum(e["action"] == "kill" for e in events),
        "freezes": sum(e["action"] == "stop" for e in events),
        "died": sum(e["action"] == "died" for e in events),
        "rss_growth": growth,
        "samples": samples,
    }
