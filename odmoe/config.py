"""Typed configuration: the schema Hydra fills (launch/ reads YAML; nothing else here imports Hydra).

Every knob a user can set on the command line (`cluster.workers=4`) or in `LocalCluster(overrides=...)`
is a field below; `validate` turns bad combinations into one readable error before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from odmoe.placement import Topology

ROLES = ("local", "main", "worker")


@dataclass
class RoleConfig:
    name: str = "local"


@dataclass
class ModelConfig:
    path: str | None = None  # None: a small model created on first use under cache_dir
    dtype: str = "auto"  # "auto" = as saved, like from_pretrained; or float32 / bfloat16 / float16
    cache_dir: str | None = None  # default ~/.cache/odmoe/models


@dataclass
class ClusterConfig:
    workers: int = 2
    group_size: int = 2
    host: str = "127.0.0.1"  # where main's gRPC server and the workers bind
    main_port: int = 0  # 0: any free port (the local launcher learns it from the ready file)
    worker_port: int = 0  # role=worker: port this worker binds (0: any free port)
    # LAN use: main connects to these, index i = worker i ("tcp://10.0.0.7:5600"); filled by the
    # local launcher with the ports its workers bound.
    worker_addresses: list[str] = field(default_factory=list)
    main_address: str = ""  # clients: "host:port" of main's gRPC server
    # Intra-op threads per node process (0: torch's default). Nodes sharing one machine's cores must
    # not each spin a full thread pool: on 2 cores that made decoding 4-5x slower.
    torch_threads: int = 0


@dataclass
class WorkerConfig:
    index: int = 0  # role=worker: which worker this is (decides its group)
    device: str = "auto"  # "auto": cuda when present, else cpu
    slots: int = 2  # experts a worker may hold on the device at once (one computing, one loading)
    only_own_layers: bool = False  # store only the layers of this worker's group (less memory)
    ready_timeout_s: float = 120.0  # how long the launcher waits for a node to come up
    reply_timeout_s: float = 60.0  # how long main waits for one expert result


@dataclass
class OdmoeConfig:
    role: RoleConfig = field(default_factory=RoleConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    prompt: str = "def fibonacci(n):"
    max_new_tokens: int = 32
    ready_file: str | None = None  # a node writes {"address": ...} here once it serves
    log_level: str = "INFO"

    @property
    def topology(self) -> Topology:
        return Topology(self.cluster.workers, self.cluster.group_size)


def validate(cfg: OdmoeConfig) -> None:
    if cfg.role.name not in ROLES:
        raise ValueError(f"role={cfg.role.name!r} is not one of {ROLES}")
    Topology(cfg.cluster.workers, cfg.cluster.group_size)  # raises on a workers/group_size mismatch
    if cfg.worker.slots < 1:
        raise ValueError(f"worker.slots must be at least 1, got {cfg.worker.slots}")
    if cfg.role.name == "worker" and not 0 <= cfg.worker.index < cfg.cluster.workers:
        raise ValueError(f"worker.index={cfg.worker.index} is outside 0..{cfg.cluster.workers - 1}")
    if cfg.role.name == "main" and len(cfg.cluster.worker_addresses) != cfg.cluster.workers:
        raise ValueError(
            f"role=main needs cluster.worker_addresses with {cfg.cluster.workers} entries, "
            f"got {len(cfg.cluster.worker_addresses)}"
        )
    if cfg.role.name == "local":
        if not cfg.prompt:
            raise ValueError("prompt is empty")
        if cfg.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {cfg.max_new_tokens}")
