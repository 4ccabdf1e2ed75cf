"""Typed configuration: the schema Hydra fills (launch/ reads YAML; nothing else here imports Hydra).

Every knob a user can set on the command line (`cluster.workers=4`) or in `LocalCluster(overrides=...)`
is a field below; `validate` turns bad combinations into one readable error before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from odmoe.alignment import make_plan
from odmoe.miss_policy import MissConfig
from odmoe.placement import Topology
from odmoe.speculation import Speculation

ROLES = ("local", "main", "worker", "shadow", "ray")


@dataclass
class RoleConfig:
    name: str = "local"


@dataclass
class ModelConfig:
    path: str | None = None  # a directory, or demo / tiny / trained / trained_deepseek (None: tiny)
    dtype: str = "auto"  # "auto" = as saved, like from_pretrained; or float32 / bfloat16 / float16
    cache_dir: str | None = None  # default ~/.cache/odmoe/models
    # Where main computes (embeddings, attention + KV cache, routers, shared experts, lm_head):
    # cpu | cuda | cuda:<i>. The shadow's is shadow.device, each worker's worker.device.
    device: str = "cpu"


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
    # "host:port" of every main's gRPC server (the active one and standbys). A worker or shadow
    # that (re)starts announces itself to each (so a node restarted on a new port is taken back);
    # clients take the same list and fail over along it.
    main_addresses: list[str] = field(default_factory=list)
    shadow_port: int = 0  # role=shadow: control port (main -> shadow); the prediction port is +1 if set
    shadow_address: str = ""  # main connects here to align the shadow ("tcp://host:port")
    shadow_pub_address: str = ""  # predictions are published here; main and workers subscribe
    # Intra-op threads per node process (0: torch's default). Nodes sharing one machine's cores must
    # not each spin a full thread pool: on 2 cores that made decoding 4-5x slower.
    torch_threads: int = 0
    # Where this node runs, as its launcher names it (role=ray: the Ray node and its IP). Only shown:
    # main's Info lists every node's (a worker's from its Pong, the shadow's from its start or Join).
    where: str = ""
    shadow_where: str = ""  # role=main: the shadow's `where` at start (a rejoining shadow says its own)
    # CPUs this node process may run on (set at start with sched_setaffinity); []: any. On a box of
    # its own a node needs none; nodes sharing a machine's cores can be kept off each other's.
    cpus: list[int] = field(default_factory=list)
    # role=local: worker i runs on the i-th of the launcher's CPUs (mod their count), main and the
    # shadow anywhere. Without it the kernel wakes a layer's workers next to each other on one core
    # and the second computes only after the first (dataplane suite: ~100 µs a decode layer on 2 cores).
    spread_workers: bool = False


@dataclass
class LinkConfig:
    bandwidth_gbps: float = 0.0  # emulated host->device link for expert loads (0 with latency 0: off)
    latency_ms: float = 0.0


@dataclass
class WorkerConfig:
    index: int = 0  # role=worker: which worker this is (decides its group)
    # "auto": cuda when present, else cpu; or cpu | cuda | cuda:<i>. On CUDA the experts rest in pinned
    # host memory and load by asynchronous copies on the worker's own stream (odmoe.device_slots).
    device: str = "auto"
    slots: int = 2  # experts a worker may hold on the device at once (one computing, one loading)
    only_own_layers: bool = False  # store only the layers of this worker's group (less memory)
    # With only_own_layers: each layer is stored by this many groups (its own + the next R-1), so the
    # loss of a whole group is survived when R >= 2. Ignored otherwise (every worker stores every layer).
    replicas: int = 1
    # Benchmark baseline, not OD-MoE: keep every expert on the device (no loads): the cost of being
    # cacheless, isolated. Predictions are then ignored.
    resident: bool = False
    ready_timeout_s: float = 120.0  # how long the launcher waits for a node to come up
    # Per-call deadline: a worker alive by heartbeat that has not answered a call for this long (a
    # frozen process) is counted as lost and its calls re-sent. Loads over a slow link must fit in it.
    reply_timeout_s: float = 60.0
    link: LinkConfig = field(default_factory=LinkConfig)
    # Where experts rest (odmoe.expert_store): memory (decompressed in host memory) | compressed
    # (lossless: entropy-coded exponents + raw sign/mantissa, in host memory) | disk (read on each load:
    # the pack file when there is one, else the checkpoint's safetensors).
    store: str = "memory"
    # Bound on expert bytes held in host memory, e.g. "512MiB" or 1073741824 ("" or 0: no bound);
    # experts beyond it are read from disk on each load.
    host_memory: str = ""
    pack_dir: str = ""  # where odmoe-pack wrote its file ("": MODEL/odmoe-pack)
    decompress_threads: int = 2  # thread pool that decompresses a compressed expert's chunks
    # Experts kept on the device after use (odmoe.expert_cache): 0 (cacheless, the paper's), a size
    # ("6GiB"), all (every expert this worker is home for) or auto (free device memory less a margin,
    # at most all). Any value keeps tokens identical; it changes which bytes are loaded again.
    # auto is the default (the fastest exact setting: suite=cache); preset=paper sets 0.
    cache: str = "auto"
    cache_policy: str = "prediction"  # which cached expert leaves: prediction (shadow-steered) | lru
    # prediction's prior rate of use per expert, before this worker has seen traffic: odmoe-profile's
    # file ("": MODEL/odmoe-profile/profile.npz when the model has one; "off": online counts only)
    cache_profile: str = ""


SHADOW_MODES = ("emulate", "random")


@dataclass
class PrefillConfig:
    mini_batch: int = 0  # tokens per message of one expert's prompt batch (0: the whole batch at once)
    # While other requests decode, a new prompt of T tokens prefills over ~T / chunk_tokens decode
    # iterations, a share of its MoE layers each, so running streams wait for at most that share
    # (0: a whole prompt in one iteration). Cut between layers, not tokens: bit-exact either way.
    chunk_tokens: int = 0
    placement: str = "modulo"  # modulo (expert e on worker e mod N) | balanced (by token count)
    # Compute each mini-batch as it arrives. Faster, but NOT bit-exact (a matmul's rows depend on
    # how many rows it sees), so off by default: odmoe's output must equal the reference's.
    compute_per_mini_batch: bool = False


@dataclass
class ShadowConfig:
    enabled: bool = True
    mode: str = "emulate"  # emulate: a copy of the model predicts; random: random experts (case 5)
    precision: str = "fp32"  # fp32 / bf16 / fp16 / int8 / nf4 (bitsandbytes) / int8_dynamic (fast CPU int8)
    device: str = "cpu"  # cpu | cuda | cuda:<i> (bitsandbytes int8/nf4 are meant for cuda)
    inject_wrong: float = 0.0  # fault injection: this fraction of predicted experts is made wrong
    inject_wrong_token: float = 0.0  # fault injection: this fraction of the shadow's own tokens is made wrong
    # hedged prefetch (odmoe.hedging): also preload the (k+1)-th expert when its router score is within
    # this of the k-th's (0: off); it needs a spare slot (worker.slots above what lookahead fills)
    hedge_margin: float = 0.0
    seed: int = 0
    # Scheduling priority of the shadow process (an os.nice increment, 0..19). On cores it shares
    # with main and the workers, a niced shadow runs on the time they leave idle (main waiting on
    # workers, workers waiting on main) instead of taking it from them; on a box of its own it is moot.
    nice: int = 0


@dataclass
class AlignmentConfig:
    token_period: int = 1  # every P-th decode iteration the shadow takes main's token (0: never)
    kv_period: int = 1  # every Q-th iteration it overwrites its newest K/V rows with main's (0: never)
    prefill_kv: bool = False  # also hand the shadow main's prompt K/V before the first decode iteration
    # wait: the shadow waits for main's data at aligned iterations (the paper); speculative: it never
    # waits, rolls back where main's token differs, and stays at most max_ahead iterations ahead.
    # speculative is the default (timely recall 0.994 against wait's 0.80: suite=lookahead);
    # preset=paper sets wait.
    mode: str = "speculative"
    max_ahead: int = 2
    # tune: main adapts both periods per request (odmoe.alignment.PeriodTuner): +1 after grow_after
    # windows whose wrong predictions stay within tolerance, halved after one that does not
    tune: bool = False
    min_period: int = 1
    max_period: int = 16
    tolerance: float = 0.02
    grow_after: int = 2


@dataclass
class FailoverConfig:
    heartbeat_interval_s: float = 0.2  # ZeroMQ heartbeat on main's connections to workers and shadow
    heartbeat_timeout_s: float = 1.0  # no traffic this long after a heartbeat: the peer is lost
    probe_interval_s: float = 1.0  # how often main re-pings where a lost worker may be back
    client_keepalive_s: float = 1.0  # gRPC keepalive: a frozen main is noticed in about twice this


@dataclass
class ServerConfig:
    """Main's front doors: gRPC (cluster.main_port) and the OpenAI-compatible HTTP API."""

    http: bool = True  # serve /v1/completions, /v1/chat/completions, /health, /metrics
    http_host: str = ""  # "" = cluster.host
    http_port: int = 8000  # 0: any free port (LocalCluster's default, so tests never collide)
    model_name: str = ""  # the model id /v1/models lists and requests name ("" = the model directory's name)
    # Continuous batching: up to this many requests decode together, one token each per iteration,
    # every request's tokens exactly those it gets alone (odmoe.engine). 1: one request at a time.
    max_running: int = 8
    # K/V cache main may hold for running requests, e.g. "4GiB" ("" or 0: no bound): a request whose
    # prompt + max_new_tokens would not fit waits; one that could never fit is refused (400).
    kv_cache_memory: str = ""
    max_waiting: int = 64  # requests queued beyond those running; beyond that 429 / RESOURCE_EXHAUSTED
    request_timeout_s: float = 600.0  # deadline from arrival (queueing included); a request may ask less


