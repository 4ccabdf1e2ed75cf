"""Where one expert rests on a worker, and how it is moved into a device slot from there.

Contract: every source answers `load_into(gate_up, down, pool) -> bytes moved` (it writes the
expert's exact bits into the two slot tensors) and says its `form` and the `host_bytes` it keeps in
host memory:

- `HostExpert`: decompressed in host memory ("decompressed"): two copies.
- `CompressedExpert`: chunks in host memory ("compressed") or in a pack file on disk ("disk").
- `CheckpointExpert`: nothing held; the checkpoint's safetensors are read on each load ("disk").
- `QuantizedHostExpert`: an FP8 checkpoint's expert as stored, one byte a weight plus its block
  scales ("fp8"), gpt-oss's MXFP4 one, half a byte a weight plus a byte per 32 ("mxfp4"), or a GGUF
  file's rows of its `ffn_*_exps` blocks ("gguf": Q4_K ~0.56 bytes a weight), dequantized into the
  slot exactly as transformers dequantizes it.

Bytes moved is what a load costs on the emulated link: the stored (compressed) bytes for a
compressed expert — moving fewer bytes is the point of compressing — the FP8 bytes and scales for
an FP8 expert, the raw bytes otherwise.

A compressed load is a small task graph per chunk, read -> check -> decompress -> recombine, on the
store's thread pool: chunks are independent, so while one decompresses an earlier one is already
recombined into the slot (on a CPU device recombining *is* the copy into the slot; on a CUDA device
each chunk is recombined into pinned host memory and copied to the device as soon as it is done,
while later chunks are still decompressing).
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor, as_completed

import torch

from odmoe.models.checkpoint import Checkpoint, ExpertWeights
from odmoe.models.fp8 import QuantizedExpert
from odmoe.models.gguf_checkpoint import GgufExpert
from odmoe.models.mxfp4 import Mxfp4Expert
from odmoe.worker.bitfields import byte_view
from odmoe.worker.compressed_tensor import CompressedTensor, chunk_starts, decompress, decompress_chunk

FORMS = ("decompressed", "compressed", "fp8", "mxfp4", "gguf", "disk")


class HostExpert:
    form = "decompressed"

    def __init__(self, weights: ExpertWeights):
        self.weights = weights
        self.host_bytes = self.stored_bytes = weights.nbytes

    def load_into(self, gate_up: torch.Tensor, down: torch.Tensor, pool: Executor | None = None) -> int:
        gate_up.copy_(self.weights.gate_up, non_blocking=True)
        down.copy_(self.weights.down, non_blocking=True)
        return self.weights.nbytes

    def weights_now(self, pool: Executor | None = None) -> ExpertWeights:
        return self.weights


class QuantizedHostExpert:
    """An FP8, MXFP4 or GGUF expert as its checkpoint stores it (form "fp8" / "mxfp4" / "gguf")."""

    def __init__(self, expert: QuantizedExpert | Mxfp4Expert | GgufExpert, dtype: torch.dtype):
        self.expert, self.dtype = expert, dtype  # dtype: the slot's, what transformers casts to
        self.form = expert.form
        self.host_bytes = self.stored_bytes = expert.nbytes

    def load_into(self, gate_up: torch.Tensor, down: torch.Tensor, pool: Executor | None = None) -> int:
        self.expert.load_into(gate_up, down)
        return self.stored_bytes

    def weights_now(self, pool: Executor | None = None) -> ExpertWeights:
        gate_up, down = (torch.empty(shape, dtype=self.dtype) for shape in self.expert.shapes)
        self.expert.load_into(gate_up, down)
        return ExpertWeights(gate_up, down)


class CompressedExpert:
    """`source` is a MemoryBytes (form "compressed") or the pack's FileBytes (form "disk")."""

    def __init__(self, gate_up: CompressedTensor, down: CompressedTensor, source, on_disk: bool, name: str):
        self.gate_up, self.down, self.source, self.name = gate_up, down, source, name
        self.form = "disk" if on_disk else "compressed"
        self.stored_bytes = gate_up.nbytes + down.nbytes
        self.host_bytes = 0 if on_disk else self.stored_bytes

    def load_into(self, gate_up: torch.Tensor, down: torch.Tensor, pool: Executor | None = None) -> int:
        targets = [(self.gate_up, gate_up, "gate_up"), (self.down, down, "down")]
        if gate_up.device.type == "cpu":
            _chunks_into_host(targets, self.source, pool, self.name)
        else:
            _chunks_into_device(targets, self.source, pool, self.name)
        return self.stored_bytes

    def verify(self) -> None:
        """Check every chunk's checksum (and that it decodes) without keeping the result."""
        self.weights_now()

    def weights_now(self, pool: Executor | None = None) -> ExpertWeights:
        return ExpertWeights(
            decompress(self.gate_up, self.source, pool, f"{self.name} gate_up"),
            decompress(self.down, self.source, pool, f"{self.name} down"),
        )


