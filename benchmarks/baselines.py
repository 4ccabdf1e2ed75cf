"""Single-process baselines of the grid suite, each run in a process of its own so that its peak
memory is its own:

- `single_process`: transformers' model with every expert resident, `generate(do_sample=False)` —
  the upper bound (the paper's "Transformers, all experts cached").
- `lru_offloader`: a Mixtral-Offloading-style single node: everything but the experts resident, the
  experts in host memory, an LRU cache of `--lru-experts` device slots; a miss loads the expert over
  the same emulated link the cluster's workers use (`odmoe.worker.expert_store.DeviceSlots`). It computes
  with odmoe's bit-exact expert kernels, so its tokens equal the reference's too.
- `accelerate_offload` (suite gpu): what a Hugging Face user tries first on one GPU too small for the
  model: `from_pretrained(device_map="auto", max_memory={gpu: --gpu-memory, "cpu": ...})`; accelerate
  places whole decoder layers on the GPU until the budget is spent, keeps the others in host memory
  and copies their weights (all experts of the layer) to the GPU at every forward.

`--device cuda[:i]` runs a baseline on the GPU (experts of the LRU offloader then rest in pinned host
memory and load by async copies, as on a CUDA worker); the report adds CUDA's own peak counter.

    python -m odmoe_bench.baselines --system lru_offloader --model DIR --cells cells.json --out out.json

`--cells` is a JSON list of {"name", "prompts": [[ids...]...], "new_tokens"}; the output holds one
entry per cell with every request's TTFT, decode tokens/s, overall tokens/s and token ids, and the
process's peak RSS and device bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from odmoe.models.expert_math import combine, expert_forward, split_by_expert
from odmoe.models.load_dtypes import expert_dtype
from odmoe.models.main_model import build_main_model, resolve_dtype
from odmoe.models.open_model import open_checkpoint
from odmoe.tools.memory import peak_rss_bytes
from odmoe.worker.device_slots import device_peak_bytes
from odmoe.worker.expert_store import DeviceSlots, ExpertKey, ExpertStore, Link, Slot


class LruExperts:
    """An experts call (see main_model.ExpertCall) computing locally through an LRU expert cache."""

    def __init__(
        self,
        store: ExpertStore,
        capacity: int,
        link: Link,
        kernel: str,
        hidden_act: str,
        experts: int,
        device: torch.device | None = None,
    ):
        self.slots = DeviceSlots(store, device or torch.device("cpu"), capacity, link)
        self.kernel, self.hidden_act, self.num_experts = kernel, hidden_act, experts
        self.cached: OrderedDict[ExpertKey, Slot] = OrderedDict()  # least recently used first
        self.hits = self.misses = 0

    def _fetch(self, key: ExpertKey) -> Slot:
        if key in self.cached:
            self.hits += 1
            self.cached.move_to_end(key)
            return self.cached[key]
        self.misses += 1
        if not self.slots.free:
            _, oldest = self.cached.popitem(last=False)
            self.slots.evict(oldest)
        slot = self.cached[key] = self.slots.load(key)  # over the emulated link
        return slot

    def __call__(self, layer, hidden, top_k_index, top_k_weights):
        parts = []
        for rows in split_by_expert(top_k_index, self.num_experts, self.kernel):
            slot = self._fetch((layer, rows.expert))
            self.slots.await_on_device(slot)  # CUDA: compute waits for the copy on the GPU
            parts.append(
                (
                    rows,
                    expert_forward(
                        hidden[rows.token_idx],
                        slot.gate_up,
                        slot.down,
                        self.hidden_act,
                        self.kernel,
                        (top_k_index.numel(), self.num_experts),
                    ),
                )
            )
        return combine(hidden, parts, top_k_weights, self.kernel)


class _Clock(BaseStreamer):
    """generate() hands its streamer the prompt first, then each new token: time them."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def timed_generate(model, ids: list[int], new_tokens: int, device: str = "cpu") -> dict:
    x = torch.tensor([ids], device=device)
    clock = _Clock()
    start = time.perf_counter()
    out = model.generate(
        x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens, streamer=clock
    )
    end = time.perf_counter()
    new = out[0, len(ids) :].tolist()
    first = clock.times[1]
    decode_s = clock.times[-1] - first
    return {
        "ttft_s": first - start,
        "decode_tokens_per_s": (len(new) - 1) / decode_s if len(new) > 1 and decode_s > 0 else 0.0,
        "overall_tokens_per_s": len(new) / (end - start),
        "new_tokens": len(new),
        "token_ids": new,
    }


def accelerate_max_memory(device: str, gpu_memory: str) -> dict:
    """accelerate's `max_memory` for one GPU with `gpu_memory` ("8GiB" or bytes) and the host for the
    rest. On a CPU device (the suite's dry run) everything goes to the host."""
    if torch.device(device).type == "cpu":
        return {"cpu": "1000GiB"}
    index = torch.device(device).index or 0
    return {index: int(gpu_memory) if gpu_memory.isdigit() else gpu_memory, "cpu": "1000GiB"}


