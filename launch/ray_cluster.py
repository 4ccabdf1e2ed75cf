"""`odmoe-launch role=ray`: place main, the shadow and every worker on a running Ray cluster.

    ray start --head                                          # one box
    ray start --address=HEAD:6379 --resources='{"role_worker": 1}'   # each worker box
    odmoe-launch role=ray model.path=/models/mixtral cluster.workers=4 '+ray.worker.resources={role_worker:1}'

Contract. Every odmoe node runs as one long-lived Ray actor (`NodeActor`, odmoe.launch.ray_node,
a light module of its own) that starts the node
program unchanged, `python -m odmoe.launch.cli role=<role> ...`, as a child process on the actor's
Ray node, bound to that node's IP, talking ZeroMQ and gRPC to the others as on a LAN. Ray only
places and supervises: the data plane never goes through Ray. Each role's actors ask for the
resources and node labels in `ray.<role>` (`RayRoleConfig`), so a role lands only on the nodes
meant for it; mains go to distinct nodes (a STRICT_SPREAD placement group) when there are standbys.

Order of start: the mains' actors are placed first (only their addresses are needed: each picks a
free port on its node); then the shadow and the workers start and report their addresses; then
each main starts with them. A node's readiness is its ready file (`nodes/ready.py`), as for
`role=local`; its stdout and stderr go through the actor to Ray's log stream, so the launcher
prints every node's log prefixed with the node's name.

Failures, through the failover mechanisms rather than Ray's:
- A Ray node that dies takes its actor and the actor's child with it (PR_SET_PDEATHSIG); main
  notices the lost worker by its heartbeat and repairs as for any lost worker.
- Ray restarts a worker's or the shadow's actor (`ray.max_restarts`, -1 always) on a node that has
  its resources; the restarted node announces itself to every main, which checks it and takes it
  back. A node program that exits by itself makes its actor exit too, so Ray restarts that as well.
- Mains are never restarted by Ray: standby mains (`ray.standby_mains`) and the client's failover
  along every main's address do that without Ray, so a lost Ray head node does not stop a request.
  (Ray itself ends every actor once its head has been gone for its GCS timeout: for a cluster that
  must outlive its Ray head, run Ray with GCS fault tolerance.)

Security applies unchanged. The launcher makes the keys (or reads `security.key_dir`) and gives
each actor only the files its role needs (every public key, its own secret key, the certificate and
token; the TLS key to mains only), through Ray's object store inside a wrapper that never prints
its contents, never as plain actor arguments; the actor writes them into a directory only its user
can read. Ray's own traffic is as private as the Ray cluster is: turn on Ray's TLS on an untrusted
network.

The model: `model.path` must name the same checkpoint on every Ray node (a shared file system or
the same download at the same path); each actor checks its copy's fingerprint against the
launcher's before it starts a node and refuses with a clear error when they differ.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from odmoe.config import OdmoeConfig, RayRoleConfig
from odmoe.launch.local_cluster import resolve_model_path
from odmoe.launch.ray_node import STOP_GRACE_S, NodeActor, NodeSpec, SecretFiles, model_fingerprint
from odmoe.launch.settings import fault_disarmed
from odmoe.launch.spawn import ClusterStartError
from odmoe.models.open_model import open_checkpoint
from odmoe.serving.client import Client
from odmoe.transport.security import ClientCredentials, KeyDir, init_key_dir

log = logging.getLogger("odmoe.ray")
# Words of the launcher's command line its nodes must not get: the actor sets them per node.
LAUNCHER_ONLY = (
    "role=",
    "prompt=",
    "max_new_tokens=",
    "model.path=",
    "serve=",
    "node.ready_file=",
    "cluster.host=",
    "cluster.where=",
    "security.key_dir=",
    "ray.",
    "+ray.",
    "++ray.",
)


class RayUnavailable(RuntimeError):
    """Ray is not installed, or no Ray cluster answers at ray.address."""


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable("role=ray needs Ray: pip install 'odmoe[ray]'") from exc
    return ray


def role_key_files(keys: KeyDir, node: str, key_name: str) -> SecretFiles:
    """What node `node` (main, shadow, worker<i>) needs of the cluster's keys, and nothing more."""
    files = {f"public/{p.name}": p.read_bytes() for p in sorted(keys.public.glob("*.key"))}
    # revoked keys too: each node then names a revoked key in its refusals and never admits it again
    files |= {f"revoked/{p.name}": p.read_bytes() for p in sorted(keys.revoked.glob("*.key"))}
    files[f"private/{key_name}.key_secret"] = keys.secret_key(key_name).read_bytes()
    files["tls/cert.pem"] = keys.cert.read_bytes()
    files["token"] = keys.token.read_bytes()
    if node.startswith("main"):
        files["tls/key.pem"] = keys.tls_key.read_bytes()
    return SecretFiles(files)


