"""Refuse a bad configuration with one readable error, before any process starts.

Contract: `validate(cfg)` raises ValueError naming the key and what it may be; it asks each part for
what it accepts (stores, cache policies, precisions, alignment plans), so the schema
(`odmoe.config`) need not import them.
`check_device` and `exposed_hosts` are also used by the launcher.
"""

from __future__ import annotations

from functools import reduce

from odmoe.config import (
    FAULT_ACTIONS,
    PREFILL_PLACEMENTS,
    ROLES,
    SHADOW_MODES,
    OdmoeConfig,
    emulation_of,
    fault_of,
)
from odmoe.main.alignment import make_plan
from odmoe.main.late_calls import LateCalls
from odmoe.main.stragglers import StragglerWatch
from odmoe.shadow.speculation import Speculation
from odmoe.transport.suspicion import SuspicionSettings


def suspicion_settings(cfg: OdmoeConfig) -> SuspicionSettings:
    """failover.*'s beats as the detector's settings (odmoe.transport.suspicion)."""
    f = cfg.failover
    return SuspicionSettings(f.beat_interval_s, f.suspicion_threshold, f.acceptable_pause_s, f.beat_min_std_s)


def straggler_watch(cfg: OdmoeConfig) -> StragglerWatch | None:
    """failover.*'s straggler keys as main's watch (odmoe.main.stragglers); None when steering is off,
    or with worker caches whose homes may not move (straggler_move_horizon 0)."""
    f = cfg.failover
    if not f.steer_stragglers or (cfg.topology.homes and f.straggler_move_horizon == 0):
        return None
    return StragglerWatch(f.straggler_factor, f.straggler_after)


def late_calls(cfg: OdmoeConfig) -> LateCalls | None:
    """failover.resend_late_*: main's watch of late decode calls (odmoe.main.late_calls); None: off."""
    f = cfg.failover
    return LateCalls(f.resend_late_factor, f.resend_late_min_s) if f.resend_late_factor > 0 else None


def validate(cfg: OdmoeConfig) -> None:
    """Refuse a bad combination with one readable error, before any process starts. Every config
    passes here (launch.settings.to_config: each node and LocalCluster), section by section."""
    _one_of("role", cfg.role.name, ROLES)
    gguf_file = cfg.model.gguf_file
    if gguf_file and (not str(gguf_file).endswith(".gguf") or "/" in str(gguf_file)):
        raise ValueError(
            f"model.gguf_file={gguf_file!r} is not a .gguf file name (model.path is its directory)"
        )
    _check_worker(cfg)
    _one_of("cluster.homes", cfg.cluster.homes, ("room", "even"), joined=True)
    cfg.topology  # noqa: B018 - raises on a workers/group_size mismatch or too many replicas
    if (fault := fault_of(cfg)).node:  # the lab overlay's (lab=on); none in the product's schema
        _one_of("fault.action", fault.action, FAULT_ACTIONS)
    _check_failover(cfg)
    _check_serving(cfg)
    from odmoe.tools.memory import parse_bytes

    for key in ("worker.host_memory", "node.memory", "server.kv_cache_memory"):
        try:
            parse_bytes(_value(cfg, key))
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    _check_cluster(cfg)
    check_device("model.device", cfg.model.device)
    check_device("shadow.device", cfg.shadow.device)
    check_device("worker.device", cfg.worker.device, allow_auto=True)
    _check_shadow(cfg)
    _validate_security(cfg)
    if cfg.role.name == "local":
        if not cfg.prompt:
            raise ValueError("prompt is empty")
        if cfg.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {cfg.max_new_tokens}")


def _value(cfg: OdmoeConfig, key: str):
    return reduce(getattr, key.split("."), cfg)


def _one_of(key: str, value, allowed: tuple, joined: bool = False) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {', '.join(allowed) if joined else allowed}")


