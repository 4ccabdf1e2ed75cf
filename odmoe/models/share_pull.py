"""A node that lacks the checkpoint pulls only its share of it from a box that has it.

Contract: `pull_share(stub, dest, choose, ...)` asks the source's `Share` service (odmoe.transport.
share_server) for its index, then makes `dest` a copy of the checkpoint in which only the chosen
tensors hold bytes:
- every file that is not safetensors (config, tokenizer, index JSON...) is pulled whole;
- every safetensors file is made at its full size as a sparse file, its header pulled, so the
  layout and every reader of it are the checkpoint's own; `choose(index, dest)` (called once the
  headers are there, so it may open `dest` as a checkpoint) names the tensors to fill, and only
  their byte ranges are pulled. Unfilled ranges are holes: no disk used, and
  odmoe.models.checkpoint refuses to read a tensor that is not recorded as pulled, so a hole is
  never read as zeros.
- every file, header and tensor is checked against the index's sha256 before it counts; the record
  (`SHARE_STATE` in `dest`) lists what is verified, written after each tensor, so an interrupted
  pull resumes where it stopped (by tensor) and a second start with everything there pulls nothing.
  A source whose index changed (another checkpoint at the same address) keeps only the tensors
  whose bytes and place are the same.
- `rate_bytes_s` caps the pull's rate (0: none) so it does not starve serving traffic; progress
  (bytes of bytes, rate, ETA) is logged every `progress_s`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from odmoe.models.checkpoint_index import SHARE_STATE, CheckpointIndex, FileEntry, TensorEntry
from odmoe.rpc import odmoe_pb2

log = logging.getLogger("odmoe.models.share_pull")


class ShareError(RuntimeError):
    """A pulled range does not match the index (or the source ended early): nothing wrong is kept."""


@dataclass(frozen=True)
class PullReport:
    pulled_bytes: int  # moved this time
    share_bytes: int  # what this node holds of the checkpoint (files + headers + chosen tensors)
    checkpoint_bytes: int  # the whole checkpoint's
    tensors_pulled: int
    seconds: float

    def line(self) -> str:
        return (
            f"pulled {self.pulled_bytes / 2**20:.1f} MiB in {self.seconds:.1f} s; this box holds "
            f"{self.share_bytes / 2**20:.1f} of the checkpoint's {self.checkpoint_bytes / 2**20:.1f} MiB "
            f"({100 * self.share_bytes / max(self.checkpoint_bytes, 1):.1f} %)"
        )


class _Progress:
    def __init__(self, total: int, every_s: float, rate_bytes_s: float):
        self.total, self.every_s, self.rate = total, every_s, rate_bytes_s
        self.done = 0
        self.start = self.last = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.rate > 0:  # the budget: never ahead of rate x elapsed
            ahead = self.done / self.rate - (now - self.start)
            if ahead > 0:
                time.sleep(ahead)
                now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            log.info(
                "pulling the checkpoint's share: %.0f of %.0f MiB (%.0f %%, %.1f MiB/s, ETA %.0f s)",
                self.done / 2**20,
                self.total / 2**20,
                100 * self.done / max(self.total, 1),
                rate / 2**20,
                eta,
            )


class _State:
    """What `dest` holds, verified: {file: sha256} and {tensor: [file, start, end, sha256]}."""

    def __init__(self, dest: Path):
        self.path = dest / SHARE_STATE
        data = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.files: dict[str, str] = data.get("files", {})
        self.tensors: dict[str, list] = data.get("tensors", {})
        self.digest: str = data.get("index", "")
        self.pulled_total: int = data.get("pulled_bytes_total", 0)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "index": self.digest,
                    "files": self.files,
                    "tensors": self.tensors,
                    "pulled_bytes_total": self.pulled_total,
                },
                sort_keys=True,
            )
        )
        tmp.replace(self.path)


def _record(t: TensorEntry) -> list:
    return [t.file, t.start, t.end, t.sha256]


def pull_share(
    stub,
    dest: str | Path,
    choose: Callable[[CheckpointIndex, Path], set[str]] | None = None,
    rate_bytes_s: float = 0.0,
    progress_s: float = 2.0,
    metadata=None,
) -> PullReport:
    """Make `dest` hold the chosen tensors of the source's checkpoint (module contract); `choose`
    None: every tensor. `stub` is an `odmoe_pb2_grpc.ShareStub`, or several: sources of the same
    checkpoint (main, seeds), asked in turn (one that cannot be reached, or serves another index,
    is passed over; one lost mid-pull hands the tensor it was sending to the next)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    reader = _Reader(stub if isinstance(stub, list | tuple) else [stub], metadata)
    index = reader.index()
    state = _State(dest)
    by_name = {t.name: t for t in index.tensors}
    # tensors kept from an earlier pull: the same bytes in the same place
    state.tensors = {n: r for n, r in state.tensors.items() if n in by_name and r == _record(by_name[n])}
    state.digest = index.digest
    header_total = sum(f.head_bytes for f in index.files)
    progress = _Progress(header_total, progress_s, rate_bytes_s)
    # 1) every file: whole, or sparse with its header
    pulled = sum(_retrying(reader, _file, reader, dest, f, state, progress) for f in index.files)
    state.save()
    # 2) the chosen tensors not held yet, in file order
    wanted = set(by_name) if choose is None else choose(index, dest)
    if unknown := wanted - set(by_name):
        raise ShareError(f"the source's index has no tensor(s) {sorted(unknown)[:3]}")
    todo = [by_name[n] for n in sorted(wanted, key=lambda n: (by_name[n].file, by_name[n].start))]
    todo = [t for t in todo if t.name not in state.tensors]
    progress.total = progress.done + sum(t.nbytes for t in todo)
    pulled += _tensors(reader, dest, todo, state, progress)
    share = header_total + sum(by_name[n].nbytes for n in state.tensors)
    report = PullReport(pulled, share, index.total_bytes, len(todo), time.perf_counter() - start)
    log.info("%s: %s", dest, report.line())
    return report


