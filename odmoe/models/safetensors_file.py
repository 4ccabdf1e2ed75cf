"""One safetensors file read with plain `pread`s into buffers the caller chooses: no memory map.

Contract: `SafetensorsFile(path)` parses the header only (8 bytes of length, then JSON: each tensor's
dtype, shape and byte range). `info(key)` says what a tensor is without reading it; `read(key)` reads
it whole and `read_rows(key, index)` one slice of its first dimension (one expert of a fused
[E, ...] tensor), each into a new tensor or into `out` when given (same dtype and element count), so
a worker reads an expert straight into the buffer it computes from. `drop_cache(key)` asks the kernel
to forget the file's pages of that tensor (posix_fadvise DONTNEED), for bytes that are now held in a
buffer of their own; `prefetch(key)` to read them into its cache in the background (WILLNEED), for
bytes a read will want soon.

Why not `safetensors.safe_open`: it maps the whole file, and every page a read touches stays in the
process's resident memory (file-backed, `RssFile`) for as long as the handle lives, beside the copy
the reader made. A worker holding its share of the experts then showed twice its share resident, and
a cgroup counts both. A `pread` leaves no mapping: the only copy is the caller's buffer (the kernel's
page cache, which a memory limit reclaims first, aside).

A tensor `read` without `out` sits in memory at the address a memory map would give it, modulo the
page (its file offset modulo 4096), not wherever the allocator puts a new buffer: transformers'
`from_pretrained` computes with tensors over safetensors' mmap, and oneMKL's matmuls give other last
bits for other alignments of the same operands (Intel documents reproducibility for aligned memory
only). Main's non-expert tensors thus stay at the alignment the single-process reference has them at,
and its logits equal the reference's to the bit (a 64-byte aligned lm_head changed them).

Reads are thread-safe (`pread` takes its offset; nothing here keeps a file position).
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header
READ_CHUNK = 1 << 30  # one pread moves at most this (Linux caps a read near 2 GiB)


PAGE = 4096  # a memory map starts on a page: a mapped tensor's address is its file offset modulo this


def _placed_like_a_map(offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """An empty tensor whose address modulo PAGE equals `offset`'s, as over a memory map (module doc)."""
    buffer = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    shift = (offset - buffer.data_ptr()) % PAGE
    if shift % dtype.itemsize:  # an offset no map could hold this dtype at: a plain buffer
        return torch.empty(shape, dtype=dtype)
    return buffer[shift : shift + nbytes].view(dtype).view(shape)


class SafetensorsError(ValueError):
    """The file is not a safetensors file, or lacks a tensor asked for."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def row_bytes(self) -> int:
        """Bytes of one slice of the first dimension."""
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


class SafetensorsFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        self._lock = threading.Lock()  # guards closing only: preads need none
        try:
            self._infos, self.metadata = self._read_header()
        except Exception:
            os.close(self._fd)
            raise

    def _read_header(self) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        head = os.pread(self._fd, 8, 0)
        if len(head) != 8:
            raise SafetensorsError(f"{self.path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER:
            raise SafetensorsError(f"{self.path}: a header of {length} bytes is not a safetensors header")
        try:
            header = json.loads(os.pread(self._fd, length, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsError(f"{self.path}: unreadable safetensors header ({exc})") from None
        base = 8 + length
        metadata = header.pop("__metadata__", None) or {}
        infos = {}
        for key, entry in header.items():
            if entry["dtype"] not in DTYPES:
                raise SafetensorsError(f"{self.path}: tensor {key} has dtype {entry['dtype']}, not read here")
            begin, end = entry["data_offsets"]
            infos[key] = TensorInfo(DTYPES[entry["dtype"]], tuple(entry["shape"]), base + begin, base + end)
        return infos, metadata

    def keys(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, key: str) -> bool:
        return key in self._infos

    def info(self, key: str) -> TensorInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise SafetensorsError(f"tensor {key} is not in {self.path}") from None

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        info = self.info(key)
        return self._read_range(info.start, info.nbytes, info.dtype, info.shape, out)

    def read_rows(self, key: str, index: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """`tensor[index]` of a tensor's first dimension, reading only those bytes."""
        info = self.info(key)
        if not info.shape or not 0 <= index < info.shape[0]:
            raise SafetensorsError(f"{key} of shape {list(info.shape)} has no row {index}")
        rows = info.row_bytes
        return self._read_range(info.start + index * rows, rows, info.dtype, info.shape[1:], out)

    def _read_range(
        self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], out: torch.Tensor | None
    ) -> torch.Tensor:
        if out is None:
            out = _placed_like_a_map(offset, nbytes, dtype, shape)
        elif out.dtype != dtype or out.numel() != prod(shape) or not out.is_contiguous():
            raise SafetensorsError(
                f"cannot read {dtype} {list(shape)} into a {'' if out.is_contiguous() else 'non-contiguous '}"
                f"{out.dtype} {list(out.shape)}"
            )
        if nbytes:
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            done = 0
            while done < nbytes:
                n = os.preadv(self._fd, [view[done : done + READ_CHUNK]], offset + done)
                if n <= 0:
                    raise SafetensorsError(f"{self.path} ends before byte {offset + nbytes} (truncated?)")
                done += n
        return out

    def drop_cache(self, key: str, index: int | None = None) -> None:
        """Let the kernel drop this tensor's (or one row's) pages from its cache: their bytes are held
        elsewhere now. Advice only: nothing fails where the kernel ignores it."""
        self._advise(key, index, "POSIX_FADV_DONTNEED")

    def prefetch(self, key: str, index: int | None = None) -> None:
        """Ask the kernel to start reading this tensor's (or one row's) pages into its cache now, in
        the background, so that a `read` soon after finds them there."""
        self._advise(key, index, "POSIX_FADV_WILLNEED")

    def _advise(self, key: str, index: int | None, advice: str) -> None:
        info = self.info(key)
        start, length = info.start, info.nbytes
        if index is not None:
            start, length = start + index * info.row_bytes, info.row_bytes
        if hasattr(os, advice):
            try:
                os.posix_fadvise(self._fd, start, length, getattr(os, advice))
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
