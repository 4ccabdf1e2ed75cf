"""GGUF experts on the link (issue 46): one Qwen3-MoE-shaped model at real width (random weights,
`odmoe-make-model --fast-fill`) as bf16 safetensors, as a Q8_0 GGUF file and as a Q4_K GGUF file
(`--gguf`), each decoding through a local cluster with the paper's cacheless workers over an
emulated link (every expert a token uses crosses it as stored; a GGUF worker dequantizes it on
arrival) — link bytes per token, each worker's expert bytes and peak memory, decode tokens/s, and
whether the tokens equal transformers loading the same checkpoint in one process.

python -m odmoe_bench.gguf_link [--hidden 1024] [--intermediate 3584] [--layers 4] [--tokens 16]
    [--gbps 8] [--device cpu|cuda] [--out benchmarks/results/gguf-link.json]

Every node is a process on this machine, so decode speed is this machine's: the workers'
dequantization (odmoe.models.gguf_blocks, torch on the worker's one thread, or on the GPU with
--device cuda: every node there, the shadow in bf16, transformers' reference on the GPU too) against
the link time the smaller blocks save. A GGUF file computes in float32 as transformers loads it
(`model.dtype=auto`); the bf16 checkpoint in bf16.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from odmoe import LocalCluster
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.node_memory import process_memory
from odmoe.tools.model_factory import make_wide_model
from odmoe_bench.results import write_report
from odmoe_bench.wide_model import add_wide_model_args, wide_spec

PROMPT = "def fibonacci(n):\n    "


def reference(path: str, tokens: int, device: str = "cpu", prompt: str = PROMPT) -> list[int]:
    """transformers' greedy tokens for `prompt` on the checkpoint on `device`, one thread as every node
    computes."""
    import torch
    from transformers import AutoModelForCausalLM

    from odmoe.models.gguf_checkpoint import gguf_location

    torch.set_num_threads(1)
    if path.endswith(".gguf"):
        directory, name = gguf_location(path)
        config = open_checkpoint(path).config
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=config)
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    model = model.to(device)
    ids = load_tokenizer(path)(prompt, return_tensors="pt")["input_ids"].to(device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens)
    return out[0, ids.shape[1] :].tolist()


def run(path: str, tokens: int, gbps: float, device: str = "cpu") -> dict:
    words = [
        "lab=on",  # the emulated link
        "preset=paper",
        f"emulation.link.bandwidth_gbps={gbps}",
        "emulation.link.latency_ms=0.1",
        f"model.device={device}",
        f"worker.device={device}",
        f"shadow.device={device}",
        # torch's fast int8 is CPU-only; on the GPU the shadow computes in bf16
        f"shadow.precision={'int8_dynamic' if device == 'cpu' else 'bf16'}",
    ]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        cluster.client.generate(PROMPT, max_new_tokens=4)  # warm-up: first loads, page cache
        got = cluster.client.generate(PROMPT, max_new_tokens=tokens)
        # /proc's VmHWM, not the stats' ru_maxrss: a node spawned from this (large) process
        # inherits its ru_maxrss across exec
        memory = {n.name: process_memory(n.process.pid) for n in cluster.nodes if n.name.startswith("worker")}
    s = got.stats
    checkpoint = open_checkpoint(path)
    experts = [(layer, e) for layer in checkpoint.moe_layers for e in range(checkpoint.num_experts)]
    stored = stored_bytes(checkpoint, experts)
    return {
        "expert_bytes_stored_mean": stored / len(experts),
        # cacheless workers in one group of 2 each hold every expert of every layer (failover)
        "expert_bytes_per_worker": stored,
        "bytes_loaded_per_token": s["bytes_loaded"] / max(s["new_tokens"], 1),
        "bytes_per_load": s["bytes_loaded"] / max(s["experts_loaded"], 1),
        "experts_loaded": s["experts_loaded"],
        "decode_tokens_per_s": s["decode_tokens_per_s"],
        "worker_load_s": s["worker_load_s"],
        "worker_compute_s": s["worker_compute_s"],
        "worker_peak_bytes": {name: m.peak for name, m in memory.items()},
        "worker_resident_bytes": {name: m.resident for name, m in memory.items()},
        "tokens_equal_transformers": got.token_ids == reference(path, tokens, device),
    }


def stored_bytes(checkpoint, keys: list[tuple[int, int]]) -> int:
    """The bytes of the experts at `keys` as the checkpoint stores them (bf16 where not quantized)."""
    expert = checkpoint.quantized_expert if checkpoint.quantized_experts else checkpoint.expert
    return sum(expert(*key).nbytes for key in keys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m odmoe_bench.gguf_link", description=__doc__.splitlines()[0]
    )
    add_wide_model_args(parser, layers=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--gbps", type=float, default=8.0, help="emulated host-to-device link")
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K"])
    parser.add_argument("--device", default="cpu", help="where every node computes: cpu | cuda")
    parser.add_argument("--out", default="benchmarks/results/gguf-link.json")
    args = parser.parse_args(argv)
    from odmoe.tools.gguf_export import write_gguf

    spec = wide_spec(args, family="qwen3_moe", vocab=2048)
    rows, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        models = {"bf16 safetensors": make_wide_model(spec, Path(tmp) / "bf16")}
        seconds["bf16 safetensors"] = time.perf_counter() - start
        for qtype in args.types:
            start = time.perf_counter()
            models[f"{qtype} gguf"] = write_gguf(models["bf16 safetensors"], Path(tmp) / qtype, qtype)
            seconds[f"{qtype} gguf"] = time.perf_counter() - start
        for name, path in models.items():
            rows[name] = {**run(str(path), args.tokens, args.gbps, args.device), "written_s": seconds[name]}
            print(f"{name}: {rows[name]['decode_tokens_per_s']:.2f} tokens/s", flush=True)
    base = rows["bf16 safetensors"]
    print(
        f"{'checkpoint':<18}{'expert MiB':>11}{'MiB/token':>11}{'x bf16':>8}{'worker MiB':>11}"
        f"{'peak RSS w0':>12}{'tok/s':>8}  tokens = transformers"
    )
    for name, r in rows.items():
        r["link_bytes_over_bf16"] = r["bytes_loaded_per_token"] / base["bytes_loaded_per_token"]
        r["expert_memory_over_bf16"] = r["expert_bytes_per_worker"] / base["expert_bytes_per_worker"]
        r["decode_over_bf16"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        print(
            f"{name:<18}{r['expert_bytes_stored_mean'] / 2**20:>11.2f}"
            f"{r['bytes_loaded_per_token'] / 2**20:>11.1f}"
            f"{r['link_bytes_over_bf16']:>8.3f}{r['expert_bytes_per_worker'] / 2**20:>11.0f}"
            f"{r['worker_peak_bytes'].get('worker0', 0) / 2**20:>12.0f}{r['decode_tokens_per_s']:>8.2f}"
            f"  {r['tokens_equal_transformers']}"
        )
    report = {
        "spec": spec.name,
        "tokens": args.tokens,
        "link_gbps": args.gbps,
        "device": args.device,
        "rows": rows,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
