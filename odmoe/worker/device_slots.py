"""The CUDA side of a worker's device slots: pinned host copies, a copy stream, events.

Contract (used by `odmoe.worker.expert_store.DeviceSlots` when its device is CUDA; a CPU device never
touches this module, so the CPU path stays what it was):

- `pin(tensor)`: the expert's host copy in page-locked memory, so that a host-to-device copy is a
  DMA the GPU runs on its own while the host goes on (`ExpertStore.build(pin=True)` pins every
  expert it holds decompressed).
- `CopyStream(device)`: one CUDA stream per worker that does nothing but loads. `start()` records
  an event on it before the copies are enqueued; `finish()` records one after and returns the
  `Transfer` (both events). The slot keeps it.
- `Transfer.await_on(stream)`: the compute stream waits for the load on the GPU (no host
  synchronisation): compute for the slot may be enqueued before its load has finished, and loads
  into the other slots keep running on the copy stream while this one computes.
- `Transfer.seconds()`: the load's duration measured by CUDA events, i.e. the real transfer on the
  bus (host time spent enqueueing is not in it). It blocks until the copy has finished.
- `Transfer.waited_s(probe)`: how long the compute stream sat waiting for the load (GPU time from
  the `probe` event recorded when compute was enqueued to the end of the copy; 0 when it was done).

A slot is refilled only after it was evicted, and it is evicted only once the compute that read it
has been copied back to the host (the worker's `.cpu()`), so the copy stream never overwrites a slot
the compute stream is still reading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pin(t: torch.Tensor) -> torch.Tensor:
    """`t` in page-locked host memory (a copy; returns `t` itself when it is already pinned)."""
    return t if t.is_pinned() else t.pin_memory()


@dataclass
class Transfer:
    """One load on the copy stream: events before and after its copies."""

    begin: torch.cuda.Event
    end: torch.cuda.Event

    def await_on(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Make `stream` wait for this load; returns a probe event recorded on `stream` just before."""
        probe = torch.cuda.Event(enable_timing=True)
        probe.record(stream)
        stream.wait_event(self.end)
        return probe

    def seconds(self) -> float:
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1e3

    def waited_s(self, probe: torch.cuda.Event) -> float:
        self.end.synchronize()
        probe.synchronize()
        return max(probe.elapsed_time(self.end) / 1e3, 0.0)


class CopyStream:
    """The worker's own stream for loads, on `device`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._begin: torch.cuda.Event | None = None

    def start(self) -> torch.cuda.Event:
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(self.stream)
        self._begin = begin
        return begin

    def finish(self) -> Transfer:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        begin, self._begin = self._begin, None
        return Transfer(begin, end)


def device_peak_bytes(device: torch.device | str | None) -> int:
    """CUDA's own counter of the most memory this process's tensors took on `device` (0 off CUDA)."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.max_memory_allocated(torch.device(device)))


def host_to_device_peak(device: torch.device | str, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """The bus's measured peak host-to-device bandwidth in bytes/s: the best of `repeats` pinned
    `copy_`s of one `nbytes` tensor, timed with CUDA events."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for i in range(repeats + 1):  # the first copy warms up: not counted
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        if i:
            best = min(best, begin.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / best
