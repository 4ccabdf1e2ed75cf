"""The schema of `odmoe-bench` (Hydra fills it from conf/bench.yaml and conf/suite/*.yaml beside it).

One dataclass per suite holds that suite's knobs; `BenchConfig` holds what every suite shares: the
model, the local cluster's shape, the emulated load link, where results go. `suite=quick` runs
every suite with small settings on the tiny default model (what CI exercises).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from itertools import takewhile

# Every suite, in the order `suite=quick` runs them; each has benchmarks/conf/suite/<name>.yaml, whose
# opening comment says what it measures (`suite_summaries`, `make suites`).
SUITES = (
    "recall",
    "alignment",
    "ablation",
    "grid",
    "timeline",
    "compression",
    "faults",
    "network",
    "soak",
    "frontdoor",
    "security",
    "lossy",
    "lookahead",
    "prefill",
    "dataplane",
    "placement",
    "serving",
    "cache",
    "eval",
    "gpu",
    "memory",
    "quick",
)
GPU_SYSTEMS = ("odmoe", "odmoe_cache", "single_process", "accelerate_offload", "lru_offloader")
# suite gpu's same-budget sweep (issue 30): a trailing count sets a budget in experts
# (odmoe_cache_N / odmoe_lru_N: N cached per worker, prediction / LRU eviction; lru_offloader_N: N slots)
GPU_SIZED_SYSTEMS = ("odmoe_cache", "odmoe_lru", "lru_offloader")


def gpu_system(name: str) -> tuple[str, int | None]:
    """A suite gpu system's name as (kind, budget in experts or None); ValueError for an unknown one."""
    if name in GPU_SYSTEMS:
        return name, None
    kind, _, count = name.rpartition("_")
    if kind in GPU_SIZED_SYSTEMS and count.isdigit():
        return kind, int(count)
    raise ValueError(
        f"gpu.systems: {name!r} is not one of {', '.join(GPU_SYSTEMS)} nor "
        f"{' / '.join(k + '_N' for k in GPU_SIZED_SYSTEMS)} (N experts)"
    )


COMPRESSION_SYSTEMS = ("memory", "compressed", "disk", "lru_offloader")
GRID_SYSTEMS = ("odmoe", "resident_workers", "single_process", "lru_offloader")
DTYPES = ("bfloat16", "float16", "float32")  # the dtypes a suite may store or run a model at


@dataclass
class BenchLink:
    # The emulated host->device expert load of every worker (and of the LRU offloader): a load takes
    # latency + bytes / bandwidth. 8 Gbit/s makes one 1.5 MiB expert of the trained model ~1.7 ms,
    # longer than main's per-layer time on this CPU, so hiding loads matters as on an edge box.
    bandwidth_gbps: float = 8.0
    latency_ms: float = 0.1


@dataclass
class BenchCluster:
    workers: int = 2
    group_size: int = 2
    shadow_precision: str = "fp32"
    # The odmoe-launch preset every suite's clusters start from: paper (cacheless workers, waiting
    # alignment: what the suites reproduce and compare) or "" (odmoe's defaults). A suite measuring
    # a setting the preset fixes says so in its own words, which come after.
    preset: str = "paper"
    overrides: list[str] = field(default_factory=list)  # more odmoe-launch words for every cluster


@dataclass
class RecallSuite:
    precisions: list[str] = field(
        default_factory=lambda: ["fp32", "bf16", "fp16", "int8_dynamic", "int8", "nf4"]
    )
    # name -> [token_period, kv_period]; the paper's Fig. 3 shows these three
    alignments: dict[str, list[int]] = field(
        default_factory=lambda: {"none": [0, 0], "token": [1, 0], "token+KV": [1, 1]}
    )
    prompts: int = 8
    new_tokens: int = 256
    # Run these precisions' token+KV row through a real cluster too and report its Eq. 3 recall
    # beside the replay's (they measure the same thing; the cluster also says what arrived in time).
    cross_check: list[str] = field(default_factory=lambda: ["fp32", "int8_dynamic"])
    cross_check_tokens: int = 64


@dataclass
class AlignmentSuite:
    token_periods: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    kv_periods: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    new_tokens: int = 64
    repeats: int = 3  # requests per cell (different prompts), after one warm-up