# -- the launcher's side ---------------------------------------------------------------------------
def _options(role: RayRoleConfig) -> dict:
    options: dict = {"num_cpus": role.num_cpus, "num_gpus": role.num_gpus}
    if role.resources:
        options["resources"] = dict(role.resources)
    if role.labels:
        options["label_selector"] = dict(role.labels)
    return options


def _bundle(role: RayRoleConfig) -> dict:
    bundle = {"CPU": role.num_cpus, "GPU": role.num_gpus, **role.resources}
    return {k: v for k, v in bundle.items() if v}


def offered(nodes: list[dict], role: RayRoleConfig) -> list[dict]:
    """The alive Ray nodes (as `ray.nodes()` lists them) that could hold one actor of this role."""
    need = _bundle(role)
    return [
        n
        for n in nodes
        if n.get("Alive")
        and all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items())
        and all(n.get("Labels", {}).get(k) == v for k, v in role.labels.items())
    ]


class RayCluster:
    """An odmoe cluster placed on a Ray cluster; `with RayCluster(cfg, words) as c: c.client...`.

    `words` are the launcher's Hydra overrides; those meant for every node pass through (not the
    launcher's own: role, prompt, ray.*, ...). `placement` lists where each node landed."""

    def __init__(self, cfg: OdmoeConfig, words: list[str] = ()):
        self.cfg = cfg
        self.words = [w for w in words if not w.startswith(LAUNCHER_ONLY)]
        if not any(w.startswith("server.http_port=") for w in self.words):
            self.words.append(f"server.http_port={cfg.server.http_port}")
        self.model_path = resolve_model_path(cfg)
        self.checkpoint = open_checkpoint(self.model_path)  # a missing or non-MoE model fails here
        self.actors: dict[str, object] = {}
        self.placement: dict[str, dict] = {}
        self.main_addresses: list[str] = []
        self.http_urls: list[str] = []
        self.credentials: ClientCredentials | None = None
        self.key_dir: Path | None = None
        self._scratch: Path | None = None
        self._client: Client | None = None
        self._ray = None
        self._we_connected = False
        self._key_refs: list = []  # ObjectRefs of key files: alive while a restarted actor may need them
        self._groups: list = []  # the mains' placement group

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> RayCluster:
        ray = self._connect()
        try:
            self._check_feasible(ray)
            self._start_nodes(ray)
        except BaseException:
            self.stop()
            raise
        return self

    def _connect(self):
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every node's lines, not "repeated 3x"
        ray = import_ray()
        self._ray = ray
        if not ray.is_initialized():
            try:
                ray.init(address=self.cfg.ray.address, namespace=self.cfg.ray.namespace, log_to_driver=True)
            except (ConnectionError, RuntimeError) as exc:
                raise RayUnavailable(
                    f"no Ray cluster at ray.address={self.cfg.ray.address}: {exc} "
                    "(start one with `ray start --head`)"
                ) from exc
            self._we_connected = True
        return ray

    def _check_feasible(self, ray) -> None:
        nodes = ray.nodes()
        roles = [("main", self.cfg.ray.main, 1 + self.cfg.ray.standby_mains)]
        if self.cfg.shadow.enabled:
            roles.append(("shadow", self.cfg.ray.shadow, 1))
        roles.append(("worker", self.cfg.ray.worker, 1))
        for name, role, distinct in roles:
            fits = offered(nodes, role)
            if len(fits) < distinct:
                want = {**_bundle(role), **({"labels": role.labels} if role.labels else {})}
                raise ClusterStartError(
                    f"no{'' if not fits else 't enough'} alive Ray node offers what a {name} asks for "
                    f"({want}; ray.{name}.*): start a node with it, e.g. "
                    f"ray start --address=... --resources='{{\"role_{name}\": 1}}'"
                )

    def _start_nodes(self, ray) -> None:
        cfg, started = self.cfg, time.perf_counter()
        fingerprint = model_fingerprint(self.model_path)
        actor = ray.remote(NodeActor)
        timeout = cfg.ray.ready_timeout_s

        def spec(name: str, role: str, role_words=(), mains=()) -> NodeSpec:
            return NodeSpec(
                name,
                role,
                self.words,
                self.model_path,
                fingerprint,
                timeout,
                list(role_words),
                list(mains),
                disarm_fault=fault_disarmed(self.words),
            )

        # 1. mains: placed (distinct nodes when several), not started yet
        names = ["main"] + [f"main{i}" for i in range(1, cfg.ray.standby_mains + 1)]
        self._place_mains(ray, actor, names, spec)
        mains = self._infos(names, timeout, "placed")
        self.main_addresses = [m["address"] for m in mains]
        # 2. keys, now that the mains' addresses are known (the certificate names them)
        keys = self._keys(tuple(m["ip"] for m in mains))
        # 3. the shadow and the workers start; a restarted one announces itself to every main
        ready = self._start_others(actor, spec, keys)
        workers = [ready[f"worker{i}"]["address"] for i in range(cfg.cluster.workers)]
        main_words = ["role=main", f"cluster.worker_addresses=[{','.join(workers)}]"]
        if cfg.shadow.enabled:
            shadow = ready["shadow"]
            main_words += [
                f"cluster.shadow_address={shadow['address']}",
                f"cluster.shadow_pub_address={shadow['pub_address']}",
                f"cluster.shadow_where='{shadow['where']}'",
            ]
        # 4. the mains
        refs = []
        for name in names:
            # a fault meant for main must not also hit a standby
            words = main_words if name == "main" else [*main_words, *fault_disarmed(self.words)]
            refs.append(self.actors[name].launch.remote(words, self._secrets(keys, name)))
        mains = self._get(refs, names, timeout, "started")
        self.http_urls = [m.get("http_address", "") for m in mains]
        self.placement = {m["name"]: m for m in mains} | ready
        self.start_s = time.perf_counter() - started
        log.info("odmoe on Ray: %d nodes up in %.1f s", len(self.placement), self.start_s)

    def _place_mains(self, ray, actor, names: list[str], spec: Callable[..., NodeSpec]) -> None:
        """Main and its standbys (`names`) as actors, on distinct nodes when several; not started."""
        main_options = _options(self.cfg.ray.main)
        if len(names) > 1:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group = ray.util.placement_group(
                [_bundle(self.cfg.ray.main)] * len(names),
                strategy="STRICT_SPREAD",
                bundle_label_selector=[dict(self.cfg.ray.main.labels)] * len(names)
                if self.cfg.ray.main.labels
                else None,
            )
            self._groups.append(group)
            main_options.pop("label_selector", None)
            main_options.pop("resources", None)
        for i, name in enumerate(names):
            options = dict(main_options, name=f"odmoe-{name}", max_restarts=0)
            if len(names) > 1:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, i)
            self.actors[name] = actor.options(**options).remote(spec(name, "main"), None)

    def _start_others(self, actor, spec: Callable[..., NodeSpec], keys: KeyDir | None) -> dict[str, dict]:
        """The shadow and the workers started, told the mains' addresses: each one's info by name."""
        cfg = self.cfg
        others = (["shadow"] if cfg.shadow.enabled else []) + [
            f"worker{i}" for i in range(cfg.cluster.workers)
        ]
        for name in others:
            role = "shadow" if name == "shadow" else "worker"
            role_words = ["role=shadow"] if role == "shadow" else ["role=worker", f"worker.index={name[6:]}"]
            options = dict(
                _options(cfg.ray.shadow if role == "shadow" else cfg.ray.worker),
                name=f"odmoe-{name}",
                max_restarts=cfg.ray.max_restarts,
            )
            secrets = self._secrets(keys, name)
            self.actors[name] = actor.options(**options).remote(
                spec(name, role, role_words, self.main_addresses), secrets
            )
        refs = [self.actors[n].ready.remote() for n in others]
        return dict(zip(others, self._get(refs, others, cfg.ray.ready_timeout_s, "started"), strict=True))

    def _keys(self, hosts: tuple[str, ...]) -> KeyDir | None:
        sec = self.cfg.security
        if not sec.enabled:
            return None
        if sec.key_dir:
            self.key_dir = Path(sec.key_dir)
        else:  # ephemeral, as role=local's: gone with the launcher
            self._scratch = Path(tempfile.mkdtemp(prefix="odmoe-ray-"))
            self.key_dir = self._scratch / "keys"
            init_key_dir(self.key_dir, self.cfg.cluster.workers, hosts)
        self.credentials = ClientCredentials.from_key_dir(self.key_dir)
        return KeyDir(self.key_dir)

    def _secrets(self, keys: KeyDir | None, name: str):
        if keys is None:
            return None
        key_name = "main" if name.startswith("main") else name  # standbys share main's key
        ref = self._ray.put(role_key_files(keys, name, key_name))
        self._key_refs.append(ref)
        return ref

    def _infos(self, names: list[str], timeout: float, what: str) -> list[dict]:
        return self._get([self.actors[n].info.remote() for n in names], names, timeout, what)

    def _get(self, refs: list, names: list[str], timeout: float, what: str) -> list[dict]:
        ray = self._ray
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            late = [n for n, r in zip(names, refs, strict=True) if r not in done]
            raise ClusterStartError(
                f"{', '.join(late)} not {what} within {timeout:.0f}s (ray.ready_timeout_s): "
                "too few Ray nodes with their resources (see `ray status`), or a slow model load"
            ) from None
        except ray.exceptions.RayActorError as exc:
            cause = exc.__cause__ or exc
            raise ClusterStartError(str(getattr(exc, "error_msg", "") or cause)) from None

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        ray = self._ray
        if ray is not None and self.actors:
            refs = []
            for handle in self.actors.values():
                try:
                    refs.append(handle.stop.remote())
                except Exception:  # noqa: BLE001,S110 - an actor already gone stops nothing
                    pass
            try:
                ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 5)
            except Exception:  # noqa: BLE001,S110 - killed below either way
                pass
            for handle in self.actors.values():
                ray.kill(handle, no_restart=True)
            self.actors = {}
        for group in self._groups:
            ray.util.remove_placement_group(group)
        self._groups, self._key_refs = [], []
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if ray is not None and self._we_connected:
            ray.shutdown()
            self._we_connected = False

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- use -------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return self.main_addresses[0]

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(
                self.main_addresses,
                keepalive_s=self.cfg.failover.client_keepalive_s,
                credentials=self.credentials,
            )
        return self._client

    def watch(self) -> dict[str, dict | str]:
        """Each node's current info, or "restarting" / "dead" (one round of calls, ~1 s at most)."""
        ray = self._ray
        names = list(self.actors)
        refs = [self.actors[n].info.remote() for n in names]
        ray.wait(refs, num_returns=len(refs), timeout=1.0)
        state: dict[str, dict | str] = {}
        for name, ref in zip(names, refs, strict=True):
            try:
                state[name] = ray.get(ref, timeout=0)
            except ray.exceptions.ActorDiedError:
                state[name] = "dead"
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                state[name] = "restarting"
            except ray.exceptions.RayActorError:
                state[name] = "dead"
        return state


def placement_table(placement: dict[str, dict]) -> str:
    """One line per node: name, Ray node, host, its address."""
    lines = []
    for name, info in placement.items():
        http = f"  http {info['http_address']}" if info.get("http_address") else ""
        lines.append(f"  {name:<8} {info['where']:<44} {info['address']}{http}")
    return "\n".join(lines)
