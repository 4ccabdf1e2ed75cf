"""Each node of a cluster on one machine in its own memory cgroup: a real limit per node, and the
kernel's own account of what each node used.

    with MemoryCgroups({"main": 2 * GiB, "worker": GiB}) as cg, LocalCluster(place=cg.place) as c:
        c.client.generate("def f(x):", max_new_tokens=8)
        print(cg.report(vm_hwm=c.peak_rss_bytes()))

Contract:
- `MemoryCgroups.available()` is None where cgroups can be made here, else the reason (not root, no
  writable memory controller): tests `pytest.skip` with it.
- Entering makes a fresh parent cgroup under the one this process runs in (cgroup v1's memory
  hierarchy at /sys/fs/cgroup/memory, else v2 where its memory controller reaches this process's
  children), so a limit set above this process (a container's, a sandbox's) still binds the nodes.
- `prefix(name)` is a command prefix that moves the process into node `name`'s cgroup before it
  execs the command (`sh -c 'echo $$ > .../cgroup.procs && exec "$@"'`): the node keeps its pid,
  and a death signal set before (launch/spawn.py's `setpriv --pdeathsig`) survives both execs.
  `place(name)` wraps it as LocalCluster's NodePlacement. A node's cgroup is made on first use.
- A node's limit: `limits[name]`, else `limits[role]` where the role is the name without its
  index ("worker" for worker0..N, "main" for the standbys main1..), else none (the cgroup still
  counts). v1 writes `memory.limit_in_bytes` and, where swap is accounted, the same to
  `memory.memsw.limit_in_bytes`; v2 `memory.max` and `memory.swap.max` 0: swap cannot hide usage.
- `report()` reads each node's cgroup: limit, usage, peak (v1 `memory.max_usage_in_bytes`, v2
  `memory.peak`), failcnt (v1 memory + memsw failcnt, v2 memory.events' "max") and the OOM kills
  (v1 `memory.oom_control`'s oom_kill, v2 memory.events' oom_kill). A node restarted in the same
  cgroup adds to the same figures. The kernel charges a page to the cgroup that first brought it
  in: a node's figures count its heap and the files it read first (a checkpoint), not the shared
  libraries' pages this process's cgroup had cached before, so its VmHWM may exceed its peak.
- Leaving waits a few seconds for the processes still in a node's cgroup, moves any that remain to
  this process's own cgroup (logged), and removes the node cgroups and then the parent.

Why sh and not a Python helper: it adds no interpreter start to a node's start, and `exec` keeps the
pid LocalCluster waits on. Nothing here imports torch.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import re
import secrets
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from odmoe.launch.local_cluster import NodePlacement

log = logging.getLogger("odmoe.memory_cgroups")

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True)
class CgroupMemory:
    """One node's cgroup, in bytes (counts as counts)."""

    limit: int | None  # as the kernel holds it (v1 rounds down to a page); None: no limit
    usage: int
    peak: int
    # times a charge met the limit (v1 memory + memsw; v2 memory.events "max"). Not to be relied on:
    # a 6.18 kernel with v1 memsw limits counted 0 while its OOM killer acted; oom_kills did count.
    failcnt: int
    oom_kills: int  # processes the kernel's OOM killer killed in this cgroup
    vm_hwm: int | None = None  # the node process's own peak resident size, when report() is given it


