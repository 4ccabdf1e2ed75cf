"""One tensor, losslessly compressed as independent chunks: an entropy-coded exponent stream + raw bytes.

Contract: `compress(t)` returns a `CompressedTensor` (its layout) and the bytes it describes; the
bytes may live in memory (`MemoryBytes`) or in a pack file (`FileBytes`) — a chunk is found by its
offset either way. `decompress_chunk` reads one chunk, checks its checksum, decodes its exponent bytes
(zstd) and joins them with the raw sign+mantissa bytes straight into the destination's memory. Chunks
are independent, so several decompress at once on a thread pool (zstd, pread and the numpy join
release the GIL). A chunk whose bytes do not match its checksum, or that cannot be
read in full, raises `CorruptChunkError`: never wrong weights.

Chunk layout: [exponent stream: zstd frame, or the raw exponent bytes where zstd would not shrink
them] [rest: elems * (itemsize - 1) bytes], an xxh3-64 checksum over both (xxh3 rather than
zlib.crc32: ~3 us per 85 KiB chunk against ~50 us, beside ~50-70 us of zstd decoding).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import threading

import numpy as np
import torch
import xxhash
import zstandard

from odmoe.worker.bitfields import byte_view, join_into, split

DEFAULT_CHUNK_ELEMS = 1 << 16  # 64 Ki elements: 64 KiB of exponent per chunk, several chunks per expert
DEFAULT_LEVEL: int | None = None  # None: EXPONENT_PARAMS below; an int: that zstd level


def exponent_compressor(level: int | None = DEFAULT_LEVEL) -> zstandard.ZstdCompressor:
    """zstd for exponent bytes. An exponent stream is close to i.i.d. bytes of ~2.6 bits entropy: LZ
    matches do not pay there, Huffman-coded literals do. zstd's optimal parser (btultra) finds that;
    a short window and search keep it quick. On the trained model's bf16 exponents (H = 2.55 bits),
    64 Ki chunks (odmoe-bench suite=compression): level 3 takes 3.18 bits per exponent, these
    parameters 2.64, level 19 2.61 at a tenth of their compression speed."""
    if level is not None:
        return zstandard.ZstdCompressor(level=level)
    params = zstandard.ZstdCompressionParameters(
        window_log=16,
        chain_log=6,
        hash_log=6,
        search_log=1,
        min_match=7,
        target_length=4,
        strategy=zstandard.STRATEGY_BTULTRA,
    )
    return zstandard.ZstdCompressor(compression_params=params)


class CorruptChunkError(ValueError):
    """A chunk's bytes are missing or differ from what was written (bad checksum, truncated file)."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    offset: int  # where its bytes start in the tensor's byte source
    elems: int
    exponent_len: int  # bytes of the (coded or raw) exponent stream
    rest_len: int  # elems * (itemsize - 1)
    coded: bool  # exponent stream is a zstd frame (else stored raw: zstd would not have shrunk it)
    checksum: int  # xxh3-64 of the chunk's exponent_len + rest_len bytes

    @property
    def nbytes(self) -> int:
        return self.exponent_len + self.rest_len

    def to_list(self) -> list:
        return [self.offset, self.elems, self.exponent_len, self.rest_len, int(self.coded), self.checksum]

    @classmethod
    def from_list(cls, row: list) -> Chunk:
        offset, elems, exponent_len, rest_len, coded, checksum = row
        return cls(offset, elems, exponent_len, rest_len, bool(coded), checksum)


@dataclasses.dataclass(frozen=True)
class CompressedTensor:
    """Where one tensor's chunks lie (offsets into its byte source) and what it decompresses to."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        """Stored bytes: what moving this tensor costs."""
        return sum(c.nbytes for c in self.chunks)

    @property
    def raw_nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def rebased(self, delta: int) -> CompressedTensor:
        """The same chunks with offsets moved by delta (a byte range read out of a file into memory)."""
        chunks = tuple(dataclasses.replace(c, offset=c.offset + delta) for c in self.chunks)
        return CompressedTensor(self.dtype, self.shape, chunks)


class MemoryBytes:
    """A byte source in host memory."""

    def __init__(self, data: bytes):
        self.data = memoryview(data)

    def read(self, offset: int, length: int) -> memoryview:
        return self.data[offset : offset + length]


class FileBytes:
    """A byte source on disk, read with pread (thread-safe, no shared file position, releases the GIL)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._fd = os.open(self.path, os.O_RDONLY)

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def close(self) -> None:
        os.close(self._fd)