@dataclass
class AblationSuite:
    cases: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5, 6])
    new_tokens: int = 128
    repeats: int = 6  # requests per case (different prompts), after one warm-up


@dataclass
class GridSuite:
    inputs: list[int] = field(default_factory=lambda: [16, 128])
    outputs: list[int] = field(default_factory=lambda: [64, 256])
    systems: list[str] = field(default_factory=lambda: list(GRID_SYSTEMS))
    repeats: int = 2  # requests per cell and system (different prompts), after one warm-up
    lru_experts: int = 16  # the LRU offloader's device cache, in experts (over all layers)
    threads: int = 1  # torch threads of the single-process baselines (each cluster node uses 1)


@dataclass
class TimelineSuite:
    new_tokens: int = 8
    iterations: list[int] = field(default_factory=lambda: [3, 4])  # decode iterations drawn in the PNG


@dataclass
class CompressionSuite:
    # Ratios of odmoe's store against zipnn, whole-tensor zstd / lz4 and the exponent's Shannon bound,
    # on every expert of the model at each dtype; then decompression GB/s per thread count.
    dtypes: list[str] = field(default_factory=lambda: list(DTYPES))
    threads: list[int] = field(default_factory=lambda: [1, 2])
    speed_repeats: int = 3  # decompress every expert this many times per thread count; the median counts
    random_init: bool = True  # also the ratios of random-init weights (the tiny model) beside the model's
    # Decode tokens/s with worker.store=<system> (bf16 model, pack file present for compressed/disk)
    # against the LRU offloader, all over this storage-bound link (2 Gbit/s: a SATA SSD).
    systems: list[str] = field(default_factory=lambda: list(COMPRESSION_SYSTEMS))
    dtype: str = "bfloat16"
    bandwidth_gbps: float = 2.0
    latency_ms: float = 0.1
    new_tokens: int = 64
    repeats: int = 5  # requests per system (different prompts), after one warm-up
    lru_experts: int = 16


@dataclass
class FaultsSuite:
    # node:action; node = main | shadow | worker<i>, action = kill | stop
    cases: list[str] = field(
        default_factory=lambda: [
            "worker1:kill",
            "worker1:stop",
            "shadow:kill",
            "shadow:stop",
            "main:kill",
            "main:stop",
        ]
    )
    new_tokens: int = 64
    at_token: int = 24  # the decode iteration the fault fires at
    resume_after_s: float = 3.0  # a frozen worker or shadow is resumed after this long
    streams: int = 3  # streams decoding together when the fault lands (each checked against its reference)


NETWORK_CASES = ("loss", "black_hole", "client_cut", "jitter_loss", "shadow_cut", "straggler")


@dataclass
class NetworkSuite:
    """A home network's faults on a cluster in network namespaces (benchmarks/network_faults.py):
    needs root, iproute2 and iptables; skipped with the reason elsewhere."""

    # loss: every node's link drops `loss` of its packets both ways for `seconds`; black_hole:
    # worker1's link drops everything for `hole_s` while its process lives, then heals; client_cut:
    # one more client's link (through a relay) black-holes mid-stream: until main cancels it;
    # jitter_loss: a cluster of its own, a relay in front of every node jittering each hop 0..jitter_ms
    # and every link losing `loss`, for `seconds`; shadow_cut: main <-> shadow drops everything for
    # cut_s (cacheless workers, fp32 shadow); straggler: cacheless workers, worker3's emulated link
    # `slower` times slower, main steering, `straggler_s` against the same cluster healthy
    cases: list[str] = field(default_factory=lambda: list(NETWORK_CASES))
    loss: float = 0.03  # per link (about twice that between two nodes)
    seconds: float = 120.0  # of load per lossy case; the healthy baseline runs a quarter (10 to 60 s)
    hole_s: float = 30.0
    streams: int = 4  # clients streaming requests back to back, each checked against its reference
    jitter_ms: float = 20.0
    cut_s: float = 30.0
    slower: float = 10.0
    straggler_s: float = 30.0


