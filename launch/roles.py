"""What each role does once its config is known. Each returns the process exit code."""

from __future__ import annotations

import csv
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import grpc

from odmoe.config import OdmoeConfig
from odmoe.launch.local_cluster import ClusterStartError, LocalCluster, resolve_model_path
from odmoe.memory_plan import MemoryPlanError
from odmoe.models.checkpoint import CheckpointError
from odmoe.models.families import UnsupportedModelError
from odmoe.transport.security import SecurityError

log = logging.getLogger("odmoe.launch")
BAD_INPUT = 2


def _serve(name: str, node_class, cfg: OdmoeConfig) -> int:
    from odmoe.launch.pull import model_path_for
    from odmoe.models.share_pull import ShareError

    try:
        node = node_class(cfg, model_path_for(cfg, cfg.role.name))  # builds: reads, checks, loads
        node.start()  # binds its sockets
    except (CheckpointError, UnsupportedModelError, SecurityError, MemoryPlanError, ShareError) as exc:
        log.error("%s: %s", name, exc)
        return BAD_INPUT
    node.serve(cfg.node.ready_file)
    return 0


def run_worker(cfg: OdmoeConfig, overrides: list[str]) -> int:
    from odmoe.nodes.worker import WorkerNode

    return _serve(f"worker {cfg.worker.index}", WorkerNode, cfg)


def run_shadow(cfg: OdmoeConfig, overrides: list[str]) -> int:
    from odmoe.nodes.shadow import ShadowNode

    if cfg.shadow.nice:
        os.nice(cfg.shadow.nice)  # every thread the node starts from here on inherits it
    return _serve("shadow", ShadowNode, cfg)


def run_main(cfg: OdmoeConfig, overrides: list[str]) -> int:
    from odmoe.launch.join import open_door, rendezvous
    from odmoe.launch.pull import model_path_for
    from odmoe.launch.settings import compose
    from odmoe.main.remote_experts import WorkerUnavailable
    from odmoe.models.share_pull import ShareError
    from odmoe.nodes.main import MainNode, PortInUse

    try:
        model_path = model_path_for(cfg, "main")
        # the door first (the checkpoint's bytes, admission by the join link): nodes pull their
        # shares and join while main waits for them and connects
        door, admissions = open_door(cfg, overrides, model_path) if not cfg.model.pull_from else (None, None)
        if admissions is not None:
            joined = rendezvous(admissions, cfg.cluster.min_workers)
            cfg = compose(["role=main", *overrides, *joined, f"security.key_dir={admissions.keys.root}"])
        node = MainNode(cfg, model_path)
        if admissions is not None:  # boxes that join from now on are taken in while main serves
            admissions.on_ready = node.take_in
        node.start()
        node.serve(cfg.node.ready_file)
        if door is not None:
            door.stop(grace=1)
    except (
        CheckpointError,
        UnsupportedModelError,
        PortInUse,
        SecurityError,
        MemoryPlanError,
        ShareError,
    ) as exc:
        log.error("main: %s", exc)
        return BAD_INPUT
    except WorkerUnavailable as exc:
        log.error("main: %s", exc)
        return 1
    return 0


def run_plan(cfg: OdmoeConfig, overrides: list[str]) -> int:
    """Each node's memory need, loading nothing (odmoe.launch.plan)."""
    from odmoe.launch.plan import run_plan as plan

    try:
        return plan(cfg, resolve_model_path(cfg))
    except (CheckpointError, UnsupportedModelError, ValueError) as exc:
        print(f"odmoe-launch: {exc}", file=sys.stderr)
        return BAD_INPUT


def run_seed(cfg: OdmoeConfig, overrides: list[str]) -> int:
    """Serve model.path's bytes on cluster.join_port to nodes that pull their share (odmoe.launch.pull)."""
    from odmoe.launch.pull import run_seed as seed

    try:
        return seed(cfg, resolve_model_path(cfg))
    except (CheckpointError, OSError, SecurityError, ValueError) as exc:
        log.error("seed: %s", exc)
        return BAD_INPUT


