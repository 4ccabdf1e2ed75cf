"""Suite `placement`: what starting the cluster through Ray costs against `role=local` (issue 17).

Needs the `ray` extra. With `placement.ray_address` empty the suite starts a Ray cluster on this
machine first (`ray.cluster_utils.Cluster`: a head plus one Ray node per odmoe node, each with its
role's custom resource, as a LAN deployment would have), timed on its own: that is Ray's cost, paid
once per machine, not per odmoe start. Each round then starts the same odmoe cluster (same model,
same words, security on) both ways, in alternating order: `LocalCluster` (processes spawned by the
launcher) and `RayCluster` (actors placed by Ray, each starting the same node program). Reported
per way: wall time from the call to every node serving, and the first request's TTFT and its
tokens (which must be identical).
"""

from __future__ import annotations

import statistics
import time

import odmoe
from odmoe.models.open_model import load_tokenizer
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.workload import prompt_ids

WAYS = ("local", "ray")


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    from odmoe.launch.ray_cluster import import_ray

    ray = import_ray()

    suite = cfg.placement
    ids = prompt_ids(load_tokenizer(model_path), 0, suite.prompt_tokens)
    words = cluster_words(cfg, f"model.path={model_path}", "server.http_port=0")
    began = time.perf_counter()
    own_ray, address = _ray_cluster(cfg) if not suite.ray_address else (None, suite.ray_address)
    ray_start_s = time.perf_counter() - began if own_ray else None
    if ray_start_s is not None:
        print(f"Ray cluster on this machine ({cfg.cluster.workers + 3} Ray nodes) up in {ray_start_s:.1f} s")
    rows: dict[str, list[dict]] = {w: [] for w in WAYS}
    try:
        ray.init(address=address, log_to_driver=False)
        ray_words = [
            f"ray.address={address}",
            "+ray.main.resources={role_main:1}",
            "+ray.shadow.resources={role_shadow:1}",
            "+ray.worker.resources={role_worker:1}",
        ]
        for rnd in range(suite.rounds):
            for way in WAYS if rnd % 2 == 0 else tuple(reversed(WAYS)):
                rows[way].append(_start_and_ask(way, words, ray_words, ids, suite.new_tokens))
                r = rows[way][-1]
                print(
                    f"round {rnd + 1} {way:<5}: start {r['start_s']:.2f} s, TTFT {r['ttft_s'] * 1e3:.0f} ms"
                )
    finally:
        ray.shutdown()
        if own_ray is not None:
            own_ray.shutdown()
    same = all(r["token_ids"] == rows["local"][0]["token_ids"] for w in WAYS for r in rows[w])
    report = {
        "rounds": suite.rounds,
        "nodes": cfg.cluster.workers + 2,
        "ray_cluster_start_s": ray_start_s,
        "ray_address": suite.ray_address or "a local multi-node Ray cluster (ray.cluster_utils)",
        "tokens_identical": same,
        "ways": {w: _summary(rows[w]) for w in WAYS},
        "rows": rows,
    }
    local, through_ray = report["ways"]["local"], report["ways"]["ray"]
    print(
        f"start-up, median of {suite.rounds}: role=local {local['start_s']:.2f} s, "
        f"role=ray {through_ray['start_s']:.2f} s ({through_ray['start_s'] - local['start_s']:+.2f} s); "
        f"tokens identical: {same}"
    )
    out.write("placement", "placement", report)
    plots.placement(report, out.path("placement", "png"), model_path.rstrip("/").split("/")[-1])
    return report


def _ray_cluster(cfg: BenchConfig):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"role_main": 1})
    cluster.add_node(num_cpus=1, resources={"role_shadow": 1})
    for _ in range(cfg.cluster.workers):
        cluster.add_node(num_cpus=1, resources={"role_worker": 1})
    cluster.wait_for_nodes()
    return cluster, cluster.address


def _start_and_ask(way: str, words: list[str], ray_words: list[str], ids: list[int], new_tokens: int) -> dict:
    from odmoe.launch.ray_cluster import RayCluster
    from odmoe.launch.settings import compose

    began = time.perf_counter()
    if way == "local":
        cluster = odmoe.LocalCluster(overrides=words)
    else:
        cluster = RayCluster(compose(["role=ray", *words, *ray_words]), [*words, *ray_words])
    try:
        cluster.start()
        start_s = time.perf_counter() - began
        asked = time.perf_counter()
        token_ids, ttft = [], None
        for piece in cluster.client.stream(ids, max_new_tokens=new_tokens):
            ttft = ttft or time.perf_counter() - asked
            token_ids.append(piece.token_id)
    finally:
        cluster.stop()
    return {"start_s": start_s, "ttft_s": ttft, "token_ids": token_ids}


def _summary(rows: list[dict]) -> dict:
    return {
        "start_s": statistics.median(r["start_s"] for r in rows),
        "start_s_all": [r["start_s"] for r in rows],
        "ttft_s": statistics.median(r["ttft_s"] for r in rows),
    }