def _check_worker(cfg: OdmoeConfig) -> None:
    from odmoe.worker.expert_cache import CACHE_POLICIES, check_cache_spec
    from odmoe.worker.expert_store import STORES

    w = cfg.worker
    for key in ("worker.replicas", "worker.slots", "worker.decompress_threads"):
        if (count := _value(cfg, key)) < 1:
            raise ValueError(f"{key} must be at least 1, got {count}")
    check_cache_spec(w.cache)
    _one_of("worker.cache_policy", w.cache_policy, CACHE_POLICIES)
    _one_of("worker.store", w.store, STORES, joined=True)
    if cfg.role.name == "worker" and not 0 <= w.index < cfg.cluster.workers:
        raise ValueError(f"worker.index={w.index} is outside 0..{cfg.cluster.workers - 1}")


def _check_failover(cfg: OdmoeConfig) -> None:
    f = cfg.failover
    if f.heartbeat_interval_s <= 0 or f.heartbeat_timeout_s <= 0:
        raise ValueError("failover.heartbeat_interval_s and heartbeat_timeout_s must be positive")
    if f.no_worker_grace_s < 0:
        raise ValueError(
            f"failover.no_worker_grace_s must be >= 0 (0: fail at once), got {f.no_worker_grace_s:g}"
        )
    if f.beat_interval_s < 0:
        raise ValueError(f"failover.beat_interval_s must be >= 0 (0: off), got {f.beat_interval_s:g}")
    if f.beat_interval_s > 0:
        try:
            suspicion_settings(cfg).check()
        except ValueError as exc:
            raise ValueError(
                f"failover.suspicion_threshold, acceptable_pause_s, beat_min_std_s: {exc}"
            ) from None
    if not f.straggler_factor > 1:  # at 1 or below a group's median member would count as slow
        raise ValueError(f"failover.straggler_factor must be > 1, got {f.straggler_factor:g}")
    for key in ("straggler_after", "straggler_probe_every"):
        if getattr(f, key) < 1:
            raise ValueError(f"failover.{key} must be >= 1, got {getattr(f, key)}")
    if f.straggler_move_horizon < 0:
        raise ValueError(
            f"failover.straggler_move_horizon must be >= 0 tokens (0: homes never move), got "
            f"{f.straggler_move_horizon}"
        )
    if f.resend_late_factor < 0 or f.resend_late_min_s < 0:
        raise ValueError(
            f"failover.resend_late_factor and resend_late_min_s must be >= 0 (factor 0: never), got "
            f"{f.resend_late_factor:g}, {f.resend_late_min_s:g}"
        )


def _check_serving(cfg: OdmoeConfig) -> None:
    s, p = cfg.server, cfg.prefill
    if s.max_waiting < 1 or s.request_timeout_s <= 0:
        raise ValueError("server.max_waiting must be >= 1 and server.request_timeout_s > 0")
    if s.client_ping_s < 0.1 or s.client_ping_timeout_s < 0.1:
        raise ValueError(
            "server.client_ping_s and server.client_ping_timeout_s must be at least 0.1 s, got "
            f"{s.client_ping_s:g} and {s.client_ping_timeout_s:g}"
        )
    if s.max_running < 1:
        raise ValueError(f"server.max_running must be >= 1, got {s.max_running}")
    if s.decode not in ("batched", "per_request"):
        raise ValueError(f"server.decode must be batched or per_request, got {s.decode!r}")
    if not 0 <= s.http_port < 65536:
        raise ValueError(f"server.http_port must lie in [0, 65535], got {s.http_port}")
    if p.chunk_tokens < 0:
        raise ValueError(f"prefill.chunk_tokens must be >= 0 (0: off), got {p.chunk_tokens}")
    if p.mini_batch < 0:
        raise ValueError(f"prefill.mini_batch must be >= 0 (0: one batch), got {p.mini_batch}")
    _one_of("prefill.placement", p.placement, PREFILL_PLACEMENTS, joined=True)