@dataclass
class SoakSuite:
    requests: int = 1000
    clients: int = 4  # concurrent clients
    new_tokens: int = 8
    prompts: int = 8  # distinct prompts, each checked against its reference
    workers: int = 4
    chaos_every_s: list[float] = field(default_factory=lambda: [2.0, 5.0])  # a random fault this often
    down_s: list[float] = field(default_factory=lambda: [0.5, 2.0])  # how long a node stays killed/frozen
    warmup_requests: int = 100  # RSS is compared from here on
    seed: int = 0
    # Network faults beside the kills and freezes (issue 47): a link relay (odmoe/tools/link_relay.py)
    # in front of every worker and the shadow, and the chaos also picks, for a node, a straggler (its
    # link delayed straggler_delay_s plus as much jitter), a black hole of hole_s or a loss burst (each
    # chunk and beat lost with a probability drawn from loss: TCP chunks late by a retransmission
    # timeout, beats dropped); stragglers and loss bursts last network_s.
    network: bool = False
    # workers the chaos leaves alone at any time (live in main's view, no fault of ours): with 1, a
    # single late beat of that last worker would fail requests at once (no live worker for a layer)
    keep_serving: int = 1
    straggler_delay_s: list[float] = field(default_factory=lambda: [0.02, 0.2])
    hole_s: list[float] = field(default_factory=lambda: [0.5, 10.0])
    loss: list[float] = field(default_factory=lambda: [0.05, 0.5])
    network_s: list[float] = field(default_factory=lambda: [2.0, 10.0])


@dataclass
class FrontdoorSuite:
    prompts: int = 4
    prompt_tokens: int = 32
    new_tokens: int = 32
    repeats: int = 3  # every prompt this often per path (the path order alternates)
    sampled: bool = True  # also a seeded sampled request per prompt (the same text on every path)


@dataclass
class ServingSuite:
    # Many users at once (continuous batching): closed-loop clients at each concurrency, then Poisson
    # arrivals at each rate; every request's tokens checked against running alone.
    max_running: int = 8  # server.max_running of the cluster
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    requests_per_client: int = 4
    rates: list[float] = field(default_factory=lambda: [1.0, 2.0])  # open loop, requests/s (~2.4 fit here)
    open_requests: int = 24
    prompts: int = 8
    prompt_tokens: int = 32
    new_tokens: int = 40
    seed: int = 0
    # GuideLLM beside our clients (the path of its executable, "" = skip): HTTP API, same concurrencies
    guidellm: str = ""
    guidellm_requests: int = 16  # requests per concurrency


CACHE_SYSTEMS = ("odmoe", "odmoe_lru", "lru_offloader", "resident_workers")
CACHE_ABLATIONS = ("odmoe_even_homes",)  # with cache.skew: the same uneven rooms, homes dealt evenly


@dataclass
class CacheSuite:
    # The workers' expert cache by budget: a share of every expert's bytes, cluster-wide (0: cacheless)
    budgets: list[float] = field(default_factory=lambda: [0.0, 0.125, 0.25, 0.5, 0.75, 1.0])
    systems: list[str] = field(default_factory=lambda: list(CACHE_SYSTEMS))
    prompts: int = 4
    prompt_tokens: int = 32
    new_tokens: int = 48
    overrides: list[str] = field(default_factory=list)  # more odmoe-launch words for the odmoe clusters
    # Uneven rooms in a group: even-numbered workers get (1 + skew) x the per-worker budget, odd ones
    # (1 - skew) x (0: every worker alike); odmoe_even_homes then shows what homes by room add
    skew: float = 0.0


@dataclass
class EvalSuite:
    # lm-evaluation-harness: --model hf in one process vs --model local-completions against the cluster
    tasks: list[str] = field(default_factory=lambda: ["odmoe_code_mc", "odmoe_code_gen"])
    limit: int = 0  # documents per task (0: all 200)
    num_concurrent: int = 1  # the harness's concurrent API requests
    scoring_prompts: int = 48  # prompt scoring throughput: prompts of 64-128 tokens
    scoring_batch: int = 8  # prompts per request in the batched scoring run


