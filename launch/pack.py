"""`odmoe-pack`: compress a checkpoint's experts once into the pack file workers read.

    odmoe-pack /models/mixtral        # -> /models/mixtral/odmoe-pack/experts-<dtype>.odmoepack
    odmoe-pack /models/mixtral --out DIR --dtype bfloat16 --dtype float32

Writes one file per dtype (with a progress line), then verifies it by decompressing every expert
from the written file and comparing its bits with the checkpoint's, and prints the stored size per
dtype and tensor kind (gate_up / down). Workers with `worker.store=compressed|disk` use the pack
when `worker.pack_dir` (default MODEL/odmoe-pack) holds one for their dtype. Exit codes: 0 written
and verified, 1 verification failed, 2 bad arguments or checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from odmoe.models.checkpoint import Checkpoint, CheckpointError
from odmoe.models.families import UnsupportedModelError
from odmoe.models.load_dtypes import expert_dtype
from odmoe.models.main_model import resolve_dtype
from odmoe.models.open_model import open_checkpoint
from odmoe.worker.compressed_tensor import DEFAULT_CHUNK_ELEMS, DEFAULT_LEVEL, decompress
from odmoe.worker.expert_pack import PACK_DIR, ExpertPack, PackError, dtype_name, write_pack

KINDS = ("gate_up", "down")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="odmoe-pack", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--out", default=None, help=f"output directory (default MODEL/{PACK_DIR})")
    parser.add_argument(
        "--dtype",
        action="append",
        default=None,
        help="auto (as saved) | bfloat16 | float16 | float32; repeat for several packs (default auto)",
    )
    parser.add_argument("--chunk-elems", type=int, default=DEFAULT_CHUNK_ELEMS, help="elements per chunk")
    parser.add_argument(
        "--level",
        type=int,
        default=DEFAULT_LEVEL,
        help="zstd level of the exponent stream (default: odmoe's parameters, see compressed_tensor.py)",
    )
    return parser.parse_args(argv)


def _progress(done: int, total: int, key: tuple[int, int]) -> None:
    end = "\n" if done == total else ""
    print(f"\r  compressing expert {done}/{total} (layer {key[0]}, expert {key[1]})", end=end, flush=True)


def verify(path, checkpoint: Checkpoint, dtype: torch.dtype) -> dict[str, list[int]]:
    """Decompress every expert from the written file; compare bits with the checkpoint's at `dtype`.
    Returns per kind [raw bytes, stored bytes]; raises PackError on the first difference."""
    pack = ExpertPack(path, checkpoint)
    sizes = {kind: [0, 0] for kind in KINDS}
    ints = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    for key, packed in pack.experts.items():
        want = checkpoint.expert(*key)
        for kind in KINDS:
            ct = getattr(packed, kind)
            got = decompress(ct, pack.bytes, where=f"expert {key} {kind}")
            expected = getattr(want, kind).to(dtype).contiguous()
            if got.shape != expected.shape or not torch.equal(got.view(ints), expected.view(ints)):
                raise PackError(f"{path}: expert {key} {kind} does not decompress to the checkpoint's bits")
            sizes[kind][0] += ct.raw_nbytes
            sizes[kind][1] += ct.nbytes
    return sizes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        checkpoint = open_checkpoint(args.model)
        # Packed at the dtype the experts load in (from_pretrained's rule, not always --dtype's).
        asked = [resolve_dtype(name, checkpoint) for name in (args.dtype or ["auto"])]
        dtypes = [expert_dtype(checkpoint.config, dtype) for dtype in asked]
    except (CheckpointError, UnsupportedModelError, ValueError) as exc:
        print(f"odmoe-pack: {exc}", file=sys.stderr)
        return 2
    if form := checkpoint.quantized_experts:  # nothing to gain: workers keep them as stored
        expert = checkpoint.quantized_expert(checkpoint.moe_layers[0], 0)
        print(
            f"odmoe-pack: {checkpoint.path}'s experts are {form.upper()} ({expert.nbytes} bytes each with "
            "their scales): workers keep them as stored (worker.store=memory) and move those bytes; "
            "nothing to pack"
        )
        return 0
    out = args.out or str(checkpoint.path / PACK_DIR)
    rows = []
    for dtype in dtypes:
        print(f"{checkpoint.path} -> {out} at {dtype_name(dtype)}", flush=True)
        start = time.perf_counter()
        try:
            path = write_pack(checkpoint, out, dtype, args.chunk_elems, args.level, progress=_progress)
        except ValueError as exc:  # an unsupported dtype, a bad chunk size
            print(f"odmoe-pack: {exc}", file=sys.stderr)
            return 2
        written = time.perf_counter() - start
        try:
            sizes = verify(path, checkpoint, dtype)
        except (PackError, ValueError) as exc:
            print(f"odmoe-pack: verification failed: {exc}", file=sys.stderr)
            return 1
        print(f"  wrote {path} ({path.stat().st_size / 2**20:.2f} MiB, {written:.1f}s); verified bit-exact")
        rows += [(dtype_name(dtype), kind, *sizes[kind]) for kind in KINDS]
    print(f"\n{'dtype':<10}{'tensor':<9}{'raw MiB':>10}{'stored MiB':>12}{'stored/raw':>12}")
    for name, kind, raw, stored in rows:
        print(f"{name:<10}{kind:<9}{raw / 2**20:10.2f}{stored / 2**20:12.2f}{stored / max(raw, 1):12.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