@dataclass(frozen=True)
class CgroupHierarchy:
    """Where the node cgroups go: cgroup version 1 or 2, `base` (the directory the fresh parent is
    made in) and `own` (this process's cgroup, where a process left in a node's cgroup is moved)."""

    version: int
    base: Path
    own: Path

    @classmethod
    def find(cls, root: Path = CGROUP_ROOT, cgroup_file: Path = Path("/proc/self/cgroup")) -> CgroupHierarchy:
        """v1's memory hierarchy where mounted, else v2's; raises OSError saying why neither fits.

        v1: under this process's own memory cgroup. v2 allows no process in a cgroup that hands a
        controller to its children (the root aside), so the parent goes under this process's
        cgroup only where that one already does (the root), else beside it, under the cgroup that
        gives this one its memory controller."""
        paths = _own_cgroups(cgroup_file)
        if (root / "memory" / "cgroup.procs").exists() and 1 in paths:
            own = root / "memory" / paths[1].lstrip("/")
            return cls(1, own, own)
        unified = root / "unified" if (root / "unified").is_dir() else root
        if 2 not in paths or not (unified / "cgroup.controllers").exists():
            raise OSError(f"no cgroup v1 memory controller under {root} and no cgroup v2 hierarchy")
        own = unified / paths[2].lstrip("/")
        if "memory" in (own / "cgroup.subtree_control").read_text().split():
            return cls(2, own, own)
        if own != unified and "memory" in (own / "cgroup.controllers").read_text().split():
            return cls(2, own.parent, own)
        raise OSError(
            f"cgroup v2's memory controller reaches neither {own} nor its children, and v1 has none"
        )


class MemoryCgroups:
    """One memory cgroup per node under a fresh parent (the module's contract)."""

    def __init__(
        self,
        limits: Mapping[str, int] | Callable[[str], int | None],
        parent: str | None = None,
        root: Path = CGROUP_ROOT,
        exit_wait_s: float = 5.0,
    ):
        self.limits = limits
        self.parent_name = parent or f"odmoe-{secrets.token_hex(4)}"
        self.root = root
        self.exit_wait_s = exit_wait_s
        self.hierarchy: CgroupHierarchy | None = None
        self.nodes: dict[str, Path] = {}  # node name -> its cgroup directory, in the order made
        self._open = False  # entered and not yet closed: the parent exists

    @staticmethod
    def available(root: Path = CGROUP_ROOT) -> str | None:
        """None where memory cgroups can be made and limited here, else the reason."""
        try:
            hierarchy = CgroupHierarchy.find(root)
            probe = hierarchy.base / f"odmoe-probe-{os.getpid()}-{secrets.token_hex(2)}"
            probe.mkdir()
            try:
                if not (probe / _LIMIT_FILE[hierarchy.version]).exists():
                    return f"a cgroup made under {hierarchy.base} has no {_LIMIT_FILE[hierarchy.version]}"
            finally:
                probe.rmdir()
        except OSError as e:
            who = "" if os.geteuid() == 0 else " (not root)"
            return f"cannot make a memory cgroup here{who}: {e}"
        return None

    @property
    def version(self) -> int:
        return self._hierarchy().version

    @property
    def parent(self) -> Path:
        return self._hierarchy().base / self.parent_name

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> MemoryCgroups:
        self.hierarchy = CgroupHierarchy.find(self.root)
        self.parent.mkdir()
        self._open = True
        atexit.register(self.close)
        try:
            if self.version == 2:  # the parent holds no process, so it may hand memory to its children
                (self.parent / "cgroup.subtree_control").write_text("+memory")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every node cgroup, then the parent (see the contract for processes still inside)."""
        if not self._open:
            return
        for name, path in self.nodes.items():
            self._empty(name, path)
            _rmdir(path)
        _rmdir(self.parent)
        self.nodes = {}
        self._open = False
        atexit.unregister(self.close)

    def _empty(self, name: str, path: Path) -> None:
        deadline = time.monotonic() + self.exit_wait_s
        while (pids := _pids(path)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pids:
            log.warning("moving %s's processes %s out of its cgroup before removing it", name, pids)
            for pid in pids:
                try:
                    (self._hierarchy().own / "cgroup.procs").write_text(str(pid))
                except OSError:  # it exited meanwhile
                    pass

    # -- placing nodes -----------------------------------------------------------------------
    def limit(self, name: str) -> int | None:
        """Node `name`'s limit in bytes: by its name, else by its role ("worker3" -> "worker")."""
        if callable(self.limits):
            return self.limits(name)
        role = re.sub(r"\d+$", "", name)
        return self.limits.get(name, self.limits.get(role))

    def path(self, name: str) -> Path:
        """Node `name`'s cgroup directory, made (with its limit) on first use."""
        if not self._open:
            raise RuntimeError("MemoryCgroups is not entered (or already left): use it as a context manager")
        if name not in self.nodes:
            path = self.parent / name
            path.mkdir()
            self.nodes[name] = path
            limit = self.limit(name)
            if limit is not None:
                _write_limit(self.version, path, limit)
        return self.nodes[name]

    def prefix(self, name: str) -> list[str]:
        """A command prefix that runs the command in node `name`'s cgroup (same pid, via exec)."""
        procs = shlex.quote(str(self.path(name) / "cgroup.procs"))
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"]

    def place(self, name: str) -> NodePlacement:
        """LocalCluster's `place=`: node `name`'s NodePlacement, its prefix the one above."""
        return NodePlacement(prefix=self.prefix(name))

    # -- reading -----------------------------------------------------------------------------
    def report(self, vm_hwm: Mapping[str, int] | None = None) -> dict[str, CgroupMemory]:
        """Each node cgroup's figures by node name; `vm_hwm` (LocalCluster.peak_rss_bytes()) adds
        each node process's own peak. Readable until leaving, also after the nodes exited."""
        read = _read_v1 if self.version == 1 else _read_v2
        return {
            name: CgroupMemory(vm_hwm=(vm_hwm or {}).get(name), **read(path))
            for name, path in self.nodes.items()
        }

    def _hierarchy(self) -> CgroupHierarchy:
        if self.hierarchy is None:
            raise RuntimeError("MemoryCgroups is not entered: use it as a context manager")
        return self.hierarchy