@dataclass
class SecuritySuite:
    rounds: int = 2  # each round starts one cluster with security on and one with it off, then measures both
    prompts: int = 3
    prompt_tokens: int = 32
    new_tokens: int = 32
    repeats: int = 2  # every prompt this often per cluster per round (the order alternates)


@dataclass
class LossySuite:
    """The lossy miss policies' speed-quality trade-off (odmoe.lossy.miss_policy) against reload."""

    # What produces the misses: a low-precision shadow aligned on tokens only, plus injected ones.
    shadow_precision: str = "int8_dynamic"
    token_period: int = 1
    kv_period: int = 0
    inject_wrong: list[float] = field(default_factory=lambda: [0.0, 0.2])
    budget: int = 2  # miss.budget of every lossy setting
    buddy_alpha: float = 0.9
    buddy_k_max: int = 4
    buddy_percentiles: list[float] = field(default_factory=lambda: [80.0, 50.0, 20.0, 0.0])  # TAE tau sweep
    importance_alphas: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.6, 1.0])
    # quality: teacher-forced perplexity over held-out windows (benchmarks/lossy_quality.py)
    texts: int = 16
    text_tokens: int = 256
    prompt_tokens: int = 32  # no substitution before this (the prefill); the rest is scored
    # speed + token agreement: one cluster per setting, these requests after a warm-up
    speed: bool = True
    prompts: int = 4
    new_tokens: int = 64
    profile_tokens: int = 65536  # calibration tokens when the model has no profile yet


@dataclass
class LookaheadSuite:
    """Issue 13: timely recall, reloads and decode speed per alignment system (suites/lookahead.py)."""

    precisions: list[str] = field(default_factory=lambda: ["int8_dynamic", "fp32"])
    systems: list[str] = field(
        default_factory=lambda: [
            "wait",
            "speculative",
            "hedged",
            "tuned",
            "resident_workers",
            "lru_offloader",
        ]  # fmt: skip
    )
    prompts: int = 3
    prompt_tokens: int = 32
    new_tokens: int = 128
    max_ahead: int = 2
    hedge_margin: float = 0.01  # the nf4 goal's operating point (recall >= 0.999 for <= 10 % extra loads)
    hedge_slots: int = 3  # worker.slots of the hedged system: one more than lookahead fills
    pin: bool = True  # also run speculative, hedged, resident pinned: the shadow on CPU 1, the rest on CPU 0
    pinned_only: bool = False  # only the pinned runs
    hedging: bool = True  # part 2 (the replay)
    # part 2: hedging recall on main's trajectory (no clock)
    hedge_precisions: list[str] = field(default_factory=lambda: ["nf4", "int8_dynamic"])
    hedge_margins: list[float] = field(default_factory=lambda: [0.0, 0.005, 0.01, 0.015, 0.02, 0.05, 0.1])
    # 32 x 256 tokens: ~65,000 activated experts, so one miss moves recall by 1.5e-5 and a 0.999 goal
    # is decided by dozens of misses, not by one (4 x 128 decided it by a single miss)
    replay_prompts: int = 32
    replay_tokens: int = 256


@dataclass
class PrefillSuite:
    """Batched prefill's TTFT per prefill setting beside one process, and what handing the shadow
    main's prompt K/V does to recall (suites/prefill.py)."""

    lengths: list[int] = field(default_factory=lambda: [16, 128])  # prompt tokens
    repeats: int = 5  # requests per length and configuration (the same prompt), after a warm-up; median
    # "MINI_BATCH:PLACEMENT" (prefill.mini_batch, prefill.placement), one local cluster each, no shadow;
    # a third part ":per_mini_batch" computes each mini-batch on arrival (prefill.compute_per_mini_batch,
    # opt-in because it is not bit-exact).
    configurations: list[str] = field(
        default_factory=lambda: [
            "0:modulo",
            "4:modulo",
            "16:modulo",
            "64:modulo",
            "0:balanced",
            "16:balanced",
            "4:modulo:per_mini_batch",
            "16:modulo:per_mini_batch",
        ]
    )
    threads: int = 1  # torch threads of the single-process reference (each cluster node uses 1)
    # Recall of the first decode tokens with the shadow's own prompt K/V vs main's
    # (alignment.prefill_kv), a low-precision shadow aligned on tokens only: two clusters.
    prompt_kv: bool = True
    prompt_kv_precision: str = "int8_dynamic"
    prompt_kv_lengths: list[int] = field(default_factory=lambda: [16, 64, 128])  # one request each
    prompt_kv_tokens: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # decode tokens reported