def _check_cluster(cfg: OdmoeConfig) -> None:
    c, main, secure = cfg.cluster, cfg.role.name == "main", cfg.security.enabled
    if not 0 <= c.min_workers <= c.workers:
        raise ValueError(
            f"cluster.min_workers={c.min_workers} must be within 0..cluster.workers "
            f"({c.workers}; 0: all of them)"
        )
    joining = c.join_port >= 0 and not c.worker_addresses  # they come by the link
    if main and not joining and len(c.worker_addresses) != c.workers:
        raise ValueError(
            f"role=main needs cluster.worker_addresses with {c.workers} entries, "
            f"got {len(c.worker_addresses)}"
        )
    if joining and main and not secure:
        raise ValueError(
            "cluster.join_port without cluster.worker_addresses admits nodes by the join link, which needs "
            "security.enabled=true (its certificate's fingerprint and secret are what a box checks)"
        )
    if cfg.join and not secure:
        raise ValueError("join=LINK needs security.enabled=true: the link is checked by TLS and a secret")


def _check_shadow(cfg: OdmoeConfig) -> None:
    from odmoe.shadow.precision import CPU_ONLY, PRECISIONS

    s = cfg.shadow
    if s.precision in CPU_ONLY and s.device.startswith("cuda"):
        raise ValueError(
            f"shadow.precision={s.precision} is a CPU kernel of torch's; on CUDA use int8 or nf4"
        )
    _one_of("shadow.mode", s.mode, SHADOW_MODES)
    for name in ("inject_wrong", "inject_wrong_token"):
        if not 0.0 <= (rate := getattr(emulation_of(cfg), name)) <= 1.0:
            raise ValueError(f"emulation.{name} must lie in [0, 1], got {rate}")
    _one_of("shadow.precision", s.precision, PRECISIONS, joined=True)
    cfg.miss.validate()
    make_plan(cfg.alignment)  # raises on a bad mode, negative periods or bounds
    if not 0 <= s.nice <= 19:
        raise ValueError(f"shadow.nice must lie in 0..19 (an os.nice increment), got {s.nice}")
    if s.hedge_margin < 0:
        raise ValueError(f"shadow.hedge_margin must be >= 0 (0: off), got {s.hedge_margin}")
    Speculation(1, cfg.alignment.max_ahead)  # raises on max_ahead < 1


def check_device(key: str, name: str, allow_auto: bool = False) -> None:
    """`name` is cpu, cuda or cuda:<i> (or auto where allowed), and CUDA is there when it is asked for."""
    if allow_auto and name == "auto":
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{key}={name!r} is not cpu, cuda or cuda:<i>{' (or auto)' if allow_auto else ''}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{key}={name} needs CUDA, and this machine's torch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{key}={name}: only {torch.cuda.device_count()} CUDA device(s) here")


def exposed_hosts(cfg: OdmoeConfig) -> list[str]:
    """The non-loopback addresses this node would bind (empty: loopback only)."""
    from odmoe.transport.security import is_loopback

    hosts = [cfg.cluster.host]
    if cfg.role.name in ("main", "local") and cfg.server.http:
        hosts.append(cfg.server.http_host or cfg.cluster.host)
    return [h for h in dict.fromkeys(hosts) if not is_loopback(h)]


def _validate_security(cfg: OdmoeConfig) -> None:
    sec = cfg.security
    if sec.enabled:
        # local, ray, plan make their own keys or need none; a box joining by the link is handed
        # them; main taking its nodes by the link makes its own (odmoe.launch.join)
        by_link = cfg.join or (cfg.cluster.join_port >= 0 and not cfg.cluster.worker_addresses)
        if cfg.role.name not in ("local", "ray", "plan") and not sec.key_dir and not by_link:
            raise ValueError(
                f"role={cfg.role.name} with security on needs security.key_dir=DIR (make it once with "
                "`odmoe-keys init DIR --workers N`, see README: Several machines on a LAN), or "
                "security.enabled=false on a trusted network"
            )
        return
    if exposed := exposed_hosts(cfg):
        if not sec.insecure_lan:
            raise ValueError(
                f"security.enabled=false would expose {', '.join(exposed)} without authentication: anyone on "
                "that network could drive the cluster. Turn security on (the default), bind 127.0.0.1, or "
                "say security.insecure_lan=true"
            )