def run_ray(cfg: OdmoeConfig, overrides: list[str]) -> int:
    """Place the cluster on a running Ray cluster, print where each node landed and the main
    address, relay node logs and Ray's restarts, and stop every actor on Ctrl-C."""
    from odmoe.launch.ray_cluster import RayCluster, RayUnavailable, placement_table

    try:
        cluster = RayCluster(cfg, overrides)
        cluster.start()
    except (CheckpointError, UnsupportedModelError, ValueError, RayUnavailable) as exc:
        print(f"odmoe-launch: {exc}", file=sys.stderr)
        return BAD_INPUT
    except ClusterStartError as exc:
        print(f"odmoe-launch: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"odmoe: placed on Ray in {cluster.start_s:.1f} s:", file=sys.stderr)
        print(placement_table(cluster.placement), file=sys.stderr)
        print(f"odmoe: main at {', '.join(cluster.main_addresses)} (odmoe.Client)", file=sys.stderr)
        for url in filter(None, cluster.http_urls):
            key = f" --key-dir {cluster.key_dir}" if cluster.key_dir else ""
            print(
                f"odmoe: OpenAI-compatible API at {url}/v1; try: odmoe-chat --url {url}{key}", file=sys.stderr
            )
        print("odmoe: Ctrl-C stops every node", file=sys.stderr, flush=True)
        return _watch(cluster)
    except KeyboardInterrupt:
        print("\nodmoe-launch: interrupted; stopping every node", file=sys.stderr)
        return 130
    finally:
        cluster.stop()


def _watch(cluster) -> int:
    """Say when Ray restarts a node elsewhere or one dies; end when no main is left."""
    last = {name: info["where"] for name, info in cluster.placement.items()}
    while True:
        time.sleep(2.0)
        state = cluster.watch()
        for name, now in state.items():
            seen = now if isinstance(now, str) else now["where"]
            if seen != last.get(name):
                where = seen if isinstance(now, str) else f"up on {seen} at {now['address']}"
                print(f"odmoe: {name}: {where}", file=sys.stderr, flush=True)
                last[name] = seen
        if all(state[n] == "dead" for n in state if n.startswith("main")):
            print("odmoe-launch: every main is gone; stopping the cluster", file=sys.stderr)
            return 1


def run_local(cfg: OdmoeConfig, overrides: list[str]) -> int:
    skip = ("role=", "prompt=", "max_new_tokens=", "model.path=", "serve=")
    passthrough = [w for w in overrides if not w.startswith(skip)]
    if cfg.serve:  # a fixed, documented port for people to point their clients at
        passthrough.append(f"server.http_port={cfg.server.http_port}")
    try:
        # cfg.model.path, not LocalCluster's own default: odmoe-launch's default is the demo model
        with LocalCluster(cfg.model.path, overrides=passthrough) as cluster:
            if cfg.serve:
                return _keep_serving(cluster)
            print(
                f"odmoe: {cfg.cluster.workers} workers (group size {cfg.cluster.group_size}), "
                f"model {cluster.model_path}",
                file=sys.stderr,
            )
            print(cfg.prompt, end="", flush=True)
            result = None
            for reply in cluster.client._replies(cfg.prompt, cfg.max_new_tokens):
                if reply.WhichOneof("kind") == "token":
                    print(reply.token.text, end="", flush=True)
                else:
                    result = json.loads(reply.done.stats_json)
            print()
            print(format_stats(result or {}), file=sys.stderr)
            if result is not None:
                record_result(cfg, overrides, result)
    except (CheckpointError, UnsupportedModelError, ValueError) as exc:
        print(f"odmoe-launch: {exc}", file=sys.stderr)
        return BAD_INPUT
    except ClusterStartError as exc:
        print(f"odmoe-launch: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"odmoe-launch: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return BAD_INPUT if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    except KeyboardInterrupt:  # the cluster was already stopped by LocalCluster.__exit__
        print("\nodmoe-launch: interrupted", file=sys.stderr)
        return 130
    return 0


def _keep_serving(cluster: LocalCluster) -> int:
    url = cluster.http_url if cluster.cfg.server.http else None
    print(f"odmoe: serving model {cluster.model_path}", file=sys.stderr)
    print(f"odmoe: gRPC at {cluster.address} (odmoe.Client)", file=sys.stderr)
    if url:
        name = (
            Path(cluster.model_path).name
            if not cluster.cfg.server.model_name
            else cluster.cfg.server.model_name
        )
        print(
            f"odmoe: OpenAI-compatible API at {url}/v1 (model {name!r}); try: odmoe-chat --url {url}"
            + (f" --key-dir {cluster.key_dir}" if cluster.key_dir else ""),
            file=sys.stderr,
        )
    print("odmoe: Ctrl-C stops the cluster", file=sys.stderr, flush=True)
    # Ctrl-C (and a plain kill) must stop every node even when this process was started in the
    # background by a non-interactive shell, which makes it ignore SIGINT from the start
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    while all(node.process.poll() is None for node in cluster.nodes if node.name == "main"):
        time.sleep(0.5)
    print("odmoe-launch: main exited; stopping the cluster", file=sys.stderr)
    return 1


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def format_stats(stats: dict) -> str:
    mib = 2**20
    s = {
        "new_tokens": 0,
        "prompt_tokens": 0,
        "ttft_s": 0.0,
        "decode_tokens_per_s": 0.0,
        "experts_loaded": 0,
        "bytes_loaded": 0,
        "worker_load_s": 0.0,
        "worker_compute_s": 0.0,
        "peak_rss_bytes": {},
        **stats,
    }
    rss = ", ".join(f"{k} {v / mib:.0f} MiB" for k, v in s["peak_rss_bytes"].items())
    cache = s.get("cache") or {}
    hits = cache.get("hits", 0)
    return "\n".join(
        [
            f"-- {s['new_tokens']} new tokens after {s['prompt_tokens']} prompt tokens",
            f"   TTFT {s['ttft_s'] * 1e3:.1f} ms, decode {s['decode_tokens_per_s']:.2f} tokens/s",
            f"   experts computed {s['experts_loaded']}: loaded {s['experts_loaded'] - hits:.0f} "
            f"({s['bytes_loaded'] / mib:.1f} MiB), from the workers' caches {hits:.0f} "
            f"({cache.get('bytes_saved', 0) / mib:.1f} MiB not loaded)",
            f"   worker load {s['worker_load_s'] * 1e3:.1f} ms "
            f"vs compute {s['worker_compute_s'] * 1e3:.1f} ms",
            f"   peak RSS: {rss}",
            f"   recall {_pct((s.get('recall') or {}).get('overall'))} (in time: "
            f"{_pct((s.get('timely_recall') or {}).get('overall'))}), "
            f"stall {s.get('stall_s', 0) * 1e3:.1f} ms, "
            f"reloads {s.get('reloads', 0)}",
        ]
    )


def results_path(cfg: OdmoeConfig) -> Path | None:
    """Where this run's row goes: results_file, else the sweep folder of a `-m` multirun."""
    if cfg.results_file:
        return Path(cfg.results_file)
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get() if HydraConfig.initialized() else None
    if hydra_cfg is not None and hydra_cfg.mode == RunMode.MULTIRUN:
        return Path(hydra_cfg.sweep.dir) / "results.jsonl"
    return None


SUMMARY = (
    "decode_tokens_per_s",
    "ttft_s",
    "stall_s",
    "reloads",
    "preloaded",
    "late_departure_s_mean",
    "lookahead_layers_mean",
)


def record_result(cfg: OdmoeConfig, overrides: list[str], stats: dict) -> None:
    """Append one row (config + headline figures) to results.jsonl and rewrite results.csv beside it."""
    path = results_path(cfg)
    if path is None:
        return
    row = {
        "overrides": " ".join(overrides),
        "token_period": cfg.alignment.token_period,
        "kv_period": cfg.alignment.kv_period,
        "shadow": cfg.shadow.enabled and cfg.shadow.mode,
        "precision": cfg.shadow.precision,
        "workers": cfg.cluster.workers,
        "group_size": cfg.cluster.group_size,
        "new_tokens": stats.get("new_tokens"),
        **{k: stats.get(k) for k in SUMMARY},
        "recall": (stats.get("recall") or {}).get("overall"),
        "timely_recall": (stats.get("timely_recall") or {}).get("overall"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    with path.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"odmoe: results appended to {path} (table: {path.with_suffix('.csv')})", file=sys.stderr)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.2f} %"