def build(
    system: str,
    path: str,
    lru_experts: int,
    link: Link,
    dtype: str = "auto",
    device: str = "cpu",
    gpu_memory: str = "",
):
    """The model to generate with (at `dtype`, "auto": as saved, on `device`), its device bytes, and
    the LRU cache when there is one."""
    kwargs = {} if dtype == "auto" else {"dtype": resolve_dtype(dtype, open_checkpoint(path))}
    if system == "single_process":
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
        return model, sum(p.numel() * p.element_size() for p in model.parameters()), None
    if system == "accelerate_offload":
        if not gpu_memory:
            raise ValueError("accelerate_offload needs --gpu-memory (the GPU budget, e.g. 8GiB)")
        model = AutoModelForCausalLM.from_pretrained(
            path, device_map="auto", max_memory=accelerate_max_memory(device, gpu_memory), **kwargs
        ).eval()
        on_gpu = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "cpu")
        return model, on_gpu, None
    ckpt = open_checkpoint(path)
    main = build_main_model(ckpt, resolve_dtype(dtype, ckpt), device)
    store = ExpertStore.build(
        ckpt,
        ckpt.moe_layers,
        expert_dtype(ckpt.config, main.dtype),
        pin_memory=torch.device(device).type == "cuda",
    )
    lru = LruExperts(
        store,
        lru_experts,
        link,
        main.kernel,
        ckpt.config.hidden_act,
        ckpt.num_experts,
        torch.device(device),
    )
    main.attach(lru)
    return main.model, main.device_bytes + lru.slots.device_bytes, lru


def run_in_child(
    system: str, model_path: str, cells: list[dict], timeout: float | None = None, **flags
) -> dict:
    """One baseline in a process of its own (this module as a program), its report read back: each
    keyword a flag (lru_experts=8 is --lru-experts 8)."""
    with tempfile.TemporaryDirectory(prefix="odmoe-baseline-") as tmp:
        cells_file, out = Path(tmp) / "cells.json", Path(tmp) / "out.json"
        cells_file.write_text(json.dumps(cells))
        words = [w for key, value in flags.items() for w in (f"--{key.replace('_', '-')}", str(value))]
        command = [sys.executable, "-m", __name__, "--system", system, "--model", model_path]
        command += ["--cells", str(cells_file), "--out", str(out), *words]
        subprocess.run(command, check=True, timeout=timeout)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--system", choices=["single_process", "lru_offloader", "accelerate_offload"], required=True
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--cells", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lru-experts", type=int, default=16)
    parser.add_argument("--warmup-tokens", type=int, default=4, help="new tokens of the warm-up request")
    parser.add_argument("--bandwidth-gbps", type=float, default=0.0)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto", help="auto (as saved) | bfloat16 | float16 | float32")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:<i>")
    parser.add_argument(
        "--gpu-memory", default="", help="accelerate_offload: max_memory of the GPU, e.g. 8GiB"
    )
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    link = Link(args.bandwidth_gbps, args.latency_ms)
    model, device_bytes, lru = build(
        args.system, args.model, args.lru_experts, link, args.dtype, args.device, args.gpu_memory
    )
    cells = json.loads(Path(args.cells).read_text())
    timed_generate(model, cells[0]["prompts"][0], args.warmup_tokens, args.device)  # as the clusters get
    results = []
    for cell in cells:
        hits, misses = (lru.hits, lru.misses) if lru else (0, 0)
        loaded = lru.slots.counters.bytes_loaded if lru else 0
        runs = [timed_generate(model, ids, cell["new_tokens"], args.device) for ids in cell["prompts"]]
        entry = {"name": cell["name"], "runs": runs}
        if lru:
            looked_up = lru.hits - hits + lru.misses - misses
            entry["lru_hit_rate"] = (lru.hits - hits) / looked_up if looked_up else None
            entry["bytes_loaded"] = lru.slots.counters.bytes_loaded - loaded
        results.append(entry)
    report = {
        "system": args.system,
        "threads": args.threads,
        "lru_experts": args.lru_experts if lru else None,
        "emulated_link": [link.bandwidth_gbps, link.latency_ms] if lru and link.enabled else None,
        "peak_rss_bytes": peak_rss_bytes(),
        "device_bytes": device_bytes,
        "device": args.device,
        "device_peak_bytes": device_peak_bytes(args.device),
        "offloaded_modules": _offloaded(model) if args.system == "accelerate_offload" else None,
        "cells": results,
    }
    Path(args.out).write_text(json.dumps(report))


def _offloaded(model) -> dict:
    """accelerate's placement: how many top-level entries of `hf_device_map` went where."""
    return dict(Counter(str(device) for device in getattr(model, "hf_device_map", {}).values()))


if __name__ == "__main__":
    main()