_LIMIT_FILE = {1: "memory.limit_in_bytes", 2: "memory.max"}


def _write_limit(version: int, path: Path, limit: int) -> None:
    """The limit, and no swap beyond it. v1's memsw limit may not be below the memory limit, so it
    is written second; it exists only where the kernel accounts swap."""
    (path / _LIMIT_FILE[version]).write_text(str(limit))
    swap = path / ("memory.memsw.limit_in_bytes" if version == 1 else "memory.swap.max")
    if swap.exists():
        swap.write_text(str(limit) if version == 1 else "0")


def _read_v1(path: Path) -> dict[str, Any]:
    oom = _fields(path / "memory.oom_control")
    return {
        "limit": _limit(path / "memory.limit_in_bytes"),
        "usage": _int(path / "memory.usage_in_bytes"),
        "peak": _int(path / "memory.max_usage_in_bytes"),
        "failcnt": _int(path / "memory.failcnt") + _int(path / "memory.memsw.failcnt"),
        "oom_kills": oom.get("oom_kill", 0),
    }


def _read_v2(path: Path) -> dict[str, Any]:
    events = _fields(path / "memory.events")
    return {
        "limit": _limit(path / "memory.max"),
        "usage": _int(path / "memory.current"),
        "peak": _int(path / "memory.peak"),
        "failcnt": events.get("max", 0),
        "oom_kills": events.get("oom_kill", 0),
    }


def _own_cgroups(cgroup_file: Path) -> dict[int, str]:
    """{1: the v1 memory controller's cgroup path, 2: the v2 path} from /proc/self/cgroup."""
    out = {}
    for line in cgroup_file.read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            out[1] = path
        elif controllers == "":
            out[2] = path
    return out


def _pids(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _rmdir(path: Path) -> None:
    """rmdir a cgroup, retrying briefly: a process just reaped can keep it busy for a moment."""
    for _ in range(40):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            time.sleep(0.05)
    log.warning("could not remove cgroup %s: still busy", path)


def _limit(path: Path) -> int | None:
    """A limit file's bytes (the kernel rounds v1's down to a page); None for none ("max", 2**63)."""
    text = path.read_text().strip() if path.exists() else "max"
    return None if text == "max" or int(text) >= UNLIMITED else int(text)


def _int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def _fields(path: Path) -> dict[str, int]:
    """A flat-keyed cgroup file ("oom_kill 1" lines) as a dict."""
    try:
        pairs = (line.split() for line in path.read_text().splitlines())
        return {p[0]: int(p[1]) for p in pairs if len(p) == 2}
    except (OSError, ValueError):
        return {}
