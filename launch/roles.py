"""What each role does once its config is known. Each returns the process exit code."""

from __future__ import annotations

import json
import logging
import sys

import grpc
from odmoe.launch.local_cluster import ClusterStartError, LocalCluster, resolve_model_path

from odmoe.checkpoint import CheckpointError
from odmoe.config import OdmoeConfig
from odmoe.families import UnsupportedModelError

log = logging.getLogger("odmoe.launch")
BAD_INPUT = 2


def run_worker(cfg: OdmoeConfig, overrides: list[str]) -> int:
    from odmoe.nodes.worker import WorkerNode

    try:
        node = WorkerNode(cfg, resolve_model_path(cfg))
    except (CheckpointError, UnsupportedModelError) as exc:
        log.error("worker %d: %s", cfg.worker.index, exc)
        return BAD_INPUT
    node.serve(cfg.ready_file)
    return 0


def run_shadow(cfg: OdmoeConfig, overrides: list[str]) -> int:
    from odmoe.nodes.shadow import ShadowNode

    try:
        node = ShadowNode(cfg, resolve_model_path(cfg))
    except (CheckpointError, UnsupportedModelError) as exc:
        log.error("shadow: %s", exc)
        return BAD_INPUT
    node.serve(cfg.ready_file)
    return 0


def run_main(cfg: OdmoeConfig, overrides: list[str]) -> int:
    from odmoe.nodes.main import MainNode, PortInUse

    from odmoe.remote_experts import WorkerUnavailable

    try:
        node = MainNode(cfg, resolve_model_path(cfg))
        node.serve(cfg.ready_file)
    except (CheckpointError, UnsupportedModelError, PortInUse) as exc:
        log.error("main: %s", exc)
        return BAD_INPUT
    except WorkerUnavailable as exc:
        log.error("main: %s", exc)
        return 1
    return 0


def run_local(cfg: OdmoeConfig, overrides: list[str]) -> int:
    passthrough = [w for w in overrides if not w.startswith(("role=", "prompt=", "max_new_tokens="))]
    try:
        with LocalCluster(overrides=passthrough) as cluster:
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
    return "\n".join(
        [
            f"-- {s['new_tokens']} new tokens after {s['prompt_tokens']} prompt tokens",
            f"   TTFT {s['ttft_s'] * 1e3:.1f} ms, decode {s['decode_tokens_per_s']:.2f} tokens/s",
            f"   experts loaded {s['experts_loaded']} ({s['bytes_loaded'] / mib:.1f} MiB), "
            f"worker load {s['worker_load_s'] * 1e3:.1f} ms vs compute {s['worker_compute_s'] * 1e3:.1f} ms",
            f"   peak RSS: {rss}",
        ]
    )