_local = threading.local()  # zstd (de)compressor objects are not thread-safe: one per thread


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "d"):
        _local.d = zstandard.ZstdDecompressor()
    return _local.d


def compress(
    t: torch.Tensor, chunk_elems: int = DEFAULT_CHUNK_ELEMS, level: int | None = DEFAULT_LEVEL, base: int = 0
) -> tuple[CompressedTensor, bytes]:
    """t's layout (chunk offsets start at `base`) and its bytes. t: a bf16/fp16/fp32 CPU tensor."""
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems must be at least 1, got {chunk_elems}")
    t = t.detach().cpu().contiguous()
    exponent, rest = split(t)  # [n], [n, itemsize-1]
    coder = exponent_compressor(level)
    parts, chunks, offset = [], [], base
    for start in range(0, exponent.shape[0], chunk_elems):  # over chunks, not elements
        exp = exponent[start : start + chunk_elems].tobytes()
        coded = coder.compress(exp)
        use = len(coded) < len(exp)
        stream = coded if use else exp
        raw = rest[start : start + chunk_elems].tobytes()
        checksum = xxhash.xxh3_64_intdigest(stream + raw)
        chunks.append(Chunk(offset, len(exp), len(stream), len(raw), use, checksum))
        parts += [stream, raw]
        offset += len(stream) + len(raw)
    return CompressedTensor(t.dtype, tuple(t.shape), tuple(chunks)), b"".join(parts)


def chunk_starts(ct: CompressedTensor) -> list[int]:
    """The first element index of each chunk."""
    return [0, *itertools.accumulate(c.elems for c in ct.chunks)][: len(ct.chunks)]


def decompress_chunk(ct: CompressedTensor, i: int, source, dest: np.ndarray, where: str = "") -> int:
    """Read, verify, decode chunk i of ct from `source` into dest (the chunk's [elems, itemsize]
    uint8 rows of the destination). Returns the bytes read. `where` names the tensor in errors."""
    c = ct.chunks[i]
    data = source.read(c.offset, c.nbytes)
    if len(data) != c.nbytes:
        raise CorruptChunkError(f"{where} chunk {i}: {len(data)} of {c.nbytes} bytes readable (truncated?)")
    if xxhash.xxh3_64_intdigest(data) != c.checksum:
        raise CorruptChunkError(f"{where} chunk {i}: checksum mismatch (the stored bytes were altered)")
    view = memoryview(data)
    stream, raw = view[: c.exponent_len], view[c.exponent_len :]
    if c.coded:
        try:
            exp = _decompressor().decompress(stream, max_output_size=c.elems)
        except zstandard.ZstdError as exc:
            raise CorruptChunkError(f"{where} chunk {i}: {exc}") from exc
    else:
        exp = stream
    exponent = np.frombuffer(exp, dtype=np.uint8)
    if exponent.shape[0] != c.elems:
        raise CorruptChunkError(f"{where} chunk {i}: {exponent.shape[0]} exponents, expected {c.elems}")
    rest = np.frombuffer(raw, dtype=np.uint8).reshape(c.elems, ct.dtype.itemsize - 1)
    join_into(dest, exponent, rest, ct.dtype)
    return c.nbytes


def decompress(ct: CompressedTensor, source, pool=None, where: str = "") -> torch.Tensor:
    """The whole tensor, decompressed into a new CPU tensor (chunks on `pool` when given)."""
    out = torch.empty(ct.shape, dtype=ct.dtype)
    rows = byte_view(out)
    starts = chunk_starts(ct)
    jobs = [(i, rows[s : s + c.elems]) for i, (s, c) in enumerate(zip(starts, ct.chunks, strict=True))]
    if pool is None:
        for i, dest in jobs:
            decompress_chunk(ct, i, source, dest, where)
    else:
        for f in [pool.submit(decompress_chunk, ct, i, source, dest, where) for i, dest in jobs]:
            f.result()
    return out


def to_dict(ct: CompressedTensor) -> dict:
    return {
        "dtype": str(ct.dtype).removeprefix("torch."),
        "shape": list(ct.shape),
        "chunks": [c.to_list() for c in ct.chunks],
    }


def from_dict(d: dict) -> CompressedTensor:
    return CompressedTensor(
        getattr(torch, d["dtype"]), tuple(d["shape"]), tuple(Chunk.from_list(r) for r in d["chunks"])
    )