@dataclass
class RayRoleConfig:
    """What one role's Ray actors ask for (odmoe.launch.ray_cluster). Ray places an actor only on a
    node that has all of it: custom resources (`ray start --resources='{"role_worker": 1}'`) and node
    labels (`ray start --labels=odmoe-role=worker`) are how a role is pinned to chosen machines."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # e.g. {role_worker: 1}
    labels: dict[str, str] = field(default_factory=dict)  # e.g. {odmoe-role: worker} (a label_selector)


@dataclass
class RayConfig:
    """role=ray: place the cluster on a running Ray cluster (`pip install odmoe[ray]`)."""

    address: str = "auto"  # a running cluster: "auto" (this machine's `ray start`), or "host:6379"
    namespace: str = "odmoe"
    main: RayRoleConfig = field(default_factory=RayRoleConfig)
    shadow: RayRoleConfig = field(default_factory=RayRoleConfig)
    worker: RayRoleConfig = field(default_factory=RayRoleConfig)
    standby_mains: int = 0  # more mains, each on a Ray node other than every other main's
    # How often Ray starts a worker's or the shadow's actor again after it died with its node (-1:
    # always). A restarted node announces itself to every main, which takes it back. Mains are never
    # restarted by Ray: standby mains (and the client's failover) cover a lost main without Ray.
    max_restarts: int = -1
    ready_timeout_s: float = 300.0  # placement + start of every node (a cold model load included)


@dataclass
class SecurityConfig:
    """Who may talk to the cluster (odmoe/security.py): CurveZMQ between nodes, TLS + a bearer token
    for clients. On unless enabled=false; role=local makes its own keys."""

    enabled: bool = True
    key_dir: str = ""  # what `odmoe-keys init DIR` made (role=local: a scratch copy, made at start)
    key_name: str = ""  # this node's key in key_dir ("": main / shadow / worker<i> by role)
    # With enabled=false a node still refuses a non-loopback address unless this says so (it then
    # warns at every start): anyone on the network could drive it.
    insecure_lan: bool = False

    def node_name(self, role: str, worker_index: int) -> str:
        if self.key_name:
            return self.key_name
        return f"worker{worker_index}" if role == "worker" else role


FAULT_ACTIONS = ("kill", "stop", "raise")


@dataclass
class FaultConfig:
    """Fault injection (tests, odmoe-bench suite=faults): the node named here kills or freezes
    itself when it reaches the given point, so a failure lands exactly there."""

    node: str = ""  # "main" | "shadow" | "worker<i>"; "" = no fault
    action: str = "kill"  # kill (SIGKILL) | stop (SIGSTOP) | raise (an unexpected error there)
    request: int = 1  # the node's n-th request (1-based)
    iteration: int = 1  # 0 = prefill, n = the n-th decode iteration
    layer: int = -1  # MoE layer; -1 = the first one the node reaches in that iteration
    part: int = 0  # worker, prefill mini-batches: fire on this part (earlier parts are in)
    resume_after_s: float = 0.0  # stop: SIGCONT after this long (0: stays frozen)
    record: str = ""  # append one JSON line {node, action, at_us, ...} here as it fires


@dataclass
class OdmoeConfig:
    role: RoleConfig = field(default_factory=RoleConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    alignment: AlignmentConfig = field(default_factory=AlignmentConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    miss: MissConfig = field(default_factory=MissConfig)  # what a missed prediction costs: time or exactness
    ray: RayConfig = field(default_factory=RayConfig)  # role=ray only
    results_file: str | None = None  # role=local: append this run's stats as one JSON line (sweeps)
    # role=local: keep the cluster serving (gRPC + the OpenAI-compatible API on server.http_port) until
    # Ctrl-C instead of answering `prompt` and stopping.
    serve: bool = False
    prompt: str = "def fibonacci(n):"
    max_new_tokens: int = 32
    ready_file: str | None = None  # a node writes {"address": ...} here once it serves
    trace_dir: str | None = None  # every node appends its timeline spans here (odmoe.trace); off when null
    log_level: str = "INFO"

    @property
    def topology(self) -> Topology:
        replicas = self.worker.replicas if self.worker.only_own_layers else 0
        homes = str(self.worker.cache).strip().lower() not in ("", "0", "none", "off")
        return Topology(self.cluster.workers, self.cluster.group_size, replicas, homes)


def validate(cfg: OdmoeConfig) -> None:
    if cfg.role.name not in ROLES:
        raise ValueError(f"role={cfg.role.name!r} is not one of {ROLES}")
    if cfg.worker.replicas < 1:
        raise ValueError(f"worker.replicas must be at least 1, got {cfg.worker.replicas}")
    from odmoe.expert_cache import CACHE_POLICIES, check_cache_spec

    check_cache_spec(cfg.worker.cache)
    if cfg.worker.cache_policy not in CACHE_POLICIES:
        raise ValueError(f"worker.cache_policy={cfg.worker.cache_policy!r} is not one of {CACHE_POLICIES}")
    cfg.topology  # noqa: B018 - raises on a workers/group_size mismatch or too many replicas
    if cfg.fault.node and cfg.fault.action not in FAULT_ACTIONS:
        raise ValueError(f"fault.action={cfg.fault.action!r} is not one of {FAULT_ACTIONS}")
    if cfg.failover.heartbeat_interval_s <= 0 or cfg.failover.heartbeat_timeout_s <= 0:
        raise ValueError("failover.heartbeat_interval_s and heartbeat_timeout_s must be positive")
    if cfg.server.max_waiting < 1 or cfg.server.request_timeout_s <= 0:
        raise ValueError("server.max_waiting must be >= 1 and server.request_timeout_s > 0")
    if cfg.server.max_running < 1:
        raise ValueError(f"server.max_running must be >= 1, got {cfg.server.max_running}")
    if cfg.prefill.chunk_tokens < 0:
        raise ValueError(f"prefill.chunk_tokens must be >= 0 (0: off), got {cfg.prefill.chunk_tokens}")
    if not 0 <= cfg.server.http_port < 65536:
        raise ValueError(f"server.http_port must lie in [0, 65535], got {cfg.server.http_port}")
    if cfg.worker.slots < 1:
        raise ValueError(f"worker.slots must be at least 1, got {cfg.worker.slots}")
    from odmoe.expert_store import STORES
    from odmoe.memory import parse_bytes

    if cfg.worker.store not in STORES:
        raise ValueError(f"worker.store={cfg.worker.store!r} is not one of {', '.join(STORES)}")
    try:
        parse_bytes(cfg.worker.host_memory)
    except ValueError as exc:
        raise ValueError(f"worker.host_memory: {exc}") from None
    try:
        parse_bytes(cfg.server.kv_cache_memory)
    except ValueError as exc:
        raise ValueError(f"server.kv_cache_memory: {exc}") from None
    if cfg.worker.decompress_threads < 1:
        raise ValueError(f"worker.decompress_threads must be at least 1, got {cfg.worker.decompress_threads}")
    if cfg.role.name == "worker" and not 0 <= cfg.worker.index < cfg.cluster.workers:
        raise ValueError(f"worker.index={cfg.worker.index} is outside 0..{cfg.cluster.workers - 1}")
    if cfg.role.name == "main" and len(cfg.cluster.worker_addresses) != cfg.cluster.workers:
        raise ValueError(
            f"role=main needs cluster.worker_addresses with {cfg.cluster.workers} entries, "
            f"got {len(cfg.cluster.worker_addresses)}"
        )
    check_device("model.device", cfg.model.device)
    check_device("shadow.device", cfg.shadow.device)
    check_device("worker.device", cfg.worker.device, allow_auto=True)
    if cfg.shadow.precision == "int8_dynamic" and cfg.shadow.device.startswith("cuda"):
        raise ValueError("shadow.precision=int8_dynamic is torch's CPU int8; on CUDA use int8 or nf4")
    if cfg.shadow.mode not in SHADOW_MODES:
        raise ValueError(f"shadow.mode={cfg.shadow.mode!r} is not one of {SHADOW_MODES}")
    for name in ("inject_wrong", "inject_wrong_token"):
        if not 0.0 <= getattr(cfg.shadow, name) <= 1.0:
            raise ValueError(f"shadow.{name} must lie in [0, 1], got {getattr(cfg.shadow, name)}")
    from odmoe.shadow_model import PRECISIONS

    if cfg.shadow.precision not in PRECISIONS:
        raise ValueError(f"shadow.precision={cfg.shadow.precision!r} is not one of {', '.join(PRECISIONS)}")
    cfg.miss.validate()
    make_plan(cfg.alignment)  # raises on a bad mode, negative periods or bounds
    if not 0 <= cfg.shadow.nice <= 19:
        raise ValueError(f"shadow.nice must lie in 0..19 (an os.nice increment), got {cfg.shadow.nice}")
    if cfg.shadow.hedge_margin < 0:
        raise ValueError(f"shadow.hedge_margin must be >= 0 (0: off), got {cfg.shadow.hedge_margin}")
    Speculation(1, cfg.alignment.max_ahead)  # raises on max_ahead < 1
    if cfg.prefill.mini_batch < 0:
        raise ValueError(f"prefill.mini_batch must be >= 0 (0: one batch), got {cfg.prefill.mini_batch}")
    if cfg.prefill.placement not in ("modulo", "balanced"):
        raise ValueError(f"prefill.placement={cfg.prefill.placement!r} is not one of modulo, balanced")
    _validate_security(cfg)
    if cfg.role.name == "local":
        if not cfg.prompt:
            raise ValueError("prompt is empty")
        if cfg.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {cfg.max_new_tokens}")


def check_device(key: str, name: str, allow_auto: bool = False) -> None:
    """`name` is cpu, cuda or cuda:<i> (or auto where allowed), and CUDA is there when it is asked for."""
    if allow_auto and name == "auto":
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{key}={name!r} is not cpu, cuda or cuda:<i>{' (or auto)' if allow_auto else ''}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{key}={name} needs CUDA, and this machine's torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{key}={name}: only {torch.cuda.device_count()} CUDA device(s) here")


def exposed_hosts(cfg: OdmoeConfig) -> list[str]:
    """The non-loopback addresses this node would bind (empty: loopback only)."""
    from odmoe.security import is_loopback

    hosts = [cfg.cluster.host]
    if cfg.role.name in ("main", "local") and cfg.server.http:
        hosts.append(cfg.server.http_host or cfg.cluster.host)
    return [h for h in dict.fromkeys(hosts) if not is_loopback(h)]


def _validate_security(cfg: OdmoeConfig) -> None:
    sec = cfg.security
    if sec.enabled:
        if cfg.role.name not in ("local", "ray") and not sec.key_dir:  # those two make their own
            raise ValueError(
                f"role={cfg.role.name} with security on needs security.key_dir=DIR (make it once with "
                "`odmoe-keys init DIR --workers N`, see README: Several machines on a LAN), or "
                "security.enabled=false on a trusted network"
            )
        return
    if exposed := exposed_hosts(cfg):
        if not sec.insecure_lan:
            raise ValueError(
                f"security.enabled=false would expose {', '.join(exposed)} without authentication: anyone on "
                "that network could drive the cluster. Turn security on (the default), bind 127.0.0.1, or "
                "say security.insecure_lan=true"
            )
