"""Peak memory of this process, as the per-node stats report it."""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

# byte sizes live with the memory figures they size (odmoe.node_memory); re-exported for their users
from odmoe.node_memory import parse_bytes  # noqa: F401

if TYPE_CHECKING:  # torch is imported only by whoever asks for a device's peak: node_memory must not pay it
    import torch


def peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_device_bytes(device: torch.device) -> int:
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