PREFILL_PLACEMENTS = ("modulo", "balanced")


def prefill_configuration(text: str) -> tuple[int, str, bool]:
    """ "16:balanced" -> (16, "balanced", False); "4:modulo:per_mini_batch" -> (4, "modulo", True)."""
    parts = text.split(":")
    ok = 2 <= len(parts) <= 3 and parts[0].isdigit() and parts[1] in PREFILL_PLACEMENTS
    if not ok or parts[2:] not in ([], ["per_mini_batch"]):
        raise ValueError(
            f"prefill.configurations: {text!r} is not "
            f"MINI_BATCH:<{'|'.join(PREFILL_PLACEMENTS)}>[:per_mini_batch]"
        )
    return int(parts[0]), parts[1], len(parts) == 3


@dataclass
class DataplaneSuite:
    """A remote decode layer's cost against the raw ZeroMQ round trip (benchmarks/suites/dataplane.py)."""

    rounds: int = 2000  # round trips per wire variant per repeat (codec: calls per repeat)
    warmup_rounds: int = 200
    repeats: int = 5  # wire variants interleaved this many times; the median of the medians counts
    prompts: int = 2
    prompt_tokens: int = 16
    new_tokens: int = 48
    layer_repeats: int = 3  # requests per prompt per system (reference, security on, off), interleaved
    # main's side on CPU 0 (this process: the reference and the echo's client; main), the other side
    # on CPU 1 (the echo; every worker): each end a core of its own, as on two boxes (needs taskset)
    pin: bool = False
    # the clusters' workers each on a core of their own (cluster.spread_workers), main and this
    # process anywhere: without it the kernel may queue a layer's two workers on one core
    spread: bool = False
    # the floor: a decode layer's exchange with nothing but the wire and the compute (main fans raw
    # frames out to `cluster.group_size` echo processes that each stay busy for the workers' measured
    # compute time per expert), main busy this long before each (its own layer work); 0 rounds: off
    fanout_rounds: int = 2000
    fanout_gap_us: float = 250.0
    # the floor again with real work on both sides and still no odmoe code on the path: each echo
    # computes the model's experts (the workers' expert_forward, the layer's experts in turn) and
    # this process applies main's own weights between rounds instead of spinning
    floor_with_experts: bool = True
    # the raw round trip again with this much idle before each (as a decode layer's calls are spaced
    # by main's own work): what the wire costs a process that slept in between; 0: not measured
    spaced_gap_ms: float = 1.0
    spaced_rounds: int = 300


@dataclass
class PlacementSuite:
    """Issue 17: start-up through Ray against role=local (suites/placement.py; the `ray` extra)."""

    rounds: int = 3  # each starts the cluster both ways, in alternating order
    prompt_tokens: int = 16
    new_tokens: int = 16  # the first request after start-up: TTFT and tokens (identical both ways)
    ray_address: str = ""  # "": start a multi-node Ray cluster on this machine (timed apart)


@dataclass
class GpuSuite:
    """Issue 18: odmoe on one GPU against one-process ways of serving the same model (suites/gpu.py).
    The model is its own: Mixtral-shaped, random bf16 weights of real width, made once in model_dir."""

    device: str = "cuda"  # cuda | cuda:<i>; cpu: a dry run of everything but CUDA (give a tiny width)
    layers: int = 4  # 8 experts x 352 MB per layer at real width: 4 layers ~ 11.3 GB of checkpoint
    hidden: int = 4096
    intermediate: int = 14336
    experts: int = 8
    top_k: int = 2
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 4096
    dtype: str = "bfloat16"
    model_dir: str = ""  # "": ~/.cache/odmoe/models/gpu-<spec name>; made once, reused
    systems: list[str] = field(default_factory=lambda: list(GPU_SYSTEMS))
    prompt_tokens: int = 64
    new_tokens: int = 32
    repeats: int = 2  # requests per system (different prompts), after one warm-up
    workers: int = 4
    group_size: int = 2
    slots: int = 2  # per worker: what bounds a worker's device memory
    shadow_precision: str = "bf16"
    lru_experts: int = 8  # the LRU offloader's device cache, in experts
    # accelerate's max_memory for the GPU ("" = the device bytes odmoe's weights take: main's
    # non-expert weights + every worker's slots, so both get the same budget)
    accelerate_gpu_memory: str = ""
    copy_bytes: int = 1 << 30  # size of the pinned copy_ that measures the bus's peak
    timeout_s: float = 900.0  # per baseline process


