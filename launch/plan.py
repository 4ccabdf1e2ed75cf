"""`odmoe-launch role=plan`: each node's memory need for a checkpoint and a cluster shape, printed
without loading a tensor (the safetensors headers and the model's `meta` skeleton are all it reads).

    odmoe-launch role=plan model.path=/models/mixtral cluster.workers=4
    odmoe-launch role=plan model.path=DIR cluster.workers=4 node.memory=16GiB          # every box 16 GiB
    odmoe-launch role=plan model.path=DIR '+cluster.node_memory={worker0: 32GiB, shadow: 8GiB}'

Each node's memory is `cluster.node_memory`'s entry for it, else `node.memory`, else this machine's
figure (its cgroup's limit, else MemAvailable): what the node would find if it ran here. The shadow's
precision is resolved as the shadow would (`auto`: the best that fits). Exit code 0 when every node
fits, 1 when one does not (its line says what to change), 2 on bad input.
"""

from __future__ import annotations

import math

import torch

from odmoe.config import OdmoeConfig
from odmoe.memory_plan import (
    CheckpointSizes,
    NodeNeed,
    WorkerSetup,
    format_plan,
    plan_main,
    plan_shadow,
    plan_workers,
    worker_memories,
)
from odmoe.models.checkpoint import Checkpoint
from odmoe.models.families import layer_of_key
from odmoe.models.load_dtypes import meta_skeleton
from odmoe.models.main_model import resolve_dtype
from odmoe.models.open_model import open_checkpoint
from odmoe.node_memory import node_memory
from odmoe.shadow.precision import AUTO_CHOICES, PRECISIONS, choose_precision, shadow_weight_bytes
from odmoe.shadow.shadow_model import weight_shapes
from odmoe.tools.memory import parse_bytes


def shadow_estimates(checkpoint: Checkpoint) -> dict[str, int]:
    """The shadow's weight bytes at every precision, from the meta skeleton's shapes."""
    shapes = weight_shapes(meta_skeleton(checkpoint.config, torch.float32), checkpoint.family.expert_layout)
    itemsize = resolve_dtype("auto", checkpoint).itemsize
    return {p: shadow_weight_bytes(shapes, p, itemsize) for p in PRECISIONS if p != "auto"}


def largest_layer_bytes(checkpoint: Checkpoint) -> int:
    """The bytes of the largest decoder layer as read (safetensors: as on disk; GGUF: dequantized to
    float32): what the shadow holds at full precision while it quantizes one layer."""
    per_layer: dict[int, int] = {}
    for key in checkpoint.weight_map:
        layer = layer_of_key(key)
        if layer is not None:
            info = checkpoint.tensor_info(key)  # as held in memory (a GGUF tensor dequantized)
            per_layer[layer] = per_layer.get(layer, 0) + math.prod(info.shape) * info.dtype.itemsize
    return max(per_layer.values(), default=0)


def cluster_plan(cfg: OdmoeConfig, model_path: str) -> tuple[str, list[NodeNeed]]:
    """A header line and every node's need."""
    checkpoint = open_checkpoint(model_path)
    dtype = resolve_dtype(cfg.model.dtype, checkpoint)
    sizes = CheckpointSizes.of(checkpoint, dtype, shadow_estimates(checkpoint))
    here = node_memory(cfg.node.memory)
    named = cfg.cluster.node_memory

    def memory_of(node: str) -> tuple[int, str]:
        if node in named:
            return parse_bytes(named[node]), "cluster.node_memory"
        return here.bytes, here.source

    w, c = cfg.worker, cfg.cluster
    homes = str(w.cache).strip().lower() not in ("", "0", "none", "off")
    setup = WorkerSetup(
        c.workers,
        c.group_size,
        w.store,
        homes,
        w.slots,
        w.only_own_layers,
        w.replicas,
        parse_bytes(w.host_memory),
    )
    needs = [plan_main(sizes, *memory_of("main"), parse_bytes(cfg.server.kv_cache_memory))]
    if cfg.shadow.enabled and cfg.shadow.mode == "emulate":
        memory, source = memory_of("shadow")
        precision = cfg.shadow.precision
        if precision == "auto":
            device_type = "cuda" if cfg.shadow.device.startswith("cuda") else "cpu"
            choices = {p: sizes.shadow_bytes[p] for p in AUTO_CHOICES[device_type]}
            precision = choose_precision(choices, memory, device_type)
        needs.append(plan_shadow(sizes, precision, memory, source, largest_layer_bytes(checkpoint)))
    needs += plan_workers(
        sizes, setup, worker_memories(c.workers, (here.bytes, here.source), named, parse_bytes)
    )
    experts = sizes.experts * len(sizes.moe_layers)
    header = (
        f"odmoe plan: {model_path} ({checkpoint.family.model_type}, {sizes.disk_bytes / 2**30:.2f} GiB on "
        f"disk; {len(sizes.moe_layers)} MoE layers x {sizes.experts} experts = {experts} experts of "
        f"{sizes.expert_bytes / 2**20:.1f} MiB at {dtype}, {sizes.all_experts_bytes / 2**30:.2f} GiB; "
        f"the rest {sizes.non_expert_bytes / 2**30:.2f} GiB)\n"
        f"cluster: {c.workers} workers in groups of {c.group_size}, worker.store={w.store}, "
        f"worker.cache={w.cache}, shadow.precision={cfg.shadow.precision}"
    )
    return header, needs


def run_plan(cfg: OdmoeConfig, model_path: str) -> int:
    header, needs = cluster_plan(cfg, model_path)
    print(header)
    print(format_plan(needs))
    return 0 if all(n.fits for n in needs) else 1
