"""Typed configuration: the schema Hydra fills (launch/ reads YAML; nothing else here imports Hydra).

Every knob a user can set on the command line (`cluster.workers=4`) or in `LocalCluster(overrides=...)`
is a field below; `odmoe.validation.validate` turns bad combinations into one readable error before
any process starts. This module is the schema alone: every part of odmoe may import it, and it imports
nothing of theirs but the pure placement rule and the miss policy's own dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from odmoe.lossy.miss_policy import MissConfig
from odmoe.placement import Topology

ROLES = ("local", "main", "worker", "shadow", "ray", "plan", "seed")


@dataclass
class RoleConfig:
    # local (every node on this machine) | main | worker | shadow | ray | plan (print each node's
    # memory need for model.path and the cluster shape, loading nothing) | seed (serve model.path's
    # bytes on cluster.join_port to nodes that pull their share, nothing else)
    name: str = "local"


@dataclass
class ModelConfig:
    # A local Hugging Face MoE checkpoint directory, or one of odmoe's own models, made on first use
    # under cache_dir: tiny (random init, made in a second: the library's default, so LocalCluster's,
    # the tests' and the protocol benchmarks'), demo (a small Mixtral trained on the Python standard
    # library, ~2 min on 2 cores, once: odmoe-launch's default, set in conf/config.yaml),
    # trained, trained_deepseek, trained_qwen3_next. null means tiny; write ./demo for a directory named demo.
    path: str | None = "tiny"
    # A GGUF file inside `path` (a directory), as transformers' `gguf_file=`: `path` may also name the
    # .gguf file itself (a shard `-00001-of-0000N.gguf` names the set). Needs the `gguf` extra.
    gguf_file: str | None = None
    dtype: str = "auto"  # "auto" = as saved, like from_pretrained; or float32 / bfloat16 / float16
    cache_dir: str | None = None  # where odmoe's own models are made (null: ~/.cache/odmoe/models)
    # A box that lacks the checkpoint pulls its share from this Share service (host:port: a main or
    # seed serving cluster.join_port; several, "a:1,b:2", are asked in turn: one unreachable or lost
    # mid-pull hands over to the next that serves the same checkpoint) into pull_dir ("":
    # ~/.cache/odmoe/pulled/<host>_<port>) and runs from there: a worker the experts of the layers it
    # stores, main the non-expert tensors, the shadow all of them; every range checked against the
    # source's sha256 index, resumable, and a second start pulls nothing (odmoe.models.share_pull).
    # "" = model.path is on this box.
    pull_from: str = ""
    pull_dir: str = ""
    pull_rate_mbps: float = 0.0  # cap on the pull's rate, megabits/s (0: none), so serving is not starved
    # Where main computes (embeddings, attention + KV cache, routers, shared experts, lm_head):
    # cpu | cuda | cuda:<i>. The shadow's is shadow.device, each worker's worker.device.
    device: str = "cpu"


@dataclass
class NodeConfig:
    """This node's process: its machine, as the memory plan sees it (odmoe.node_memory,
    odmoe.memory_plan), and where it says it serves."""

    # What this node's process may use in all, e.g. "12GiB" ("": its memory cgroup's limit where one is
    # set, else the kernel's MemAvailable). Announced to main, which deals expert homes by it.
    memory: str = ""
    ready_file: str | None = None  # the node writes {"address": ...} here once it serves (launchers)


@dataclass
class ClusterConfig:
    workers: int = 2  # worker nodes; a multiple of group_size
    # Main starts serving once this many workers answer (and every layer has one that holds it);
    # 0: all of `workers`. The others may come later (a box joining by the link, a worker started
    # with cluster.main_addresses): each is taken in while main serves and given its homes (growth).
    min_workers: int = 0
    group_size: int = 2  # workers per group: a group serves every N-th MoE layer (N = workers / group_size)
    host: str = "127.0.0.1"  # where main's gRPC server and the workers bind
    main_port: int = 0  # 0: any free port (the local launcher learns it from the ready file)
    # main (and role=seed) serve here the checkpoint's bytes to nodes with model.pull_from and, with
    # security on, the join link's admission (odmoe-launch join=LINK): -1 off; 0 any free port (the
    # ready file's join_address). The cluster's TLS and token apply (admission's first two calls aside).
    join_port: int = -1
    # with the join door open: announce it on the LAN by mDNS (the `lan` extra), so a box may run
    # `odmoe-launch join=auto:SECRET` instead of the whole link (the secret is still needed)
    advertise: bool = False
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
    # not each spin a full thread pool: on 2 cores that made decoding 4-5x slower (cluster=local sets 1).
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
    # The memory of named nodes, where a node should not take its own figure for its peers' (role=plan
    # prints every node's; a worker deals homes by it at start, before main has heard from each), e.g.
    # {worker0: 32GiB, worker1: 16GiB}. Main learns each worker's own figure from its Pong either way.
    node_memory: dict[str, str] = field(default_factory=dict)
    # With worker caches, which worker of a group keeps which expert (its home, odmoe.placement):
    # room (each worker home for experts in proportion to its worker.cache, told in its Pong) | even
    # (expert e on member e mod n whatever the rooms: the ablation)
    homes: str = "room"


@dataclass
class WorkerConfig:
    index: int = 0  # role=worker: which worker this is (decides its group)
    # "auto": cuda when present, else cpu; or cpu | cuda | cuda:<i>. On CUDA the experts rest in pinned
    # host memory and load by asynchronous copies on the worker's own stream (odmoe.worker.device_slots).
    device: str = "auto"
    slots: int = 2  # experts a worker may hold on the device at once (one computing, one loading)
    only_own_layers: bool = False  # store only the layers of this worker's group (less memory)
    # With only_own_layers: each layer is stored by this many groups (its own + the next R-1), so the
    # loss of a whole group is survived when R >= 2. Ignored otherwise (every worker stores every layer).
    replicas: int = 1
    ready_timeout_s: float = 120.0  # how long the launcher waits for a node to come up
    # Per-call deadline: a worker alive by heartbeat that has not answered a call for this long (a
    # frozen process) is counted as lost and its calls re-sent. Loads over a slow link must fit in it.
    reply_timeout_s: float = 60.0
    # Where experts rest (odmoe.worker.expert_store): memory (decompressed in host memory) | compressed
    # (lossless: entropy-coded exponents + raw sign/mantissa, in host memory) | disk (read on each load:
    # the pack file when there is one, else the checkpoint's safetensors).
    store: str = "memory"
    # Bound on expert bytes held in host memory, e.g. "512MiB" or 1073741824 ("" or 0: no bound);
    # experts beyond it are read from disk on each load.
    host_memory: str = ""
    pack_dir: str = ""  # where odmoe-pack wrote its file ("": MODEL/odmoe-pack)
    decompress_threads: int = 2  # thread pool that decompresses a compressed expert's chunks
    # Experts kept on the device after use (odmoe.worker.expert_cache): 0 (cacheless, the paper's), a size
    # ("6GiB"), all (every expert this worker is home for) or auto (free device memory less a margin,
    # at most all). Any value keeps tokens identical; it changes which bytes are loaded again. Workers
    # of a group with different values (set per node) are home for experts in proportion to their room.
    # auto is the default (the fastest exact setting: suite=cache); preset=paper sets 0.
    cache: str = "auto"
    cache_policy: str = "prediction"  # which cached expert leaves: prediction (shadow-steered) | lru
    # prediction's prior rate of use per expert, before this worker has seen traffic: odmoe-profile's
    # file ("": MODEL/odmoe-profile/profile.npz when the model has one; "off": online counts only)
    cache_profile: str = ""


SHADOW_MODES = ("emulate", "random")
PREFILL_PLACEMENTS = ("auto", "modulo", "balanced", "homes")


@dataclass
class PrefillConfig:
    mini_batch: int = 0  # tokens per message of one expert's prompt batch (0: the whole batch at once)
    # While other requests decode, a new prompt of T tokens prefills over ~T / chunk_tokens decode
    # iterations, a share of its MoE layers each, so running streams wait for at most that share
    # (0: a whole prompt in one iteration). Cut between layers, not tokens: bit-exact either way.
    chunk_tokens: int = 0
    # Prompts that arrive together prefill one after another, each in a tick of its own beside the
    # decode pass, and one that arrives during a pass whose tick has no prefill yet prefills at its
    # next layer boundary rather than at the next tick (false: at the next tick boundary, all the
    # prompts that arrived). Running streams then wait for one prompt per iteration, and requests
    # that arrived together do not keep finishing together. Bits unchanged either way.
    stagger: bool = True
    # Which worker computes each expert of a prompt: modulo (expert e on the layer's holder e mod N,
    # every worker storing the layer) | balanced (by token count) | homes (each expert on its home in
    # the layer's group, where worker.cache keeps it: a hit instead of a load; without caches,
    # modulo) | auto (homes with worker caches, else modulo)
    placement: str = "auto"
    # Compute each mini-batch as it arrives. Faster, but NOT bit-exact (a matmul's rows depend on
    # how many rows it sees), so off by default: odmoe's output must equal the reference's.
    compute_per_mini_batch: bool = False


@dataclass
class ShadowConfig:
    enabled: bool = True  # false: no shadow, every expert is loaded after routing (ablation case 6)
    mode: str = "emulate"  # emulate: a copy of the model predicts; random: random experts (case 5)
    # auto: int8_dynamic on a CPU where its weights fit node.memory, else int4 (CUDA: bitsandbytes int8,
    # else nf4); fp32 (exact) / bf16 / fp16 / int8_dynamic, int4 (torch's fast CPU int8 and int4) /
    # int8, nf4 (bitsandbytes: GPUs; slow on CPU)
    precision: str = "auto"
    device: str = "cpu"  # cpu | cuda | cuda:<i> (bitsandbytes int8/nf4 are meant for cuda)
    # hedged prefetch (odmoe.shadow.hedging): also preload the (k+1)-th expert when its router score is within
    # this of the k-th's (0: off); it needs a spare slot (worker.slots above what lookahead fills)
    hedge_margin: float = 0.0
    seed: int = 0  # of the random choices: mode=random's experts, (lab=on) emulation.inject_wrong*
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
    max_ahead: int = 2  # speculative: at most this many iterations ahead of main's newest report
    # tune: main adapts both periods per request (odmoe.main.alignment.PeriodTuner): +1 after grow_after
    # windows whose wrong predictions stay within tolerance, halved after one that does not
    tune: bool = False
    min_period: int = 1  # tune: the periods stay within [min_period, max_period]
    max_period: int = 16  # tune: see min_period
    tolerance: float = 0.02  # tune: a window with more wrong predictions than this halves the periods
    grow_after: int = 2  # tune: this many clean windows in a row widen them by one


@dataclass
class FailoverConfig:
    heartbeat_interval_s: float = 0.2  # ZeroMQ heartbeat on main's connections to workers and shadow
    # no traffic this long after a heartbeat: the peer is lost. The backstop behind the beats: on a
    # lossy link TCP's retransmissions (200, 400, 800 ms...) hold heartbeats back for seconds
    heartbeat_timeout_s: float = 4.0
    # main beats each worker over UDP (the port number of its TCP port) this often and judges the
    # answers' gaps with a phi-accrual suspicion (odmoe.transport.suspicion): a worker whose link drops
    # everything is lost in ~0.9 s, a late answer on a lossy, jittery link is not a loss. 0: off
    beat_interval_s: float = 0.1
    suspicion_threshold: float = 8.0  # phi at which a silent worker is lost (1e-8 odds it is alive)
    acceptable_pause_s: float = 0.5  # silence beyond the usual gap that costs no suspicion by itself
    beat_min_std_s: float = 0.05  # the answers' gaps' deviation is never taken below this
    probe_interval_s: float = 1.0  # how often main re-pings where a lost worker may be back
    # Where no live worker holds a layer a request needs (a home router's hiccup can drop them all at
    # once): how long the request waits for one to be taken back before it fails UNAVAILABLE naming
    # the layer. 0: it fails at once.
    no_worker_grace_s: float = 3.0
    client_keepalive_s: float = 1.0  # gRPC keepalive: a frozen main is noticed in about twice this
    # Stragglers (odmoe.main.stragglers): main keeps each worker's recent load+compute seconds per
    # decode expert (with worker caches, of the answers that loaded) and steers decode work (its
    # placement and the workers' preloads alike) to the group's other workers while one is
    # consistently slower than they are, and back once it has recovered. With caches that means
    # moving the straggler's homes, done only when it pays (straggler_move_horizon)
    steer_stragglers: bool = True
    straggler_factor: float = 3.0  # a straggler: its median seconds per expert above this x its peers'
    # that median is over its last this many decode answers (judged once it has them): 8 were measured
    # to flap on a loaded 2-core box, a worker starved of its core for a few iterations
    straggler_after: int = 32
    # a straggler still gets its share of each of its group's layers every this-many-th decode
    # iteration (a probe; the layers take turns); two probe answers in a row within straggler_factor
    # of its peers' and it is given work again
    straggler_probe_every: int = 16
    # with worker caches: a straggler's homes move to its peers only when its measured extra seconds a
    # token (less what its hits would cost at peers with no room for them), over this many tokens,
    # exceed the move's cost (the reloads it causes at the peers' measured seconds per load).
    # 0: homes never move
    straggler_move_horizon: int = 256
    # Late decode calls (odmoe.main.late_calls): a call unanswered this many times the median round
    # trip of recent calls after its send (and at least resend_late_min_s) has its experts sent again
    # to another live worker of the group, the first answer taken (the same bits): on a lossy link a
    # lost segment otherwise waits for TCP's retransmission, 200 ms or more. 0: never
    resend_late_factor: float = 4.0
    resend_late_min_s: float = 0.02


@dataclass
class ServerConfig:
    """Main's front doors: gRPC (cluster.main_port) and the OpenAI-compatible HTTP API."""

    http: bool = True  # serve /v1/completions, /v1/chat/completions, /health, /metrics
    http_host: str = ""  # "" = cluster.host
    http_port: int = 8000  # 0: any free port (LocalCluster's default, so tests never collide)
    model_name: str = ""  # the model id /v1/models lists and requests name ("" = the model directory's name)
    # Continuous batching: up to this many requests decode together, one token each per iteration,
    # every request's tokens exactly those it gets alone (odmoe.main.engine). 1: one request at a time.
    max_running: int = 8
    # How main computes a tick's decode iterations (odmoe.main.batched_decode): "batched" (one pass
    # through the layers for every decoding request: attention per request, every other op row-exact;
    # families Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4-MoE, lossless miss policy; others fall back) or
    # "per_request" (transformers' forward pass per request). Both give each request its own bits.
    decode: str = "batched"
    # K/V cache main may hold for running requests, e.g. "4GiB" ("" or 0: no bound): a request whose
    # prompt + max_new_tokens would not fit waits; one that could never fit is refused (400).
    kv_cache_memory: str = ""
    max_waiting: int = 64  # requests queued beyond those running; beyond that 429 / RESOURCE_EXHAUSTED
    request_timeout_s: float = 600.0  # deadline from arrival (queueing included); a request may ask less
    # Main pings each gRPC client's connection this often (HTTP/2 keepalive); a ping unanswered for
    # client_ping_timeout_s drops the connection and cancels its requests. A client whose link went
    # silent (a black hole: no FIN, no RST, TCP waits minutes) is let go within their sum, its place
    # and K/V freed. The timeout outlasts a few TCP retransmissions (200, 400, 800 ms...) on a lossy link.
    # The HTTP door: TCP keepalive after client_ping_s, TCP_USER_TIMEOUT = client_ping_timeout_s on
    # every connection, and an SSE comment every client_ping_s on a stream: the same bound (Linux).
    client_ping_s: float = 1.0
    client_ping_timeout_s: float = 3.0


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
    """Who may talk to the cluster (odmoe/transport/security.py): CurveZMQ between nodes, TLS + a bearer token
    for clients. On unless enabled=false; role=local makes its own keys. On a LAN: `odmoe-keys init
    DIR`, then security.key_dir=DIR."""

    enabled: bool = True  # authenticated, encrypted transport between nodes and for clients
    key_dir: str = ""  # what `odmoe-keys init DIR` made (role=local: a scratch copy, made at start)
    key_name: str = ""  # this node's key in key_dir ("": main / shadow / worker<i> by role)
    # With enabled=false a node still refuses a non-loopback address unless this says so (it then
    # warns at every start): anyone on the network could drive it.
    insecure_lan: bool = False

    def node_name(self, role: str, worker_index: int) -> str:
        return self.key_name or (f"worker{worker_index}" if role == "worker" else role)