@dataclass
class MemorySuite:
    """Issue 45: each node's memory at real width, its slope over the model's size, start-up, and the
    disk path (benchmarks/suites/memory.py)."""

    layers: list[int] = field(default_factory=lambda: [8, 16, 24])  # checkpoints of ~1.4, 2.7 and 4.1 GiB
    hidden: int = 1024
    intermediate: int = 3584
    experts: int = 8
    systems: list[str] = field(default_factory=lambda: ["defaults", "paper", "disk"])
    shadow_precisions: list[str] = field(default_factory=lambda: ["bf16", "int8_dynamic", "int4"])
    disk_fractions: list[float] = field(default_factory=lambda: [1.0, 0.5, 0.25])  # on the largest
    startup_workers: list[int] = field(default_factory=lambda: [2, 4])  # one worker of N, alone, cold
    prompt: str = "def fibonacci(n):"
    new_tokens: int = 16


MEMORY_SYSTEMS = ("defaults", "paper", "disk")


@dataclass
class BenchConfig:
    suite: str = "quick"
    # "trained": the trained benchmark model (made once, ~10 min, cached); "trained_deepseek": its
    # DeepSeek-V3-shaped sibling (odmoe.tools.training.TRAINED_DEEPSEEK_SPEC); "tiny" / "demo": odmoe-launch's
    # random-init / briefly trained models (model.path names); anything else: a checkpoint directory.
    model: str = "trained"
    results_dir: str = "benchmarks/results"
    name: str = ""  # suffix of the output files (a -m sweep defaults to the job's overrides)
    link: BenchLink = field(default_factory=BenchLink)
    cluster: BenchCluster = field(default_factory=BenchCluster)
    recall: RecallSuite = field(default_factory=RecallSuite)
    alignment: AlignmentSuite = field(default_factory=AlignmentSuite)
    ablation: AblationSuite = field(default_factory=AblationSuite)
    grid: GridSuite = field(default_factory=GridSuite)
    timeline: TimelineSuite = field(default_factory=TimelineSuite)
    compression: CompressionSuite = field(default_factory=CompressionSuite)
    faults: FaultsSuite = field(default_factory=FaultsSuite)
    network: NetworkSuite = field(default_factory=NetworkSuite)
    soak: SoakSuite = field(default_factory=SoakSuite)
    frontdoor: FrontdoorSuite = field(default_factory=FrontdoorSuite)
    security: SecuritySuite = field(default_factory=SecuritySuite)
    lossy: LossySuite = field(default_factory=LossySuite)
    lookahead: LookaheadSuite = field(default_factory=LookaheadSuite)
    prefill: PrefillSuite = field(default_factory=PrefillSuite)
    dataplane: DataplaneSuite = field(default_factory=DataplaneSuite)
    placement: PlacementSuite = field(default_factory=PlacementSuite)
    serving: ServingSuite = field(default_factory=ServingSuite)
    cache: CacheSuite = field(default_factory=CacheSuite)
    eval: EvalSuite = field(default_factory=EvalSuite)
    gpu: GpuSuite = field(default_factory=GpuSuite)
    memory: MemorySuite = field(default_factory=MemorySuite)
    log_level: str = "WARNING"


