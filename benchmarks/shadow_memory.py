"""The shadow's memory and speed per precision: what it holds, what loading it peaks at, how fast it decodes.

    python -m odmoe_bench.shadow_memory --model /tmp/rw16 [--precisions fp32,bf16,int8_dynamic,int4,auto]
        [--whole int8_dynamic] [--tokens 16] [--rounds 3] [--threads 1] [--out FILE.json]

Memory: each precision loads in a process of its own (so `VmHWM`, the most resident memory a process
ever had, is that load's peak), which reports from /proc/self/status: its resident size with torch
and transformers imported (`base_rss`), the peak while loading (`peak_rss`, VmHWM right after the
load) and the resident size once loaded (`steady_rss`); `peak_over_steady` is what loading cost
beyond what stays, against `layer_bytes` (one decoder layer as stored, the bound the layer-by-layer
load aims at). `weight_bytes` is `model_bytes` (quantized tensors at their packed size) and
`held_rss` steady less base, what the weights really take (fbgemm's packing included), both also
over `bf16_bytes` (the model's tensors at 2 bytes each). `--whole P` also loads precision P the old
way (`load_whole_shadow_model`: from_pretrained at float32, then quantized).

Speed: one more process loads every precision and decodes greedily as the shadow node does
(DynamicCache, one token per forward) `--tokens` tokens after a 32-token prompt, the precisions in
turn for `--rounds` rounds, so a busy neighbour slows each alike; `ms_per_token` is the median
forward. `--threads` (default 1) intra-op threads: on a shared box a second thread's spin-waits
measure the neighbours, not the kernels.

A real-width checkpoint: `odmoe-make-model --family mixtral --layers 16 --hidden 1024 --intermediate
3584 --experts 8 --heads 16 --kv-heads 4 --dtype bfloat16 --fast-fill --out /tmp/rw16` (2.8 GiB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from odmoe.models.open_model import open_checkpoint
from odmoe.node_memory import process_memory
from odmoe_bench.results import write_report


def measure_memory(model_path: str, precision: str, whole: bool) -> dict:
    """In this process: load the shadow at `precision` (the module docstring's memory figures)."""
    import gc

    import torch

    from odmoe.models.load_dtypes import meta_skeleton
    from odmoe.shadow.precision import shadow_weight_bytes
    from odmoe.shadow.shadow_model import (
        load_shadow_model,
        load_whole_shadow_model,
        model_bytes,
        resolve_precision,
        weight_shapes,
    )

    checkpoint = open_checkpoint(model_path)
    chosen = resolve_precision(checkpoint, precision)  # auto: by this box's memory
    skeleton = meta_skeleton(checkpoint.config, torch.bfloat16)
    shapes = weight_shapes(skeleton, checkpoint.family.expert_layout)
    layer_bytes = max(
        sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in skeleton.model.layers
    )
    del checkpoint, skeleton
    gc.collect()
    base = process_memory()
    start = time.perf_counter()
    load = load_whole_shadow_model if whole else load_shadow_model
    model = load(model_path, chosen, "cpu")
    load_s = time.perf_counter() - start
    gc.collect()
    loaded = process_memory()
    bf16 = shadow_weight_bytes(shapes, "bf16")
    row = {
        "precision": precision,
        "chosen": chosen,
        "loader": "whole" if whole else "layers",
        "load_s": round(load_s, 1),
        "base_rss": base.resident,
        "peak_rss": loaded.peak,
        "steady_rss": loaded.resident,
        "peak_over_steady": loaded.peak - loaded.resident,
        "layer_bytes": layer_bytes,
        "weight_bytes": model_bytes(model),
        "estimated_bytes": shadow_weight_bytes(shapes, chosen),
        "held_rss": loaded.resident - base.resident,
        "bf16_bytes": bf16,
        "threads": torch.get_num_threads(),
    }
    row["weight_over_bf16"] = round(row["weight_bytes"] / bf16, 3)
    row["held_over_bf16"] = round(row["held_rss"] / bf16, 3)
    return row


def measure_speed(model_path: str, precisions: list[str], tokens: int, rounds: int) -> dict[str, float]:
    """In this process: every precision loaded, then decoded in turn (the module docstring's speed)."""
    import torch
    from transformers import DynamicCache

    from odmoe.shadow.shadow_model import load_shadow_model

    models = {p: load_shadow_model(model_path, p) for p in precisions}
    vocab = next(iter(models.values())).config.vocab_size
    prompt = torch.arange(32).remainder(vocab - 3).add(3)[None]  # [1, 32]
    times: dict[str, list[float]] = {p: [] for p in precisions}
    with torch.inference_mode():
        for _ in range(rounds):
            for precision, model in models.items():
                cache = DynamicCache(config=model.config)
                logits = model(
                    input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1
                ).logits
                for _ in range(tokens):
                    step = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
                    begin = time.perf_counter()
                    logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits
                    times[precision].append(time.perf_counter() - begin)
    return {p: round(1000 * statistics.median(t), 1) for p, t in times.items()}


HEADER = (
    f"{'precision':<18}{'loader':<8}{'load s':>8}{'peak':>8}{'steady':>8}{'over':>7}{'layer':>7}"
    f"{'weights':>9}{'/bf16':>7}{'held':>7}{'/bf16':>7}{'ms/tok':>8}   (GiB; ms/tok at --threads)"
)


def _line(row: dict) -> str:
    gib = 2**30
    name = row["precision"] if row["precision"] == row["chosen"] else f"auto:{row['chosen']}"
    sizes = [row["peak_rss"], row["steady_rss"], row["peak_over_steady"], row["layer_bytes"]]
    text = f"{name:<18}{row['loader']:<8}{row['load_s']:>8.1f}"
    text += "".join(f"{b / gib:>{8 if i < 2 else 7}.2f}" for i, b in enumerate(sizes))
    text += f"{row['weight_bytes'] / gib:>9.2f}{row['weight_over_bf16']:>7.3f}"
    text += f"{row['held_rss'] / gib:>7.2f}{row['held_over_bf16']:>7.3f}"
    return text + (f"{row['ms_per_token']:>8.1f}" if "ms_per_token" in row else f"{'-':>8}")


def _child(args: list[str]):
    done = subprocess.run(
        [sys.executable, "-m", "odmoe_bench.shadow_memory", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        print(f"{' '.join(args)}: failed\n{done.stderr[-3000:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory (see the docstring)")
    parser.add_argument("--precisions", default="fp32,bf16,int8_dynamic,int4,auto")
    parser.add_argument("--whole", default="", help="precisions also loaded the old way, comma-separated")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads while decoding")
    parser.add_argument(
        "--out", default="benchmarks/results/shadow_memory.json", help="(default: %(default)s)"
    )
    parser.add_argument("--memory", default="", help=argparse.SUPPRESS)  # a child: one precision's load
    parser.add_argument("--memory-whole", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--speed", action="store_true", help=argparse.SUPPRESS)  # a child: the decode
    args = parser.parse_args(argv)
    precisions = [p for p in args.precisions.split(",") if p]
    if args.memory:
        print(json.dumps(measure_memory(args.model, args.memory, args.memory_whole)))
        return
    if args.speed:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(measure_speed(args.model, precisions, args.tokens, args.rounds)))
        return
    rows = []
    for precision, whole in [(p, False) for p in precisions] + [
        (p, True) for p in args.whole.split(",") if p
    ]:
        row = _child(["--model", args.model, "--memory", precision] + (["--memory-whole"] if whole else []))
        if row is not None:
            rows.append(row)
    timed = list(dict.fromkeys(r["chosen"] for r in rows if r["loader"] == "layers"))
    speed = _child(
        ["--model", args.model, "--speed", "--precisions", ",".join(timed), "--tokens", str(args.tokens)]
        + ["--rounds", str(args.rounds), "--threads", str(args.threads)]
    )
    print(HEADER)
    for row in rows:
        if speed and row["loader"] == "layers":
            row["ms_per_token"], row["decode_threads"] = speed[row["chosen"]], args.threads
        print(_line(row), flush=True)
    write_report(args.out, {"model": args.model, "rows": rows})


if __name__ == "__main__":
    main()
