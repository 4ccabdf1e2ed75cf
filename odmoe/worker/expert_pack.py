"""The pack file: every expert of a checkpoint, compressed once at one dtype (written by `odmoe-pack`).

Contract: `write_pack(checkpoint, out_dir, dtype)` writes `out_dir/experts-<dtype>.odmoepack` and
returns its path; `ExpertPack(path, checkpoint)` opens one, checking everything that can be checked
without reading the experts: the magic, the header's CRC32, that the file is as long as the header
says (a truncated file is an error here, not at some later load), that it was written from this
checkpoint (a fingerprint of its shard files) and at which dtype. Each chunk carries its own CRC32,
checked on every read (odmoe.worker.compressed_tensor), so a flipped byte anywhere is a clear error.

Layout: b"ODMOEPK1" | u64 header length | u32 header CRC32 | header (JSON) | data. Chunk offsets in
the header are relative to the start of the data; an expert's two tensors lie next to each other, so
one read brings a whole expert into memory.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from odmoe.models.checkpoint import Checkpoint
from odmoe.worker.compressed_tensor import (
    DEFAULT_CHUNK_ELEMS,
    DEFAULT_LEVEL,
    CompressedTensor,
    FileBytes,
    compress,
    from_dict,
    to_dict,
)

MAGIC = b"ODMOEPK1"
_PREFIX = struct.Struct("<8sQI")  # magic, header length, header crc32
FORMAT_VERSION = 1
PACK_DIR = "odmoe-pack"  # default place, inside the model directory
ExpertKey = tuple[int, int]


class PackError(ValueError):
    """The pack file is unreadable, truncated, corrupt, or was written from another checkpoint."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack_path(directory: str | os.PathLike, dtype: torch.dtype) -> Path:
    return Path(directory) / f"experts-{dtype_name(dtype)}.odmoepack"


def checkpoint_fingerprint(checkpoint: Checkpoint) -> dict[str, list[int]]:
    """Per shard file: its size, the CRC32 of its safetensors header and of 16 samples of 4 KiB spread
    over it. Cheap at every worker start; it catches a re-saved or retrained checkpoint. (Weights
    changed outside every sampled range and with identical shapes would go unnoticed: re-run
    odmoe-pack after changing weights.)"""
    out = {}
    for shard in sorted(set(checkpoint.weight_map.values())):
        path = checkpoint.path / shard
        size = path.stat().st_size
        with open(path, "rb") as f:
            head_len = struct.unpack("<Q", f.read(8))[0]
            crcs = [zlib.crc32(f.read(head_len))]
            for k in range(16):
                f.seek(size * k // 16)
                crcs.append(zlib.crc32(f.read(4096)))
        out[shard] = [size, *crcs]
    return out


@dataclass(frozen=True)
class PackedExpert:
    gate_up: CompressedTensor
    down: CompressedTensor

    @property
    def span(self) -> tuple[int, int]:
        """[start, end) of the expert's bytes in the data region."""
        chunks = self.gate_up.chunks + self.down.chunks
        if not chunks:
            return 0, 0
        return min(c.offset for c in chunks), max(c.offset + c.nbytes for c in chunks)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


def write_pack(
    checkpoint: Checkpoint,
    out_dir: str | os.PathLike,
    dtype: torch.dtype,
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    level: int | None = DEFAULT_LEVEL,
    progress: Callable[[int, int, ExpertKey], None] | None = None,
) -> Path:
    """Compress every expert of every MoE layer at `dtype` into one pack file (written to a temporary
    name first and renamed, so a crash never leaves a half-written pack where workers look)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = [(layer, e) for layer in checkpoint.moe_layers for e in range(checkpoint.num_experts)]
    experts, offset = {}, 0
    with tempfile.TemporaryFile(dir=out_dir) as data:
        for n, key in enumerate(keys):
            w = checkpoint.expert(*key)
            entry = {}
            for kind, t in (("gate_up", w.gate_up), ("down", w.down)):
                ct, blob = compress(t.to(dtype), chunk_elems, level, base=offset)
                data.write(blob)
                offset += len(blob)
                entry[kind] = to_dict(ct)
            experts[f"{key[0]}.{key[1]}"] = entry
            if progress:
                progress(n + 1, len(keys), key)
        header = json.dumps(
            {
                "format": FORMAT_VERSION,
                "dtype": dtype_name(dtype),
                "chunk_elems": chunk_elems,
                "level": level,
                "data_bytes": offset,
                "checkpoint": checkpoint_fingerprint(checkpoint),
                "experts": experts,
            }
        ).encode()
        target = pack_path(out_dir, dtype)
        tmp = target.with_suffix(".partial")
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, len(header), zlib.crc32(header)))
            f.write(header)
            data.seek(0)
            while block := data.read(1 << 24):
                f.write(block)
        os.replace(tmp, target)
    return target


class ExpertPack:
    """An opened pack file: every expert's chunk layout, its bytes read on demand (pread)."""

    def __init__(self, path: str | os.PathLike, checkpoint: Checkpoint | None = None):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                prefix = f.read(_PREFIX.size)
                if len(prefix) < _PREFIX.size:
                    raise PackError(f"{self.path}: truncated ({size} bytes, not even a header)")
                magic, header_len, header_crc = _PREFIX.unpack(prefix)
                if magic != MAGIC:
                    raise PackError(f"{self.path}: not an odmoe pack file (magic {magic!r})")
                header = f.read(header_len)
        except OSError as exc:
            raise PackError(f"{self.path}: {exc}") from exc
        if len(header) != header_len:
            raise PackError(f"{self.path}: truncated inside its header ({size} bytes)")
        if zlib.crc32(header) != header_crc:
            raise PackError(f"{self.path}: header checksum mismatch (the file is corrupt)")
        meta = json.loads(header)
        if meta.get("format") != FORMAT_VERSION:
            raise PackError(f"{self.path}: format {meta.get('format')}, this odmoe reads {FORMAT_VERSION}")
        data_start = _PREFIX.size + header_len
        if size != data_start + meta["data_bytes"]:
            raise PackError(
                f"{self.path}: {size} bytes but its header describes {data_start + meta['data_bytes']} "
                "(truncated or appended to); re-run odmoe-pack"
            )
        if checkpoint is not None and meta["checkpoint"] != checkpoint_fingerprint(checkpoint):
            raise PackError(
                f"{self.path} was written from another checkpoint than {checkpoint.path}; re-run odmoe-pack"
            )
        self.dtype: torch.dtype = getattr(torch, meta["dtype"])
        self.chunk_elems, self.level = meta["chunk_elems"], meta["level"]
        self.experts: dict[ExpertKey, PackedExpert] = {}
        for name, entry in meta["experts"].items():
            layer, e = (int(x) for x in name.split("."))
            self.experts[(layer, e)] = PackedExpert(
                from_dict(entry["gate_up"]).rebased(data_start), from_dict(entry["down"]).rebased(data_start)
            )
        self.bytes = FileBytes(self.path)  # chunk offsets above are now absolute file offsets

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self.experts

    def __getitem__(self, key: ExpertKey) -> PackedExpert:
        return self.experts[key]

    def read_expert(self, key: ExpertKey) -> tuple[bytes, PackedExpert]:
        """One expert's bytes in host memory and its layout rebased onto them (chunks still checked)."""
        packed = self.experts[key]
        start, end = packed.span
        data = self.bytes.read(start, end - start)
        if len(data) != end - start:
            raise PackError(f"{self.path}: expert {key} cut short ({len(data)} of {end - start} bytes)")
        return data, PackedExpert(packed.gate_up.rebased(-start), packed.down.rebased(-start))