def validate(cfg: BenchConfig) -> None:
    if cfg.suite not in SUITES:
        raise ValueError(f"suite={cfg.suite!r} is not one of {', '.join(SUITES)}")
    from odmoe.shadow.shadow_model import PRECISIONS

    shadows = [cfg.cluster.shadow_precision, cfg.lossy.shadow_precision, cfg.prefill.prompt_kv_precision]
    for p in [*cfg.recall.precisions, *shadows]:
        if p not in PRECISIONS:
            raise ValueError(f"shadow precision {p!r} is not one of {', '.join(PRECISIONS)}")
    for name, periods in cfg.recall.alignments.items():
        if len(periods) != 2 or min(periods) < 0:
            raise ValueError(f"recall.alignments.{name} must be [token_period, kv_period] >= 0")
    _among("grid.systems", cfg.grid.systems, GRID_SYSTEMS)
    _among("ablation.cases", cfg.ablation.cases, range(1, 7))
    for name in ("alignment", "ablation", "grid"):
        if getattr(cfg, name).repeats < 1:
            raise ValueError(f"{name}.repeats must be at least 1")
    if cfg.grid.lru_experts < 1:
        raise ValueError("grid.lru_experts must be at least 1")
    c = cfg.compression
    _among("compression.systems", c.systems, COMPRESSION_SYSTEMS)
    _among("compression dtypes", [*c.dtypes, c.dtype], DTYPES)
    if not c.threads or min(c.threads) < 1 or c.repeats < 1 or c.speed_repeats < 1:
        raise ValueError("compression.threads, repeats and speed_repeats must be at least 1")
    for case in cfg.faults.cases:
        node, _, action = case.partition(":")
        if action not in ("kill", "stop") or not (node in ("main", "shadow") or node.startswith("worker")):
            raise ValueError(f"faults.cases: {case!r} is not <main|shadow|worker<i>>:<kill|stop>")
    if not 1 <= cfg.faults.at_token < cfg.faults.new_tokens - 4:
        raise ValueError("faults.at_token must lie in 1 .. new_tokens - 5 (gaps after it are measured)")
    nw = cfg.network
    _among("network.cases", nw.cases, NETWORK_CASES)
    if not 0 < nw.loss < 1 or min(nw.seconds, nw.hole_s, nw.cut_s, nw.straggler_s) <= 0 or nw.streams < 1:
        raise ValueError(
            "network: loss must lie in (0, 1), seconds, hole_s, cut_s and straggler_s > 0, streams >= 1"
        )
    if nw.jitter_ms < 0 or nw.slower <= 1:
        raise ValueError("network: jitter_ms must be >= 0 and slower > 1")
    sv = cfg.serving
    if not sv.concurrency or min([*sv.concurrency, sv.requests_per_client, sv.max_running, sv.prompts]) < 1:
        raise ValueError("serving: concurrency, requests_per_client, max_running and prompts must be >= 1")
    if any(r <= 0 for r in sv.rates) or sv.open_requests < 1:
        raise ValueError("serving.rates must be > 0 and serving.open_requests >= 1")
    ca = cfg.cache
    _among("cache.systems", ca.systems, CACHE_SYSTEMS + CACHE_ABLATIONS)
    if not 0 <= ca.skew < 1:
        raise ValueError(f"cache.skew must lie in [0, 1), got {ca.skew}")
    if not ca.budgets or any(not 0 <= b <= 1 for b in ca.budgets) or min(ca.prompts, ca.new_tokens) < 1:
        raise ValueError("cache.budgets must lie in [0, 1]; cache.prompts and new_tokens >= 1")
    me = cfg.memory
    _among("memory.systems", me.systems, MEMORY_SYSTEMS)
    if not me.layers or min(me.layers) < 1 or any(not 0 < f <= 1 for f in me.disk_fractions):
        raise ValueError("memory.layers must be >= 1 and memory.disk_fractions lie in (0, 1]")
    ev = cfg.eval
    if ev.limit < 0 or min(ev.num_concurrent, ev.scoring_prompts, ev.scoring_batch) < 1:
        raise ValueError("eval: limit must be >= 0; num_concurrent, scoring_prompts, scoring_batch >= 1")
    _among("eval.tasks", ev.tasks, ("odmoe_code_mc", "odmoe_code_gen"))
    if cfg.soak.clients < 1 or cfg.soak.requests < cfg.soak.clients:
        raise ValueError("soak.clients must be >= 1 and soak.requests >= soak.clients")
    for key in ("chaos_every_s", "down_s", "straggler_delay_s", "hole_s", "loss", "network_s"):
        low_high = getattr(cfg.soak, key)
        if len(low_high) != 2 or not 0 <= low_high[0] <= low_high[1]:
            raise ValueError(f"soak.{key} must be [low, high] with 0 <= low <= high, got {low_high}")
    if not 1 <= cfg.soak.keep_serving < cfg.soak.workers:
        raise ValueError(f"soak.keep_serving must lie in [1, soak.workers), got {cfg.soak.keep_serving}")
    if cfg.soak.loss[1] >= 1:
        raise ValueError(f"soak.loss must lie below 1 (a probability), got {cfg.soak.loss}")
    p = cfg.prefill
    for text in p.configurations:
        prefill_configuration(text)
    counts = [p.repeats, p.threads, *p.lengths, *p.prompt_kv_lengths, *p.prompt_kv_tokens]
    if not p.lengths or min(counts) < 1:
        raise ValueError("prefill: lengths must not be empty; repeats, threads and every length must be >= 1")
    if p.prompt_kv and not (p.prompt_kv_lengths and p.prompt_kv_tokens):
        raise ValueError("prefill.prompt_kv needs prompt_kv_lengths and prompt_kv_tokens")
    d = cfg.dataplane
    if min(d.rounds, d.repeats, d.prompts, d.layer_repeats, d.prompt_tokens) < 1 or d.new_tokens < 2:
        raise ValueError(
            "dataplane: rounds, repeats, prompts, layer_repeats, prompt_tokens >= 1, new_tokens >= 2"
        )
    g = cfg.gpu
    kinds = {gpu_system(name)[0] for name in g.systems}
    if any(gpu_system(name) == ("lru_offloader", 0) for name in g.systems):
        raise ValueError("gpu.systems: lru_offloader_0 has no room for an expert (N >= 1)")
    if (
        min(g.layers, g.hidden, g.intermediate, g.repeats, g.workers, g.slots, g.lru_experts, g.prompt_tokens)
        < 1
    ):
        raise ValueError(
            "gpu: layers, widths, repeats, workers, slots, lru_experts, prompt_tokens must be >= 1"
        )
    if g.new_tokens < 2 or g.shadow_precision not in PRECISIONS or g.dtype not in DTYPES:
        raise ValueError("gpu: new_tokens >= 2, a known shadow_precision and dtype bfloat16/float16/float32")
    groups = g.workers // max(g.group_size, 1)
    clustered = {"odmoe", "odmoe_cache", "odmoe_lru"} & kinds
    if clustered and (g.workers % max(g.group_size, 1) or groups > g.layers):
        # each worker stores only its group's layers (worker.only_own_layers): a group needs a layer
        raise ValueError(
            f"gpu: workers={g.workers} in groups of {g.group_size} must make at most gpu.layers={g.layers} "
            "groups (each worker stores only its group's layers)"
        )
    if cfg.link.bandwidth_gbps < 0 or cfg.link.latency_ms < 0:
        raise ValueError("link.bandwidth_gbps and link.latency_ms must be >= 0 (0/0: no emulated link)")


def _among(name: str, values, known) -> None:
    """ValueError naming `name` where some of `values` are not among `known`."""
    if bad := sorted(set(values) - set(known)):
        raise ValueError(f"{name}: {bad} not among {', '.join(map(str, known))}")


def suite_summaries() -> dict[str, str]:
    """Each suite's opening comment in benchmarks/conf/suite/<name>.yaml, joined into one line: the one
    place the help texts (`make suites`, `odmoe-bench`'s docs) take what a suite measures from."""
    folder = resources.files("odmoe_bench.conf") / "suite"
    out = {}
    for name in SUITES:
        lines = (folder / f"{name}.yaml").read_text().splitlines()[1:]  # [0]: `# @package _global_`
        head = takewhile(lambda line: line.startswith("#"), lines)
        out[name] = " ".join(line.lstrip("#").strip() for line in head)
    return out


if __name__ == "__main__":  # `make suites`
    for suite_name, summary in suite_summaries().items():
        print(f"odmoe-bench suite={suite_name:<12} {summary}")