def _chunk_jobs(targets, staging: list[torch.Tensor]):
    """(tensor layout, chunk index, destination rows, where) for every chunk of every target."""
    for (ct, _, kind), host in zip(targets, staging, strict=True):
        rows = byte_view(host)  # [n, itemsize] uint8 view of the destination's memory
        for i, start in enumerate(chunk_starts(ct)):
            yield ct, i, rows[start : start + ct.chunks[i].elems], kind, start


def _run(pool: Executor | None, jobs, source, name: str):
    """Submit every chunk's read -> check -> decompress -> recombine; yields each job as it finishes."""
    if pool is None:
        for ct, i, dest, kind, start in jobs:
            decompress_chunk(ct, i, source, dest, f"{name} {kind}")
            yield ct, i, kind, start
        return
    futures = {
        pool.submit(decompress_chunk, ct, i, source, dest, f"{name} {kind}"): (ct, i, kind, start)
        for ct, i, dest, kind, start in jobs
    }
    try:
        for f in as_completed(futures):
            f.result()  # a corrupt chunk raises here, before anything is reported loaded
            yield futures[f]
    finally:
        for f in futures:  # on an error, let no chunk keep writing into the slot afterwards
            f.cancel()
        for f in futures:
            if not f.cancelled():
                f.exception()


def _chunks_into_host(targets, source, pool, name: str) -> None:
    for _ in _run(pool, list(_chunk_jobs(targets, [t for _, t, _ in targets])), source, name):
        pass


_staging = threading.local()  # pinned host buffers per loader thread, reused across loads


def _pinned(shape, dtype) -> torch.Tensor:
    cache = _staging.__dict__.setdefault("buffers", {})
    key = (tuple(shape), dtype)
    if key not in cache:
        cache[key] = torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
    return cache[key]


def _chunks_into_device(targets, source, pool, name: str) -> None:
    staging = [_pinned(t.shape, t.dtype) for _, t, _ in targets]
    by_kind = {kind: (device, host) for (_, device, kind), host in zip(targets, staging, strict=True)}
    for ct, i, kind, start in _run(pool, list(_chunk_jobs(targets, staging)), source, name):
        device, host = by_kind[kind]
        n = ct.chunks[i].elems  # copy this chunk now; later chunks are still decompressing
        device.view(-1)[start : start + n].copy_(host.view(-1)[start : start + n], non_blocking=True)
    if staging and staging[0].is_pinned():
        torch.cuda.current_stream().synchronize()  # the staging buffers are reused by the next load


class CheckpointExpert:
    """Read from the checkpoint on every load (only this expert's bytes are read), straight into the
    slot's buffers (`Checkpoint.expert_into`: no copy in between)."""

    form = "disk"
    host_bytes = 0

    def __init__(
        self,
        checkpoint: Checkpoint,
        key: tuple[int, int],
        dtype: torch.dtype,
        lock,
        nbytes: int,
        forget=False,
    ):
        self.checkpoint, self.key, self.dtype, self.lock = checkpoint, key, dtype, lock
        self.stored_bytes = nbytes
        self.forget = forget  # drop the pages from the kernel's cache once read (the slot keeps them)

    def weights_now(self, pool: Executor | None = None) -> ExpertWeights:
        with self.lock:  # one reader per shard, shared by the loader and the serving thread
            w = self.checkpoint.expert(*self.key)
        return ExpertWeights(w.gate_up.to(self.dtype).contiguous(), w.down.to(self.dtype).contiguous())

    def prefetch(self) -> None:
        """Start reading this expert's pages into the kernel's cache (a prediction: a load is coming)."""
        self.checkpoint.prefetch_expert(*self.key)

    def load_into(self, gate_up: torch.Tensor, down: torch.Tensor, pool: Executor | None = None) -> int:
        if gate_up.device.type != "cpu":
            w = self.weights_now()
            gate_up.copy_(w.gate_up)
            down.copy_(w.down)
            return w.nbytes
        with self.lock:
            self.checkpoint.expert_into(*self.key, gate_up, down)
            if self.forget:
                self.checkpoint.forget_expert(*self.key)
        return self.stored_bytes
