"""`odmoe-bench`: the Hydra entry of the benchmark suites.

    odmoe-bench suite=recall            # Fig. 3: recall vs output-token index (+ two baseline predictors)
    odmoe-bench suite=alignment         # Fig. 9: decode tokens/s over token x KV alignment periods
    odmoe-bench suite=ablation          # Fig. 8: cases 1-6, spread over repeated requests
    odmoe-bench suite=grid              # Table 2: odmoe vs three baselines; simulator validation
    odmoe-bench suite=timeline          # Fig. 2/5: Chrome trace + timing diagram of a few iterations
    odmoe-bench suite=compression       # lossless expert store: ratios, decompression GB/s, decode tokens/s
    odmoe-bench suite=faults            # losing a worker / the shadow / main: detect, stall, recovery
    odmoe-bench suite=network           # lossy links, a black-holed worker (namespaces): speed, stall, detect
    odmoe-bench suite=soak              # 1,000 requests, 4 clients, nodes killed and frozen at random
    odmoe-bench suite=lossy             # lossy miss policies: perplexity / agreement vs speed
    odmoe-bench suite=lookahead         # timely recall, reloads, decode vs resident per alignment mode
    odmoe-bench suite=prefill           # TTFT of batched prefill per mini-batch / placement vs one process
    odmoe-bench suite=frontdoor         # the OpenAI HTTP path's overhead against gRPC, same requests
    odmoe-bench suite=security          # CurveZMQ + TLS + token on vs off: tokens/s, TTFT, start-up
    odmoe-bench suite=dataplane         # a remote decode layer's cost against the raw ZeroMQ round trip
    odmoe-bench suite=placement         # start-up through Ray (role=ray) vs role=local (the ray extra)
    odmoe-bench suite=serving           # many users at once: tokens/s, TTFT, ITL by concurrency and rate
    odmoe-bench suite=cache             # the workers' expert cache by budget: prediction vs LRU vs offloader
    odmoe-bench suite=eval              # lm-eval through the API vs one process: scores, scoring cost
    odmoe-bench suite=gpu               # one GPU: odmoe vs resident, accelerate offload, LRU (CUDA only)
    odmoe-bench suite=memory            # each node's memory at real width, its slope, start-up, the disk path
    odmoe-bench suite=quick             # all of them, small, on the tiny model (CI)
    odmoe-bench -m suite=ablation link.bandwidth_gbps=1,8   # sweep: one job per combination

Each suite prints its figures and writes JSON (and PNGs) under results_dir. Installed with the
suites (`pip install -e ./benchmarks`, which pulls odmoe's `bench` extra: matplotlib). Exit codes:
0 success, 2 bad configuration or a missing extra, 1 a suite failed.
"""

from __future__ import annotations

import importlib
import logging
import sys
import time

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from odmoe.launch.settings import typed
from odmoe_bench.config import SUITES, BenchConfig, validate

ConfigStore.instance().store(name="bench_schema", node=BenchConfig)
log = logging.getLogger("odmoe.bench")


def to_bench_config(raw: DictConfig) -> BenchConfig:
    cfg: BenchConfig = typed(raw, BenchConfig)
    validate(cfg)
    return cfg


def run_suites(cfg: BenchConfig) -> None:
    from odmoe.tools.model_names import resolve_model
    from odmoe_bench.results import ResultsDir

    if cfg.suite == "gpu":  # its own real-width model; stops at once without CUDA
        from odmoe_bench.suites import gpu

        model_path = gpu.prepare(cfg)
    else:
        model_path = resolve_model(cfg.model)
    out = ResultsDir(cfg, model_path)
    # quick leaves out the soak (it is one long run), placement (it needs the ray extra and starts
    # a Ray cluster; tests/test_ray_cluster.py exercises the same path), eval (the eval extra;
    # tests/test_eval_harness.py runs it reduced), memory (GiBs of real-width checkpoints; its
    # parts are tests/test_memory_limits.py's) and network (root and namespaces; its cases are
    # tests/test_network_faults.py's)
    left_out = ("soak", "placement", "eval", "memory", "network", "gpu", "quick")
    names = [n for n in SUITES if n not in left_out] if cfg.suite == "quick" else [cfg.suite]
    for name in names:
        start = time.perf_counter()
        print(f"\n== suite {name} on {model_path}", flush=True)
        # benchmarks/suites/<name>.py's run (suite eval's module is eval_harness, the harness's name)
        importlib.import_module(f"odmoe_bench.suites.{'eval_harness' if name == 'eval' else name}").run(
            cfg, model_path, out
        )
        print(f"== suite {name} took {time.perf_counter() - start:.0f}s", flush=True)


@hydra.main(config_path="pkg://odmoe_bench.conf", config_name="bench", version_base="1.3")
def main(raw: DictConfig) -> None:
    try:
        cfg = to_bench_config(raw)
    except ValueError as exc:
        print(f"odmoe-bench: {exc}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars would bury the suites' own figures
    hf_logging.set_verbosity_error()
    # bitsandbytes warns on every CPU int8 matmul that it casts inputs to fp16: once per layer per token
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN and not cfg.name:
        cfg.name = hydra_cfg.job.override_dirname or str(hydra_cfg.job.num)
    from odmoe.extras import MissingExtra, require
    from odmoe.launch.local_cluster import ClusterStartError

    try:
        require("matplotlib", "bench", "odmoe-bench")  # every suite draws: say so before it runs
        run_suites(cfg)
    except (ValueError, MissingExtra) as exc:  # bad input: a model that is not a checkpoint, a bad
        print(f"odmoe-bench: {exc}", file=sys.stderr)  # key value, an extra not installed
        sys.exit(2)
    except ClusterStartError as exc:  # names the node and quotes its log
        print(f"odmoe-bench: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
