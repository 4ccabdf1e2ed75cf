"""Suite `gpu` (issue 18): odmoe on one GPU against one-process ways of serving the same model.

The model is the suite's own: Mixtral-shaped (8 experts, top-2), random weights of real width
(hidden 4096, intermediate 14336: one bf16 expert is 352 MB), `gpu.layers` layers, written once by
`odmoe.tools.model_factory.make_wide_model` (sharded safetensors, like a download). Systems, one after
another, each in processes of its own so that every number of device memory is its own:

- `odmoe`: main, shadow and `gpu.workers` workers all on the one GPU (`model.device`,
  `shadow.device`, `worker.device`), each worker limited to `gpu.slots` expert slots (`worker.cache=0`,
  the paper's cacheless worker: every expert loaded just in time and evicted), experts in pinned host
  memory, loads on each worker's copy stream;
- `odmoe_cache`: the same with odmoe's defaults, where each worker also keeps experts in the device
  memory it has spare (`worker.cache`): more device memory, fewer loads (its own device bytes shown);
- `single_process`: transformers with the whole model on the GPU (the upper bound);
- `accelerate_offload`: `from_pretrained(device_map="auto", max_memory=...)` with the GPU budget odmoe's
  weights take (what a Hugging Face user tries first): whole layers beyond it stay in host memory and
  are copied in at every forward;
- `lru_offloader`: one process, an LRU cache of `gpu.lru_experts` expert slots, async loads as a worker's.

Same-budget sweep (issue 30), a count N at the end of a name: `odmoe_cache_N` / `odmoe_lru_N` keep N
experts per worker (`worker.cache` of N experts' bytes) on top of its `gpu.slots`, evicting by the
shadow's predictions / by recency (`worker.cache_policy`); `lru_offloader_N` has N expert slots. The
expert memory of odmoe with N is workers x (slots + N) experts: `lru_offloader_M` with that M is the
same budget (the shadow, a node of its own in a real cluster, is counted apart).

Per system: decode tokens/s, TTFT, CUDA's own peak memory counter per node process, the tokens (all
must equal `single_process`'s). The bus: its measured peak (a pinned `copy_` of `gpu.copy_bytes`,
timed by CUDA events) against what odmoe's loads achieved (bytes over their CUDA-event time per copy,
and bytes over the whole request).

`gpu.device=cpu` is a dry run of every part but CUDA (model creation at the width given, the
accelerate placement, the cluster on CPU, report and figure): what the tests run on a machine
without a GPU. With `gpu.device=cuda` and no CUDA the suite stops at once with a message (exit 2).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from odmoe.models.checkpoint import Checkpoint
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.tools.model_factory import ModelSpec, default_cache_dir, make_wide_model
from odmoe_bench import plots
from odmoe_bench.baselines import run_in_child
from odmoe_bench.cluster_runs import run_cluster
from odmoe_bench.config import BenchConfig, GpuSuite, gpu_system
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, fmt, prompts
from odmoe_bench.wide_model import wide_spec

SYSTEMS = Table(
    "system:<20",
    "decode tok/s:13.2f",
    "TTFT s:8.3f",
    "experts:8d",
    "hit:6.2f",
    "MB/token:9.1f",
    "device GiB (peak, per node):>30",
    "tokens = single:>5",
    sep=" ",
)
NO_CUDA = (
    "suite=gpu needs a CUDA device and this machine's torch sees none (torch {version}). Install a CUDA "
    "build of torch (README: On a GPU), or run the dry run: odmoe-bench suite=gpu gpu.device=cpu "
    "gpu.hidden=64 gpu.intermediate=128 gpu.heads=4 gpu.kv_heads=2"
)


def spec_of(g: GpuSuite) -> ModelSpec:
    return wide_spec(
        g, top_k=g.top_k, heads=g.heads, kv_heads=g.kv_heads, vocab=g.vocab, dtype=g.dtype,
        max_positions=max(512, g.prompt_tokens + g.new_tokens + 8),
    )  # fmt: skip


def prepare(cfg: BenchConfig) -> str:
    """Check the device, then the suite's model directory, made on first use."""
    g = cfg.gpu
    if torch.device(g.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(NO_CUDA.format(version=torch.__version__))
    spec = spec_of(g)
    target = Path(g.model_dir).expanduser() if g.model_dir else default_cache_dir() / f"gpu-{spec.name}"
    marker = target / "odmoe_model.json"
    if not (marker.is_file() and json.loads(marker.read_text()).get("hidden") == spec.hidden):
        print(f"making the suite's model under {target} ({_model_gb(spec):.1f} GB)", flush=True)
        make_wide_model(spec, target)
    return str(target)


def _model_gb(spec: ModelSpec) -> float:
    expert = 3 * spec.hidden * spec.intermediate
    per_layer = spec.experts * expert + 4 * spec.hidden * spec.hidden
    return (spec.layers * per_layer + 2 * spec.vocab * spec.hidden) * 2 / 1e9


def gpu_words(g: GpuSuite, cache: bool | str = False, policy: str = "prediction") -> list[str]:
    d = g.device
    # cache=False: the odmoe, each worker bounded by its slots; True: odmoe's default cache;
    # a string: that worker.cache (bytes, for the same-budget sweep)
    if cache is True:
        cache_words = []
    else:
        cache_words = [f"worker.cache={cache or 0}", f"worker.cache_policy={policy}"]
    return [
        *cache_words,
        f"model.device={d}",
        f"shadow.device={d}",
        f"worker.device={d}",
        f"model.dtype={g.dtype}",
        f"shadow.precision={g.shadow_precision}",
        f"cluster.workers={g.workers}",
        f"cluster.group_size={g.group_size}",
        f"worker.slots={g.slots}",
        "worker.only_own_layers=true",  # each worker pins only its group's layers in host memory
        # no lab=on, so no emulated link: expert loads cross the real bus
        "worker.ready_timeout_s=900",  # a worker reads and pins GBs of experts before it serves
        "worker.reply_timeout_s=300",
        "cluster.torch_threads=2",
    ]


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    g = cfg.gpu
    tokenizer = load_tokenizer(model_path)
    requests = prompts(tokenizer, g.repeats, g.prompt_tokens, first=200)
    ckpt = open_checkpoint(model_path)
    expert_bytes = ckpt.expert(ckpt.moe_layers[0], 0).nbytes
    bus = _bus_peak(g)
    systems: dict[str, dict] = {}
    failed: dict[str, str] = {}
    budget = g.accelerate_gpu_memory or str(_odmoe_weight_bytes(ckpt, g, expert_bytes))
    report = {
        "device": g.device,
        "gpu": torch.cuda.get_device_name(torch.device(g.device)) if g.device.startswith("cuda") else None,
        "model": {**spec_of(g).__dict__, "expert_bytes": expert_bytes, "moe_layers": len(ckpt.moe_layers)},
        "bus_peak_bytes_per_s": bus,
        "accelerate_gpu_memory": budget,
        "systems": systems,
        "failed": failed,
    }
    for system in g.systems:
        print(f"-- {system}", flush=True)
        # A GPU box is lent by the minute: one system that fails or runs out of time must not take the
        # others' figures with it, so each is recorded as it ends and the JSON rewritten each time.
        kind, count = gpu_system(system)
        try:
            if kind in ("odmoe", "odmoe_cache", "odmoe_lru"):
                cache: bool | str = kind == "odmoe_cache"
                if count is not None:
                    cache = str(count * expert_bytes)
                policy = "lru" if kind == "odmoe_lru" else "prediction"
                systems[system] = _odmoe(g, model_path, requests, cache, policy)
                # device memory for experts, in experts (odmoe_cache's "auto" is measured, not set)
                cached = 0 if kind == "odmoe" else count
                systems[system]["expert_budget"] = None if cached is None else g.workers * (g.slots + cached)
            else:
                systems[system] = _process(g, model_path, kind, requests, budget, count)
        except Exception as e:  # noqa: BLE001 - any failure of one system is reported, not fatal
            failed[system] = f"{type(e).__name__}: {e}"
            print(f"-- {system} FAILED: {failed[system]}", flush=True)
        _compare_tokens(systems)
        out.write("gpu", "gpu", report)
    _print(report)
    if systems:
        plots.gpu(
            report,
            out.path("gpu", "png"),
            f"{g.layers} layers x {g.experts} experts, {g.new_tokens} new tokens",
        )
    return report


def _compare_tokens(systems: dict[str, dict]) -> None:
    reference = systems.get("single_process", {}).get("token_ids")
    for s in systems.values():
        s["tokens_equal_single_process"] = None if reference is None else s["token_ids"] == reference


def _bus_peak(g: GpuSuite) -> float | None:
    if not g.device.startswith("cuda"):
        return None
    from odmoe.worker.device_slots import host_to_device_peak

    return host_to_device_peak(g.device, g.copy_bytes)


def _odmoe_weight_bytes(ckpt: Checkpoint, g: GpuSuite, expert_bytes: int) -> int:
    """What odmoe's weights take on the device: main's non-expert tensors + every worker's slots."""
    itemsize = torch.empty(0, dtype=getattr(torch, g.dtype)).element_size()
    main = sum(t.numel() for t in ckpt.non_expert_state_dict().values()) * itemsize
    return main + g.workers * g.slots * expert_bytes


def _odmoe(g: GpuSuite, model_path: str, prompts: list[list[int]], cache: bool | str, policy: str) -> dict:
    # warmed up with a whole request: a 4-token warm-up left the first timed request at a tenth of
    # the second's speed on an H200 (one process: 31 against 358 tokens/s)
    words = gpu_words(g, cache, policy)
    run = run_cluster(model_path, words, prompts, g.new_tokens, warmup_tokens=g.new_tokens)
    stats = run.stats
    loaded = sum(w["bytes_loaded"] for s in stats for w in s["per_worker"].values())
    load_s = sum(w["load_s"] for s in stats for w in s["per_worker"].values())
    peaks: dict[str, int] = {}
    for s in stats:
        for node, b in s.get("device_peak_bytes", {}).items():
            peaks[node] = max(peaks.get(node, 0), b)
    return {
        "ttft_s": [s["ttft_s"] for s in stats],
        "decode_tokens_per_s": [s["decode_tokens_per_s"] for s in stats],
        "token_ids": run.token_ids,
        "device_peak_bytes": peaks,
        "device_weight_bytes": stats[-1].get("device_bytes"),
        "peak_rss_bytes": run.peak_rss_bytes,
        # None for a request the shadow did not predict for (main skips it while the workers' caches
        # hold every expert: odmoe_cache once warm)
        "recall": [(s.get("recall") or {}).get("overall") if s.get("shadow") else None for s in stats],
        "stall_s": [s["stall_s"] for s in stats],
        "bytes_loaded": loaded,
        "bytes_loaded_per_token": loaded / max(1, sum(s["new_tokens"] for s in stats)),
        "cache_hit_rate": _hit_rate(stats),
        # per copy: bytes over the CUDA-event time of the copies (concurrent copies share the bus)
        "load_bytes_per_s": loaded / load_s if load_s > 0 else None,
        # over the requests: bytes every worker loaded over the requests' wall time
        "request_bytes_per_s": loaded / sum(s["total_s"] for s in stats),
    }


def _hit_rate(stats: list[dict]) -> float | None:
    """Expert computations served from a worker's cache, over all computed (as suite cache counts)."""
    computed = sum(s["experts_loaded"] for s in stats)
    return sum(s["cache"]["hits"] for s in stats) / computed if computed else None


def _process(
    g: GpuSuite, model_path: str, system: str, prompts: list[list[int]], budget: str, lru: int | None = None
) -> dict:
    cells = [{"name": "gpu", "prompts": prompts, "new_tokens": g.new_tokens}]
    report = run_in_child(
        system, model_path, cells, timeout=g.timeout_s, device=g.device, dtype=g.dtype, threads=4,
        lru_experts=lru or g.lru_experts, gpu_memory=budget, warmup_tokens=g.new_tokens,
    )  # fmt: skip
    runs = report["cells"][0]["runs"]
    return {
        "ttft_s": [r["ttft_s"] for r in runs],
        "decode_tokens_per_s": [r["decode_tokens_per_s"] for r in runs],
        "token_ids": [r["token_ids"] for r in runs],
        "device_peak_bytes": {system: report["device_peak_bytes"]},
        "device_weight_bytes": {system: report["device_bytes"]},
        "peak_rss_bytes": {system: report["peak_rss_bytes"]},
        "offloaded_modules": report.get("offloaded_modules"),
        "lru_hit_rate": report["cells"][0].get("lru_hit_rate"),
        "expert_budget": (lru or g.lru_experts) if system == "lru_offloader" else None,
    }


def _print(report: dict) -> None:
    bus = report["bus_peak_bytes_per_s"]
    print(f"bus peak (pinned copy_): {fmt(bus / 1e9 if bus else None, 6, '.1f')} GB/s")
    SYSTEMS.header()
    for name, s in report["systems"].items():
        per_token = s.get("bytes_loaded_per_token")
        SYSTEMS.row(
            name,
            statistics.mean(s["decode_tokens_per_s"]),
            statistics.mean(s["ttft_s"]),
            s.get("expert_budget"),
            s.get("cache_hit_rate", s.get("lru_hit_rate")),
            per_token / 1e6 if per_token is not None else None,
            ", ".join(f"{k} {v / 2**30:.2f}" for k, v in sorted(s["device_peak_bytes"].items())),
            s["tokens_equal_single_process"],
        )
    for name, why in report["failed"].items():
        print(f"{name:20} FAILED: {why}")
    odmoe = report["systems"].get("odmoe")
    if odmoe and odmoe.get("load_bytes_per_s"):
        print(
            f"odmoe loads: {odmoe['load_bytes_per_s'] / 1e9:.1f} GB/s per copy, "
            f"{odmoe['request_bytes_per_s'] / 1e9:.1f} GB/s over the requests"
        )
