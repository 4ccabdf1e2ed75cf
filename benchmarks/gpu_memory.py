"""Each node's memory with the nodes on a GPU at real width (issue 45 on a lent GPU box), beside one
process running the same model, and whether the cluster's tokens are that process's.

    python -m odmoe_bench.gpu_memory --model DIR [--device cuda] [--new-tokens 16] [--out FILE.json]

One process: `from_pretrained(dtype=bfloat16)` on the device and greedy `generate` (in a child
process, so its peaks are its own): host VmHWM and CUDA's max_memory_allocated. The cluster: main,
the shadow (shadow.precision=auto: bitsandbytes int8 where the free device memory holds it) and 4
workers in 2 groups, each on the device, odmoe's defaults otherwise (worker.cache=auto: each worker
keeps on the device the experts it is home for; host memory holds only those): per node host VmHWM,
VmRSS split anonymous / file-backed, and CUDA's peak from the request's stats. Prints a table and
writes JSON. CPU runs (--device cpu) make a dry run of the same path.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from odmoe.node_memory import process_memory
from odmoe_bench.results import write_report

GiB = 1 << 30

ONE_PROCESS = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from odmoe.models.open_model import load_tokenizer
path, device, n, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
ids = load_tokenizer(path)(prompt, return_tensors="pt")["input_ids"].to(device)
out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
from odmoe.node_memory import process_memory
peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0
tokens = out[0, ids.shape[1]:].tolist()
print(json.dumps({"tokens": tokens, "host_peak": process_memory().peak, "device_peak": peak}))
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    size = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS, args.model, args.device, str(args.new_tokens), args.prompt],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"one process failed: {done.stderr[-3000:]}")
    one = json.loads(done.stdout.strip().splitlines()[-1])
    one["seconds"] = time.perf_counter() - start
    print(
        f"one process: host peak {one['host_peak'] / GiB:.2f} GiB, device peak "
        f"{one['device_peak'] / GiB:.2f} GiB ({one['seconds']:.0f} s)",
        flush=True,
    )

    from odmoe import LocalCluster

    d = args.device
    words = [f"model.device={d}", f"worker.device={d}", f"shadow.device={d}"]
    start = time.perf_counter()
    with LocalCluster(args.model, workers=4, group_size=2, overrides=words, ready_timeout_s=1200) as c:
        ready_s = time.perf_counter() - start
        c.client.generate(args.prompt, max_new_tokens=2)
        got = c.client.generate(args.prompt, max_new_tokens=args.new_tokens)
        nodes = {}
        for node in c.nodes:
            s = process_memory(node.process.pid)
            nodes[node.name] = {
                "host_peak": s.peak,
                "host_steady": s.resident,
                "anonymous": s.anonymous,
                "file_backed": s.file_backed,
                "ready_s": node.ready_s,
                "device_peak": got.stats["device_peak_bytes"].get(node.name, 0),
            }
        shadow = c.shadow_info
    report = {
        "model": args.model,
        "checkpoint_bytes": size,
        "device": d,
        "one_process": one,
        "cluster_ready_s": ready_s,
        "nodes": nodes,
        "shadow": shadow,
        "decode_tokens_per_s": got.stats["decode_tokens_per_s"],
        "identical": got.token_ids == one["tokens"],
    }
    print(
        f"checkpoint {size / GiB:.2f} GiB; cluster ready in {ready_s:.0f} s; identical {report['identical']}"
    )
    print("node      host peak  steady [anon + file]    device peak   ready s")
    for name, n in nodes.items():
        print(
            f"{name:9s} {n['host_peak'] / GiB:8.2f}  {n['host_steady'] / GiB:6.2f} "
            f"[{n['anonymous'] / GiB:.2f} + {n['file_backed'] / GiB:.2f}]   "
            f"{n['device_peak'] / GiB:8.2f}   {n['ready_s'] or 0:6.1f}"
        )
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()
