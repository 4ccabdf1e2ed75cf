"""One odmoe node as a Ray actor (the actor side of `role=ray`, odmoe.launch.ray_cluster).

Contract. `NodeActor` starts the node program unchanged, `python -m odmoe.launch.cli role=<role>`,
as a child process on its Ray node, bound to that node's IP; it relays the node's output to its own
stdout (Ray streams it to the launcher, each line prefixed with the node's name), reports the
node's ready file, and stops it on request. The child dies with the actor (PR_SET_PDEATHSIG), and
the actor with the child (so that Ray restarts both). A worker's or the shadow's node starts in
__init__, so Ray's restart of the actor starts the node again, announcing itself to every main;
a main starts only when `launch` hands it the other nodes' addresses.

Why a module of its own: every Ray node imports it into each actor's process, which should stay a
small supervisor next to the node it starts. It imports only the standard library (no torch, no
gRPC): an actor takes ~100 MB instead of the ~450 MB the launcher's imports would cost per node.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from odmoe.launch.spawn import SPAWNER, ClusterStartError, popen_node

STOP_GRACE_S = 10.0


def model_fingerprint(path: str | os.PathLike) -> dict[str, list[int]]:
    """Per file of a checkpoint directory (config.json, every *.safetensors): its size, the CRC32 of
    its first 64 KiB and of 16 samples of 4 KiB spread over it. Cheap on every node; it tells two
    copies of a checkpoint apart when they were saved, trained or converted differently."""
    root = Path(path)
    out = {}
    for file in sorted([root / "config.json", *root.glob("*.safetensors")]):
        if not file.is_file():
            continue
        size = file.stat().st_size
        with open(file, "rb") as f:
            crcs = [zlib.crc32(f.read(65536))]
            for k in range(16):
                f.seek(size * k // 16)
                crcs.append(zlib.crc32(f.read(4096)))
        out[file.name] = [size, *crcs]
    return out


# -- what each actor is given ----------------------------------------------------------------------
class SecretFiles:
    """Key files by relative path. Its repr never shows them: Ray prints arguments in some errors."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files

    def __repr__(self) -> str:
        return f"SecretFiles({len(self.files)} files)"

    def write(self, root: Path) -> Path:
        """Into root (made 0700); secrets 0600, public keys and the certificate 0644."""
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for rel, data in self.files.items():
            path = root / rel
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            secret = rel.startswith("private/") or rel in ("token", "tls/key.pem")
            mode = 0o600 if secret else 0o644
            path.touch(mode=mode)
            path.chmod(mode)
            path.write_bytes(data)
        return root


@dataclass(frozen=True)
class NodeSpec:
    """One node as its actor starts it: the words every node gets, then its role's own."""

    name: str  # main, main1 (a standby), shadow, worker<i>
    role: str  # main | shadow | worker
    words: list[str]
    model_path: str
    fingerprint: dict | None  # the launcher's checkpoint_fingerprint; None: not checked
    ready_timeout_s: float
    role_words: list[str] = field(default_factory=list)
    main_addresses: list[str] = field(default_factory=list)  # announced to after a restart
    # after a restart: the word that keeps a fault meant for the first run from firing again (lab=on)
    disarm_fault: list[str] = field(default_factory=list)