@dataclass
class OdmoeConfig:
    role: RoleConfig = field(default_factory=RoleConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    alignment: AlignmentConfig = field(default_factory=AlignmentConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    miss: MissConfig = field(default_factory=MissConfig)  # what a missed prediction costs: time or exactness
    ray: RayConfig = field(default_factory=RayConfig)  # role=ray only
    results_file: str | None = None  # role=local: append this run's stats as one JSON line (sweeps)
    # role=local: keep the cluster serving (gRPC + the OpenAI-compatible API on server.http_port) until
    # Ctrl-C instead of answering `prompt` and stopping.
    serve: bool = False
    # role=local: the text to continue (odmoe-launch's --prompt / --prompt-file take any text as it is)
    prompt: str = "def fibonacci(n):"
    max_new_tokens: int = 32  # role=local: how many tokens to generate for prompt
    # odmoe-launch join=odmoe://SECRET@HOST:PORT/FINGERPRINT (the line main prints): this box checks
    # main's certificate against the fingerprint, proves the secret, is handed its role, keys and
    # settings, pulls its share of the checkpoint and serves (role=worker|shadow asks for one).
    join: str = ""
    # every node appends its timeline spans here (odmoe.tools.trace); off when null
    trace_dir: str | None = None
    log_level: str = "INFO"  # every node's logging level (DEBUG, INFO, WARNING, ...)

    @property
    def topology(self) -> Topology:
        replicas = self.worker.replicas if self.worker.only_own_layers else 0
        homes = str(self.worker.cache).strip().lower() not in ("", "0", "none", "off")
        return Topology(self.cluster.workers, self.cluster.group_size, replicas, homes)


# -- The lab overlay ------------------------------------------------------------------------------
# Tests and benchmarks, not the product: `lab=on` (a Hydra word, launch/settings.py) composes
# LabConfig, the product's schema plus fault injection and emulation; without it these keys do not
# exist and a word that sets one is refused. Nodes read them through fault_of / emulation_of, which
# answer "off" (the defaults below) for the product's OdmoeConfig.


@dataclass
class LinkConfig:
    """An emulated host->device link for expert loads: each load takes at least latency_ms +
    bytes / bandwidth_gbps (odmoe.worker.expert_store.Link); off at 0/0, and a request's stats say when on."""

    bandwidth_gbps: float = 0.0  # Gbit/s (0 with latency_ms 0: off)
    latency_ms: float = 0.0  # added to every load


@dataclass
class EmulationConfig:
    """Knobs that make a cluster slower or its predictions wrong on purpose, to measure what that
    costs or to test what odmoe does then."""

    inject_wrong: float = 0.0  # this fraction of the shadow's predicted experts is made wrong (misses)
    inject_wrong_token: float = 0.0  # this fraction of the shadow's own next tokens is made wrong (rollbacks)
    # Benchmark baseline, not OD-MoE: keep every expert on the device (no loads): the cost of being
    # cacheless, isolated. Predictions are then ignored.
    resident: bool = False
    link: LinkConfig = field(default_factory=LinkConfig)


FAULT_ACTIONS = ("kill", "stop", "raise")


@dataclass
class FaultConfig:
    """Fault injection (odmoe-bench suite=faults): the node named here kills or freezes itself when
    it reaches the given point, so a failure lands exactly there, e.g. lab=on fault.node=worker1
    fault.action=kill fault.iteration=10 fault.layer=2."""

    node: str = ""  # "main" | "shadow" | "worker<i>"; "" = no fault
    action: str = "kill"  # kill (SIGKILL) | stop (SIGSTOP) | raise (an unexpected error there)
    request: int = 1  # the node's n-th request (1-based)
    iteration: int = 1  # 0 = prefill, n = the n-th decode iteration
    layer: int = -1  # MoE layer; -1 = the first one the node reaches in that iteration
    part: int = 0  # worker, prefill mini-batches: fire on this part (earlier parts are in)
    resume_after_s: float = 0.0  # stop: SIGCONT after this long (0: stays frozen)
    record: str = ""  # append one JSON line {node, action, at_us, ...} here as it fires


@dataclass
class LabConfig(OdmoeConfig):
    """`lab=on`: the product's schema, every default unchanged, plus what tests and benchmarks set."""

    fault: FaultConfig = field(default_factory=FaultConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)


def fault_of(cfg: OdmoeConfig) -> FaultConfig:
    """The fault to inject: cfg's under the lab overlay, else none."""
    return cfg.fault if isinstance(cfg, LabConfig) else FaultConfig()


def emulation_of(cfg: OdmoeConfig) -> EmulationConfig:
    """The emulation knobs: cfg's under the lab overlay, else all off."""
    return cfg.emulation if isinstance(cfg, LabConfig) else EmulationConfig()
