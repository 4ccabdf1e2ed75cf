"""Peak memory of this process, as the per-node stats report it; byte sizes as users write them."""

from __future__ import annotations

import re
import resource
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported only by whoever asks for a device's peak: node_memory must not pay it
    import torch


def peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_device_bytes(device: torch.device) -> int:
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_bytes(text: str | int) -> int:
    """ "512MiB" -> 536870912, "2GB" -> 2000000000, 1024 -> 1024; "" and 0 mean no limit (0)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text or "0")
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{text!r} is not a byte size (e.g. 1073741824, 512MiB, 2GB)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 0:
        raise ValueError(f"a byte size cannot be negative, got {text!r}")
    return value