class NodeActor:
    """One odmoe node under Ray (applied as `ray.remote(NodeActor)` at run time, so importing this
    module needs no Ray). A worker's or the shadow's node starts in __init__, so Ray's restart of
    the actor starts the node again; a main starts when `launch` gives it the others' addresses."""

    def __init__(self, spec: NodeSpec, keys: SecretFiles | None):
        import ray

        self.spec, self.keys = spec, keys
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        with warnings.catch_warnings():  # Ray deprecated a property this one reads, not this one
            warnings.simplefilter("ignore")
            self.restarted = context.was_current_actor_reconstructed
        self.ip = ray.util.get_node_ip_address()
        self.hostname = socket.gethostname()
        self.where = f"ray node {self.node_id[:8]} ({self.hostname}, {self.ip})"
        self.dir = Path(tempfile.mkdtemp(prefix=f"odmoe-{spec.name}-"))  # 0700
        self.process: subprocess.Popen | None = None
        self.served: dict = {}  # its ready file, once it serves
        self.tail: collections.deque[str] = collections.deque(maxlen=30)
        self.stopping = False
        self.main_address = ""
        self._check_model()
        if spec.role == "main":
            self.main_address = f"{self.ip}:{self._main_port()}"
        else:
            again = []
            if self.restarted:  # a fault meant for the first run must not fire again; tell main
                again = [*spec.disarm_fault, f"cluster.main_addresses=[{','.join(spec.main_addresses)}]"]
            # started here, waited for in ready(): lines printed after __init__ carry this node's
            # name in Ray's log prefix (those printed during __init__ carry the class name)
            self._spawn([*spec.role_words, *again], keys)

    def __repr__(self) -> str:  # Ray prefixes this node's log lines with it
        return self.spec.name

    def _check_model(self) -> None:
        want = self.spec.fingerprint
        if want is None:
            return
        have = model_fingerprint(self.spec.model_path)
        if not have:
            raise ClusterStartError(
                f"{self.spec.name} on {self.where}: no checkpoint at {self.spec.model_path}"
            )
        if have != want:
            raise ClusterStartError(
                f"{self.spec.name} on {self.where}: {self.spec.model_path} is not the launcher's checkpoint "
                "(its files differ): every Ray node needs the same model at the same path"
            )

    def _main_port(self) -> int:
        for word in self.spec.words:
            if word.startswith("cluster.main_port=") and int(word.partition("=")[2]):
                return int(word.partition("=")[2])
        with socket.socket() as s:  # a free port now; main binds it a moment later
            s.bind((self.ip, 0))
            return s.getsockname()[1]

    def _spawn(self, role_words: list[str], keys: SecretFiles | None) -> None:
        words = [*self.spec.words, f"model.path={self.spec.model_path}", f"cluster.host={self.ip}"]
        words.append(f"cluster.where='{self.where}'")  # quoted: Hydra's grammar takes it as it is
        if keys is not None:
            words.append(f"security.key_dir={keys.write(self.dir / 'keys')}")
        words += [*role_words, f"node.ready_file={self.dir / 'ready.json'}"]
        self.process = SPAWNER.submit(
            popen_node,  # the node dies with its actor (a lost Ray node)
            [sys.executable, "-m", "odmoe.launch.cli", *words],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        ).result()
        threading.Thread(target=self._relay, name="odmoe-log", daemon=True).start()

    def _wait_ready(self) -> None:
        ready, process = self.dir / "ready.json", self.process
        assert process is not None
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while not ready.exists():
            if process.poll() is not None:
                time.sleep(0.2)  # the relay thread's last lines
                raise ClusterStartError(
                    f"{self.spec.name} on {self.where} exited with code {process.returncode} while "
                    "starting:\n" + "\n".join(self.tail)
                )
            if time.monotonic() > deadline:
                raise ClusterStartError(f"{self.spec.name} on {self.where} did not come up in time")
            time.sleep(0.05)
        self.served = json.loads(ready.read_text())

    def _relay(self) -> None:
        """The node's output into this actor's stdout (Ray streams it to the launcher); once it ends
        on its own, this actor ends too, so that Ray restarts both (workers and the shadow)."""
        assert self.process is not None and self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            print(line, flush=True)
        code = self.process.wait()
        if not self.stopping and (self.served or self.restarted):  # a first start's failure: ready() says it
            print(f"odmoe: the {self.spec.name} node exited with code {code}; its actor ends too", flush=True)
            os._exit(1)

    # -- called by the launcher --------------------------------------------------------------
    def ready(self) -> dict:
        """Once this worker's or the shadow's node serves (ClusterStartError if it cannot): `info()`."""
        self._wait_ready()
        return self.info()

    def launch(self, role_words: list[str], keys: SecretFiles | None) -> dict:
        """Main only: start the node with the other nodes' addresses; returns `info()` once it serves."""
        self._spawn([*role_words, f"cluster.main_port={self.main_address.rpartition(':')[2]}"], keys)
        return self.ready()

    def info(self) -> dict:
        if not self.served and (self.dir / "ready.json").exists():  # a restarted node, now serving
            self.served = json.loads((self.dir / "ready.json").read_text())
        return {
            "name": self.spec.name,
            "role": self.spec.role,
            "node_id": self.node_id,
            "ip": self.ip,
            "hostname": self.hostname,
            "where": self.where,
            "restarted": self.restarted,
            "pid": self.process.pid if self.process else None,
            "address": self.served.get("address") or self.main_address,
            **{k: v for k, v in self.served.items() if k not in ("address", "pid")},
        }

    def stop(self) -> None:
        self.stopping = True
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)  # a frozen node cannot act on SIGTERM
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
