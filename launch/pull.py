"""Where a node's checkpoint comes from: model.path on this box, or its share pulled from another.

Contract:
- `model_path_for(cfg, role)`: with `model.pull_from` empty, `resolve_model_path(cfg)`; else this
  role's share of the source's checkpoint pulled into `model.pull_dir` (odmoe.models.share_pull) and
  that directory (of a GGUF model, its first shard there: sparse, like a safetensors file's copy):
  a worker the experts of the layers it stores (odmoe.placement's `stored_layers`: its group's with
  worker.only_own_layers, else all), main the non-expert tensors, the shadow every tensor (it
  computes the whole model at its own precision).
- `serve_checkpoint(cfg, model_path)` starts the Share service on `cluster.join_port` (None when
  -1), with the cluster's TLS and token; `run_seed` serves until SIGINT/SIGTERM, writing its address
  to the ready file.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
from pathlib import Path

from odmoe.config import OdmoeConfig
from odmoe.launch.local_cluster import resolve_model_path
from odmoe.models.checkpoint_index import CheckpointIndex, build_index
from odmoe.models.families import is_expert_key, layer_of_key
from odmoe.models.gguf_checkpoint import GgufCheckpoint
from odmoe.models.open_model import open_checkpoint
from odmoe.models.share_pull import PullReport, pull_share
from odmoe.nodes.ready import announce_ready
from odmoe.rpc import odmoe_pb2_grpc
from odmoe.transport.security import ClientCredentials, ServerSecrets, grpc_channel
from odmoe.transport.share_server import serve_share

log = logging.getLogger("odmoe.launch.pull")
_CHANNEL = [("grpc.max_receive_message_length", 64 << 20)]


def _cache_root(cfg: OdmoeConfig) -> Path:
    return Path(cfg.model.cache_dir or "~/.cache/odmoe/models").expanduser().parent


def pull_dir(cfg: OdmoeConfig) -> Path:
    if cfg.model.pull_dir:
        return Path(cfg.model.pull_dir).expanduser()
    return _cache_root(cfg) / "pulled" / re.sub(r"[^A-Za-z0-9.-]", "_", cfg.model.pull_from)


def choose_for(cfg: OdmoeConfig, role: str):
    """The tensors `role` needs, by their names in the files (module contract)."""

    def choose(index: CheckpointIndex, dest: Path) -> set[str]:
        if role == "shadow":
            return {t.name for t in index.tensors}
        checkpoint = open_checkpoint(pulled_model(dest))  # the headers are there: nothing read but them
        keys = list(checkpoint.weight_map)
        if role == "worker":
            topology = cfg.topology.for_model(checkpoint.moe_layers, checkpoint.num_experts)
            layers = set(topology.stored_layers(cfg.worker.index, checkpoint.moe_layers))
            keys = [k for k in keys if is_expert_key(k) and layer_of_key(k) in layers]
        else:
            keys = [k for k in keys if not is_expert_key(k)]
        if isinstance(checkpoint, GgufCheckpoint):  # a key's tensors in the file, by their names there
            return {name for k in keys for name in checkpoint.file_tensors(k)}
        return {checkpoint.disk_key.get(k, k) for k in keys}

    return choose


def pull_sources(cfg: OdmoeConfig) -> list[str]:
    """model.pull_from's addresses, in the order they are asked ("a:1,b:2": main, then a seed)."""
    return [a.strip() for a in cfg.model.pull_from.split(",") if a.strip()]


def pulled_model(dest: Path) -> Path:
    """What a pulled copy serves: a GGUF set's first shard where it holds one, else the directory."""
    ggufs = sorted(dest.glob("*.gguf"))
    if not ggufs:
        return dest
    return next((f for f in ggufs if "-00001-of-" in f.name), ggufs[0])


def pull_for(cfg: OdmoeConfig, role: str) -> tuple[Path, PullReport]:
    dest = pull_dir(cfg)
    credentials = ClientCredentials.from_key_dir(cfg.security.key_dir) if cfg.security.enabled else None
    log.info("%s: pulling its share of %s's checkpoint into %s", role, cfg.model.pull_from, dest)
    with contextlib.ExitStack() as stack:
        stubs = [
            odmoe_pb2_grpc.ShareStub(stack.enter_context(grpc_channel(address, credentials, _CHANNEL)))
            for address in pull_sources(cfg)
        ]
        report = pull_share(
            stubs,
            dest,
            choose_for(cfg, role),
            rate_bytes_s=cfg.model.pull_rate_mbps * 1e6 / 8,
            metadata=credentials.metadata if credentials else None,
        )
    return dest, report


def model_path_for(cfg: OdmoeConfig, role: str) -> str:
    if not cfg.model.pull_from:
        return resolve_model_path(cfg)
    dest, _ = pull_for(cfg, role)
    return str(pulled_model(dest))


def serve_checkpoint(
    cfg: OdmoeConfig,
    model_path: str,
    secrets: ServerSecrets | None = None,
    also=None,
    token_check=None,
):
    """(server, bound port, servicer) of the Share service on cluster.join_port, None when -1;
    `secrets` default to security.key_dir's; `also` / `token_check` as odmoe.transport.share_server's."""
    if cfg.cluster.join_port < 0:
        return None
    index = build_index(model_path, _cache_root(cfg) / "share-index")  # a GGUF file: its shards alone
    if secrets is None and cfg.security.enabled:
        secrets = ServerSecrets.from_key_dir(cfg.security.key_dir)
    return serve_share(
        Path(model_path).parent if Path(model_path).is_file() else model_path,
        index,
        cfg.cluster.host,
        cfg.cluster.join_port,
        secrets,
        also=also,
        token_check=token_check,
    )


def run_seed(cfg: OdmoeConfig, model_path: str) -> int:
    if cfg.cluster.join_port < 0:
        raise ValueError("role=seed needs cluster.join_port (0: any free port)")
    served = serve_checkpoint(cfg, model_path)
    assert served is not None
    server, port, servicer = served
    address = f"{cfg.cluster.host}:{port}"
    announce_ready(cfg.node.ready_file, role="seed", share_address=address)
    print(f"odmoe: serving {model_path}'s bytes on {address} (model.pull_from={address})", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    log.info("seed sent %.1f MiB", servicer.bytes_sent / 2**20)
    server.stop(grace=1).wait()
    return 0