def _retrying(reader: _Reader, pull: Callable, *args):
    """`pull(*args)`, from its start again on the next source while a source is lost during it."""
    while True:
        try:
            return pull(*args)
        except grpc.RpcError as exc:
            reader.lost(exc)


def _tensors(reader: _Reader, dest: Path, todo: list[TensorEntry], state: _State, progress: _Progress) -> int:
    """Each tensor of `todo` into its place in its sparse file, checked; returns the bytes pulled."""
    fds: dict[str, int] = {}
    try:
        last_save = time.perf_counter()
        for t in todo:
            fd = fds.get(t.file) or fds.setdefault(t.file, os.open(dest / t.file, os.O_WRONLY))
            if _retrying(reader, _tensor, reader, fd, t, progress) != (t.end, t.sha256):
                raise ShareError(f"{t.file}: tensor {t.name} pulled does not match the index's sha256")
            state.pulled_total += t.nbytes
            state.tensors[t.name] = _record(t)
            if time.perf_counter() - last_save >= 1.0:  # resumable by tensor, without a write per tensor
                state.save()
                last_save = time.perf_counter()
    finally:
        for fd in fds.values():
            os.fsync(fd)
            os.close(fd)
        state.save()
    return sum(t.nbytes for t in todo)


def _tensor(reader: _Reader, fd: int, t: TensorEntry, progress: _Progress) -> tuple[int, str]:
    """One tensor's bytes written at its place; returns (the offset it ended at, their sha256)."""
    digest = hashlib.sha256()
    at = t.start
    for data in reader.read(t.file, t.start, t.nbytes):
        os.pwrite(fd, data, at)
        digest.update(data)
        at += len(data)
        progress.add(len(data))
    return at, digest.hexdigest()


class _Reader:
    """Reads from the first source that answers; `lost` moves to the next one serving the same index."""

    def __init__(self, stubs: list, metadata):
        self.stubs, self.metadata, self.at, self.digest = list(stubs), metadata, 0, ""

    @property
    def stub(self):
        return self.stubs[self.at]

    def index(self) -> CheckpointIndex:
        """The first reachable source's index (the one every other source must serve too)."""
        while True:
            try:
                reply = self.stub.Index(odmoe_pb2.ShareIndexRequest(), metadata=self.metadata)
            except grpc.RpcError as exc:
                self.lost(exc)
                continue
            index = CheckpointIndex.from_json(reply.index_json)
            if self.digest and index.digest != self.digest:
                log.warning("source %d serves another checkpoint: passed over", self.at)
                self._next(f"source {self.at} serves another checkpoint")
                continue
            self.digest = index.digest
            return index

    def lost(self, exc: grpc.RpcError) -> None:
        """The current source failed: the next one (checked to serve the same index), or ShareError."""
        self._next(f"{exc.code().name}: {exc.details()}")
        if self.digest:
            self.index()

    def _next(self, why: str) -> None:
        if self.at + 1 >= len(self.stubs):
            raise ShareError(f"no source left to pull from (the last: {why})")
        log.warning("pull source %d failed (%s): going on from source %d", self.at, why, self.at + 1)
        self.at += 1

    def read(self, file: str, offset: int, length: int):
        request = odmoe_pb2.ShareReadRequest(file=file, offset=offset, length=length)
        got = 0
        for chunk in self.stub.Read(request, metadata=self.metadata):
            got += len(chunk.data)
            yield chunk.data
        if got != length:
            raise ShareError(f"{file}: the source sent {got} of {length} bytes at {offset}")


def _file(reader: _Reader, dest: Path, f: FileEntry, state: _State, progress: _Progress) -> int:
    """One file of the index in place at `dest` (whole, or a sparse safetensors file with its
    header); returns the bytes pulled."""
    path = dest / f.name
    if not f.header_end:  # a small file, pulled whole
        if state.files.get(f.name) == f.sha256 and path.is_file() and path.stat().st_size == f.size:
            return 0
        data = b"".join(reader.read(f.name, 0, f.size))
        if hashlib.sha256(data).hexdigest() != f.sha256:
            raise ShareError(f"{f.name} pulled does not match the index's sha256")
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(data)
        tmp.replace(path)
        state.files[f.name] = f.sha256
        progress.add(len(data))
        return len(data)
    if state.files.get(f.name) == f.header_sha256 and path.is_file() and path.stat().st_size == f.size:
        return 0
    # another layout (or none yet): a new sparse file; its tensors recorded before no longer hold
    state.tensors = {n: r for n, r in state.tensors.items() if r[0] != f.name}
    header = b"".join(reader.read(f.name, 0, f.header_end))
    if hashlib.sha256(header).hexdigest() != f.header_sha256:
        raise ShareError(f"{f.name}: its header pulled does not match the index's sha256")
    with open(path, "wb") as out:
        out.truncate(f.size)
        out.write(header)
    state.files[f.name] = f.header_sha256
    progress.add(len(header))
    return len(header)
