"""A checkpoint directory's index: every file's and every tensor's bytes and sha256 (safetensors, GGUF).

Contract (pure but for reading the directory):
- `build_index(directory)` lists the directory's regular files (not hidden ones, not this module's
  `SHARE_STATE` of a pulled copy) with size and sha256; for each `*.safetensors` file also where its
  header ends (8 bytes of length + the JSON header) and every tensor's absolute byte range and
  sha256; a `*.gguf` file the same (its header: metadata and tensor infos, up to the data section).
  Given a GGUF file rather than a directory, it indexes that file's shard set alone. Hashing reads
  every byte once; the result is kept in `cache_dir` under a key made of the directory's path and
  each file's size and mtime, so a second start reads nothing.
- `CheckpointIndex.to_json()` / `from_json()` round-trip it; `digest` names one index (a node that
  pulled from another index knows its copy is of another checkpoint).
- A node holding the index can tell which of its bytes are the checkpoint's without trusting the
  sender: every range it pulls is checked against the sha256 here (odmoe.models.share_pull).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from odmoe.models.gguf_files import gguf_layout, shard_set

log = logging.getLogger("odmoe.models.checkpoint_index")
SHARE_STATE = "odmoe-share.json"  # a pulled copy's record of what it holds (not the checkpoint's)
_HASH_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str
    header_end: int = 0  # safetensors: 8 + the header's length (the bytes before the first tensor)
    header_sha256: str = ""

    @property
    def head_bytes(self) -> int:
        """What every copy holds of it: the whole of a small file, a safetensors file's header."""
        return self.header_end or self.size


@dataclass(frozen=True)
class TensorEntry:
    name: str  # as the file names it
    file: str
    start: int  # absolute byte offset in `file`
    end: int
    sha256: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class CheckpointIndex:
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]

    def to_json(self) -> str:
        return json.dumps(
            {"files": [asdict(f) for f in self.files], "tensors": [asdict(t) for t in self.tensors]},
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> CheckpointIndex:
        data = json.loads(text)
        return cls(
            tuple(FileEntry(**f) for f in data["files"]), tuple(TensorEntry(**t) for t in data["tensors"])
        )

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def safetensors_layout(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(header end, {tensor: (absolute start, end)}) from a safetensors file's header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    end = 8 + length
    ranges = {
        name: (end + info["data_offsets"][0], end + info["data_offsets"][1])
        for name, info in header.items()
        if name != "__metadata__"
    }
    return end, ranges


def _sha256_range(f, start: int, end: int) -> str:
    digest = hashlib.sha256()
    f.seek(start)
    left = end - start
    while left > 0:
        chunk = f.read(min(left, _HASH_CHUNK))
        if not chunk:
            raise OSError(f"{f.name} ends before byte {end}")
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()


def _files(path: Path) -> list[Path]:
    """A directory's files; for a GGUF file, its shard set alone (its directory may hold others)."""
    if path.is_file():
        return [p for p in shard_set(path) if p.is_file()]
    return sorted(
        p for p in path.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != SHARE_STATE
    )


def _cache_key(directory: Path) -> str:
    facts = [str(directory.resolve())]
    for p in _files(directory):
        st = p.stat()
        facts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:32]


def build_index(directory: str | Path, cache_dir: str | Path | None = None) -> CheckpointIndex:
    """The directory's index (module contract), from `cache_dir` when its files have not changed;
    `directory` may also be a GGUF file: its shard set is indexed (names relative to its directory)."""
    directory = Path(directory)
    cached = Path(cache_dir) / f"{_cache_key(directory)}.json" if cache_dir else None
    if cached is not None and cached.is_file():
        return CheckpointIndex.from_json(cached.read_text())
    start, total = time.perf_counter(), sum(p.stat().st_size for p in _files(directory))
    files: list[FileEntry] = []
    tensors: list[TensorEntry] = []
    for p in _files(directory):
        with open(p, "rb") as f:
            whole = _sha256_range(f, 0, p.stat().st_size)
            if p.suffix in (".safetensors", ".gguf"):  # pulled sparse: the header, then tensor by tensor
                header_end, ranges = safetensors_layout(p) if p.suffix == ".safetensors" else gguf_layout(p)
                files.append(
                    FileEntry(p.name, p.stat().st_size, whole, header_end, _sha256_range(f, 0, header_end))
                )
                for name, (a, b) in sorted(ranges.items(), key=lambda kv: kv[1]):
                    tensors.append(TensorEntry(name, p.name, a, b, _sha256_range(f, a, b)))
            else:
                files.append(FileEntry(p.name, p.stat().st_size, whole))
    index = CheckpointIndex(tuple(files), tuple(tensors))
    log.info(
        "indexed %s: %d files, %d tensors, %.0f MiB in %.1f s",
        directory,
        len(files),
        len(tensors),
        total / 2**20,
        time.perf_counter() - start,
    )
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tmp.write_text(index.to_json())
        tmp.replace(cached)
    return index
