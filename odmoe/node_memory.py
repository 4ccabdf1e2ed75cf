"""How much memory this node may use, how much it uses, and byte sizes as users write them: the
figures memory plans are made of.

Contract:
- `node_memory(configured)` is the memory this node's process may grow to, and where that figure
  came from: `node.memory` when set ("12GiB"), else the limit of the memory cgroup the process runs
  in (cgroup v2 `memory.max`, or v1 `memory.limit_in_bytes`, the smallest along the path up to the
  root, since a parent's limit binds its children too), else the kernel's MemAvailable plus what the
  process already holds. A container or a systemd slice with a limit thus counts, which psutil's
  `virtual_memory().available` does not (it reads the whole machine's /proc/meminfo).
- `process_memory(pid)` reads /proc/PID/status: the peak (`VmHWM`) and current resident size, split
  into anonymous, file-backed and shared pages, in bytes.
- `parse_bytes(text)`: a byte size as users write it ("512MiB", "2GB", 1024; "" and 0 mean none).

Every figure is in bytes. Nothing here allocates or imports torch: a node calls it before loading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class NodeMemory:
    bytes: int  # what this node's process may use in all
    source: str  # "node.memory", "cgroup v1 limit", "cgroup v2 limit", "MemAvailable"

    def describe(self) -> str:
        return f"{self.bytes / 2**30:.2f} GiB ({self.source})"


@dataclass(frozen=True)
class ProcessMemory:
    peak: int  # VmHWM: the most resident memory the process ever had
    resident: int  # VmRSS
    anonymous: int  # RssAnon: heap, tensors
    file_backed: int  # RssFile: mapped files (a checkpoint's mmap shows here)
    shared: int  # RssShmem


def node_memory(
    configured: str | int = "", proc: Path = Path("/proc"), root: Path = CGROUP_ROOT
) -> NodeMemory:
    """The memory this node may use (the module's contract), `configured` first."""
    if parse_bytes(configured):
        return NodeMemory(parse_bytes(configured), "node.memory")
    limit = cgroup_limit(proc / "self/cgroup", root)
    total = _meminfo(proc / "meminfo").get("MemTotal", UNLIMITED)
    if limit is not None and limit[0] < total:
        return NodeMemory(limit[0], limit[1])
    available = _meminfo(proc / "meminfo").get("MemAvailable", 0)
    return NodeMemory(available + process_memory(proc=proc).resident, "MemAvailable")


def cgroup_limit(
    cgroup_file: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT
) -> tuple[int, str] | None:
    """(the smallest memory limit on the way from this process's cgroup to the root, its source), or
    None where no limit is set or the files cannot be read."""
    found = []
    for version, rel in _memory_cgroups(cgroup_file):
        base = root / "memory" if version == 1 else root / ("unified" if (root / "unified").is_dir() else "")
        name = "memory.limit_in_bytes" if version == 1 else "memory.max"
        node = base / rel.lstrip("/")
        while True:
            value = _read_limit(node / name)
            if value is not None:
                found.append((value, f"cgroup v{version} limit"))
            if node == base or base not in node.parents:
                break
            node = node.parent
    return min(found) if found else None


def process_memory(pid: int | str = "self", proc: Path = Path("/proc")) -> ProcessMemory:
    """The process's resident memory from /proc/PID/status (zeros where a field is missing)."""
    fields = {}
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            name, _, value = line.partition(":")
            parts = value.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[name] = int(parts[0]) * 1024
    except OSError:
        pass
    return ProcessMemory(
        peak=fields.get("VmHWM", 0),
        resident=fields.get("VmRSS", 0),
        anonymous=fields.get("RssAnon", 0),
        file_backed=fields.get("RssFile", 0),
        shared=fields.get("RssShmem", 0),
    )


def _memory_cgroups(cgroup_file: Path) -> list[tuple[int, str]]:
    """(version, path) of the memory controller's cgroup: v1's `N:memory:/path`, v2's `0::/path`."""
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            out.append((1, path))
        elif controllers == "":
            out.append((2, path))
    return out


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    value = int(text)
    return None if value >= UNLIMITED else value


def _meminfo(path: Path) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(":")
            parts = value.split()
            if parts:
                out[name] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


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
