"""A whole odmoe cluster on this machine: main + workers as separate OS processes on 127.0.0.1.

    with odmoe.LocalCluster(model_path, workers=2, group_size=2, overrides=["model.dtype=bfloat16"]) as c:
        print(c.client.generate("def f(x):", max_new_tokens=16).text)

Each node is `python -m odmoe.launch.cli role=... <overrides>`, the same program a LAN node runs.
Nodes bind port 0 and report their address through a ready file. Why the cleanup is layered:
`stop()` terminates then kills every child (also after a child fails or the wait times out); an
atexit hook covers an interpreter that exits without `stop()`; and each child is started with
PR_SET_PDEATHSIG so that even a SIGKILLed launcher leaves no orphan behind.

Failures on purpose (tests, odmoe-bench suite=faults, the soak): `kill(name)`, `freeze(name)` /
`resume(name)` (SIGSTOP / SIGCONT) and `restart(name)` act on a node by name ("main", "main1" for
the first standby, "shadow", "worker<i>"). A restarted worker or shadow binds a new port and
announces itself to every main (`cluster.main_addresses`); a restarted main is given the workers'
and the shadow's current addresses. `standby_mains=n` starts n more mains with the same config; the
cluster's client knows them all and fails over along them. A fault at an exact point, and the
emulation knobs (a slow load link, wrong predictions), are the lab overlay's: `overrides=["lab=on",
"fault.node=worker1", "fault.iteration=6"]`; a standby main, or a node started again, is given
`fault.node=` so that the fault fires once, where it was meant.

Security (on unless `security.enabled=false`): `start()` makes ephemeral keys in the scratch
directory (`odmoe-keys init` in a folder only this user can read; a restarted node reuses them) and
`client` carries them; HTTP users take `http_auth` (the token header and a TLS context trusting
the cluster's certificate), e.g. `httpx.get(c.http_url + "/v1/models", **c.http_auth)`, or
`c.token` as an OpenAI client's api_key. A `security.key_dir=DIR` override uses DIR instead.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from odmoe.config import ModelConfig, OdmoeConfig
from odmoe.launch.settings import compose, fault_disarmed
from odmoe.launch.spawn import SPAWNER, ClusterStartError, die_with_parent, popen_node  # noqa: F401 - re-exported
from odmoe.models.checkpoint import CheckpointError
from odmoe.models.open_model import open_checkpoint
from odmoe.serving.client import Client
from odmoe.tools.model_names import resolve_model
from odmoe.transport.security import ClientCredentials, init_key_dir

log = logging.getLogger("odmoe.local")


@dataclass(frozen=True)
class NodePlacement:
    """Where one node runs: a command prefix (e.g. `ip netns exec NS`) and extra config words
    (e.g. `cluster.host=10.77.0.3`, the address it binds and announces)."""

    prefix: list[str] = field(default_factory=list)
    words: list[str] = field(default_factory=list)


@dataclass
class NodeProcess:
    name: str
    process: subprocess.Popen
    ready_file: Path
    log_file: Path
    started: float = field(default_factory=time.time)  # when it was spawned (wall clock)

    @property
    def ready_s(self) -> float | None:
        """Seconds from its spawn to its ready file (None until it serves)."""
        try:
            return self.ready_file.stat().st_mtime - self.started
        except OSError:
            return None

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def resolve_model_path(cfg: OdmoeConfig) -> str:
    """`model.path` as a checkpoint directory (odmoe.tools.model_names: `demo`, `tiny`, `trained`,
    `trained_deepseek`, `trained_qwen3_next` or a directory; unset is `tiny`), made on first use under
    model.cache_dir; with `model.gguf_file`, that file in the directory."""
    path = resolve_model(cfg.model.path, cfg.model.cache_dir)
    if cfg.model.gguf_file and Path(path).is_dir():  # a path already naming the file keeps it
        path = str(Path(path) / cfg.model.gguf_file)
        if not Path(path).is_file():
            raise CheckpointError(f"model.gguf_file={cfg.model.gguf_file}: {path} does not exist")
    elif Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        path = _only_gguf_file(Path(path)) or path
    return path


def _only_gguf_file(directory: Path) -> str | None:
    """A directory of downloaded GGUF files and no config.json: its one model (a sharded set counts
    once, by its first shard); None where it holds none; refused, naming them, where it holds several."""
    files = sorted(directory.glob("*.gguf"))
    sets = [f for f in files if not re.search(r"-\d{5}-of-\d{5}\.gguf$", f.name) or "-00001-of-" in f.name]
    if len(sets) > 1:
        raise CheckpointError(
            f"{directory} holds {len(sets)} GGUF models ({', '.join(f.name for f in sets)}): "
            "name one with model.gguf_file="
        )
    return str(sets[0]) if sets else None


class LocalCluster:
    def __init__(
        self,
        model_path: str | None = None,
        workers: int | None = None,
        group_size: int | None = None,
        overrides: list[str] | tuple[str, ...] = (),
        ready_timeout_s: float | None = None,
        place: Callable[[str], NodePlacement] | None = None,
        standby_mains: int = 0,
        through: Callable[[str, str], str] | None = None,
    ):
        words = [w for w in overrides if not w.startswith(("role=", "node.ready_file="))]
        if not any(w.startswith("server.http_port=") for w in words):
            words.append("server.http_port=0")  # any free port: clusters side by side never collide
        # The schema's model (`tiny`, random init, made in a second), not the `demo` that odmoe-launch's
        # conf/config.yaml sets (trained for minutes on first use): tests and benchmarks start clusters so.
        if model_path is None and not any(w.startswith("model.path=") for w in words):
            model_path = ModelConfig().path
        given = {"model.path": model_path, "cluster.workers": workers, "cluster.group_size": group_size}
        words += [f"{key}={value}" for key, value in given.items() if value is not None]
        self.cfg: OdmoeConfig = compose(["role=local", *words])  # validates before anything starts
        self.overrides = words
        self.model_path = resolve_model_path(self.cfg)
        open_checkpoint(self.model_path)  # a missing or non-MoE model fails here, before any process starts
        self.ready_timeout_s = ready_timeout_s or self.cfg.worker.ready_timeout_s
        self.nodes: list[NodeProcess] = []
        self.address = ""
        self.main_addresses: list[str] = []  # the active main first, then the standbys
        self.http_urls: list[str] = []  # each main's OpenAI-compatible API ("" with server.http=false)
        self.worker_addresses: list[str] = []
        self.standby_mains = standby_mains
        self.shadow_info: dict = {}
        self.main_info: dict = {}
        self._client: Client | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="odmoe-cluster-"))  # 0700
        self.credentials: ClientCredentials | None = None  # set by start() when security is on
        self.key_dir: Path | None = None
        if self.cfg.security.enabled:
            self.key_dir = Path(self.cfg.security.key_dir or self._dir / "keys")
            if not self.cfg.security.key_dir:
                self.overrides.append(f"security.key_dir={self.key_dir}")
        self.place = place or (lambda name: NodePlacement())  # by node name: main, shadow, worker0...
        # where mains reach a node: (its name, its address) -> the address they are given, e.g. a
        # relay in front of it (odmoe.tools.link_relay: delay, jitter, black holes); None: directly
        self.through = through or (lambda name, address: address)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> LocalCluster:
        """Start every node and wait until each serves; on a cluster already started, nothing more
        (so `with LocalCluster(...).start() as c:` runs one cluster, not a second beside the first)."""
        if self.nodes:
            return self
        atexit.register(self.stop)
        self._dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.key_dir is not None:
                if not self.cfg.security.key_dir:  # ephemeral: made now, gone with the scratch directory
                    init_key_dir(self.key_dir, self.cfg.cluster.workers)
                self.credentials = ClientCredentials.from_key_dir(self.key_dir)
            n = self.cfg.cluster.workers
            shadow = [self._spawn("shadow", ["role=shadow"])] if self.cfg.shadow.enabled else []
            workers = [self._spawn(f"worker{i}", _worker_args(self.cfg, i)) for i in range(n)]
            ready = _wait_ready(shadow + workers, self.ready_timeout_s)
            self.worker_addresses = [info["address"] for info in ready[len(shadow) :]]
            if shadow:
                self.shadow_info = ready[0]
            names = ["main"] + [f"main{i}" for i in range(1, self.standby_mains + 1)]
            mains = [self._spawn(name, self._main_args(name)) for name in names]
            ready = _wait_ready(mains, self.ready_timeout_s)
            self.main_info = ready[0]  # its ready file: address, http_address, connect_s
            self.main_addresses = [info["address"] for info in ready]
            self.http_urls = [info.get("http_address", "") for info in ready]
            self.address = self.main_addresses[0]
        except BaseException:
            self.stop()
            raise
        log.info("local cluster up: main %s, %d workers", self.address, self.cfg.cluster.workers)
        return self

    @property
    def token(self) -> str:
        """The client token (an OpenAI client's api_key); "" with security off."""
        return self.credentials.token if self.credentials else ""

    @property
    def http_auth(self) -> dict:
        """Keyword arguments for httpx calls to `http_url`: the token header and TLS trust."""
        if self.credentials is None:
            return {}
        return {
            "headers": {"Authorization": f"Bearer {self.credentials.token}"},
            "verify": self.credentials.ssl_context(),
        }

    def _main_args(self, name: str) -> list[str]:
        workers = [self.through(f"worker{i}", a) for i, a in enumerate(self.worker_addresses)]
        args = ["role=main", f"cluster.worker_addresses=[{','.join(workers)}]"]
        if self.shadow_info:
            args += [
                f"cluster.shadow_address={self.through('shadow', self.shadow_info['address'])}",
                f"cluster.shadow_pub_address={self.through('shadow', self.shadow_info['pub_address'])}",
            ]
        if name != "main":
            args += fault_disarmed(self.overrides)  # a fault meant for main must not also hit the standby
        return args

    # -- failures on purpose ------------------------------------------------------------------
    def node(self, name: str) -> NodeProcess:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node named {name!r} (nodes: {[n.name for n in self.nodes]})")

    def kill(self, name: str) -> None:
        node = self.node(name)
        if node.process.poll() is None:
            node.process.kill()
        node.process.wait()

    def freeze(self, name: str) -> None:
        self.node(name).process.send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.node(name).process.send_signal(signal.SIGCONT)

    def restart(self, name: str, until_used: bool = True, announce: bool = True) -> NodeProcess:
        """Start a node of this name again (after it was killed): a worker or the shadow announces
        itself to every main; a main gets the current addresses. Returns once it serves, and for a
        worker or the shadow once main uses it again (its Join is handled at main's next tick: a
        request sent before that ran without it, which made a test flaky); `until_used=False`
        returns as soon as it serves (the soak, whose chaos may take it down again meanwhile).
        `announce=False`: a worker or the shadow does not announce itself, so main goes on reaching
        it where it did, e.g. through a relay (`through`) that the caller retargets to the new
        address; main's probes of that address take it back (`worker_addresses` and `shadow_info`
        say where it serves now)."""
        old = self.node(name)
        if old.process.poll() is None:
            old.process.kill()
        old.process.wait()
        self.nodes.remove(old)
        old.ready_file.unlink(missing_ok=True)
        again = fault_disarmed(self.overrides)
        if announce or not (name == "shadow" or name.startswith("worker")):
            again.append(f"cluster.main_addresses=[{','.join(self.main_addresses)}]")
        if name.startswith("worker"):
            args = _worker_args(self.cfg, int(name.removeprefix("worker")))
        elif name == "shadow":
            args = ["role=shadow"]
        else:
            args = self._main_args(name)
        (info,) = _wait_ready([self._spawn(name, [*args, *again], ".restarted")], self.ready_timeout_s)
        if name.startswith("worker"):
            self.worker_addresses[int(name.removeprefix("worker"))] = info["address"]
        elif name == "shadow":
            self.shadow_info = info
        else:
            index = 0 if name == "main" else int(name.removeprefix("main"))
            old_address, self.main_addresses[index] = self.main_addresses[index], info["address"]
            self.http_urls[index] = info.get("http_address", "")
            if self._client is not None:
                self._client.replace_address(old_address, info["address"])
        if until_used and (name == "shadow" or name.startswith("worker")):
            address = info["address"] if announce else None
            _wait_taken_back(self.main_addresses, self.credentials, name, address, self.ready_timeout_s)
        return self.node(name)

    def _spawn(self, name: str, role_args: list[str], log_suffix: str = "") -> NodeProcess:
        ready, log_file = self._dir / f"{name}.ready.json", self._dir / f"{name}{log_suffix}.log"
        where = self.place(name)
        args = [
            *self.overrides,
            f"model.path={self.model_path}",
            *where.words,
            *role_args,
            f"node.ready_file={ready}",
        ]
        with open(log_file, "ab") as out:
            process = SPAWNER.submit(
                popen_node,
                [*where.prefix, sys.executable, "-m", "odmoe.launch.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            ).result()
        node = NodeProcess(name, process, ready, log_file)
        self.nodes.append(node)
        return node

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        for node in self.nodes:
            if node.process.poll() is None:
                node.process.send_signal(signal.SIGCONT)  # a frozen node cannot act on SIGTERM
                node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for node in self.nodes:
            try:
                node.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait()
        self.nodes = []
        shutil.rmtree(self._dir, ignore_errors=True)  # ready files and node logs (a failed start quoted them)
        atexit.unregister(self.stop)

    @property
    def client(self) -> Client:
        if not self.address:
            raise RuntimeError("the cluster is not running; use it as a context manager or call start()")
        if self._client is None:
            self._client = Client(
                self.main_addresses,
                keepalive_s=self.cfg.failover.client_keepalive_s,
                credentials=self.credentials,
            )
        return self._client

    @property
    def http_url(self) -> str:
        """The active main's OpenAI-compatible API, e.g. http://127.0.0.1:41234 (add /v1)."""
        if not self.http_urls or not self.http_urls[0]:
            raise RuntimeError("main serves no HTTP API (server.http=false?) or the cluster is not running")
        return self.http_urls[0]

    @property
    def pids(self) -> list[int]:
        return [n.process.pid for n in self.nodes]

    def peak_rss_bytes(self) -> dict[str, int]:
        """Each running node's peak resident memory so far (Linux VmHWM), by node name."""
        peaks = {}
        for name, status in _proc(self.nodes, "status").items():
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    peaks[name] = int(line.split()[1]) * 1024
        return peaks

    def ready_info(self) -> dict[str, dict]:
        """What each node wrote in its ready file (address, and what it read at start: `read_bytes`,
        `read_s`), by node name."""
        out = {}
        for node in self.nodes:
            try:
                out[node.name] = json.loads(node.ready_file.read_text())
            except (OSError, ValueError):
                continue
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """Each running node's CPU time so far (user + system, every thread; Linux /proc), by node name.
        In the kernel's clock ticks (10 ms on most Linux systems): read differences over seconds."""
        tick = os.sysconf("SC_CLK_TCK")
        used = {}
        for name, stat in _proc(self.nodes, "stat").items():
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces
            used[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
        return used

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _worker_args(cfg: OdmoeConfig, index: int) -> list[str]:
    """Worker `index`'s role words; with `cluster.spread_workers`, pinned to a CPU of its own."""
    args = ["role=worker", f"worker.index={index}"]
    if cfg.cluster.spread_workers:
        cpus = sorted(os.sched_getaffinity(0))
        args.append(f"cluster.cpus=[{cpus[index % len(cpus)]}]")
    return args


def _wait_ready(nodes: list[NodeProcess], timeout_s: float) -> list[dict]:
    """What each node wrote in its ready file, in order, once all have written it; ClusterStartError
    (quoting its log) as soon as one exits instead, or when `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(nodes)
    while pending:
        for node in list(pending):
            if node.ready_file.exists():
                pending.remove(node)
            elif node.process.poll() is not None:
                code, tail = node.process.returncode, node.log_tail()
                raise ClusterStartError(f"{node.name} exited with code {code} while starting:\n{tail}")
        if pending and time.monotonic() > deadline:
            names = ", ".join(n.name for n in pending)
            raise ClusterStartError(f"{names} did not come up within {timeout_s:.0f}s")
        time.sleep(0.05)
    return [json.loads(node.ready_file.read_text()) for node in nodes]


def _wait_taken_back(
    mains: list[str], credentials: ClientCredentials | None, name: str, address: str | None, timeout_s: float
) -> None:
    """Until main's Info shows the restarted node `name` at its new `address` (None: wherever main
    reaches it), linked (shadow) or live; ClusterStartError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    # its own client, not the cluster's: another thread may be using that one
    with Client(mains, credentials=credentials) as client:
        while time.monotonic() < deadline:
            info = client.info()
            if name == "shadow":
                shadow = info.get("shadow") or {}
                if address in (None, shadow.get("address")) and shadow.get("up"):
                    return
            else:
                worker = info["workers"][int(name.removeprefix("worker"))]
                if address in (None, worker["address"]) and worker["live"]:
                    return
            time.sleep(0.05)
    raise ClusterStartError(f"main did not take {name} at {address} back within {timeout_s:.0f}s")


def _proc(nodes: list[NodeProcess], entry: str) -> dict[str, str]:
    """/proc/<pid>/<entry> of each running node, by node name (none for one exited, or off Linux)."""
    texts = {}
    for node in nodes:
        try:
            texts[node.name] = Path(f"/proc/{node.process.pid}/{entry}").read_text()
        except OSError:
            continue
    return texts
