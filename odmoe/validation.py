"""Refuse a bad configuration with one readable error, before any process starts.

Contract: `validate(cfg)` raises ValueError naming the key and what it may be; it asks each part for
what it accepts (stores, cache policies, precisions, alignment plans), so the schema
(`odmoe.config`) need not import them.
`check_device` and `exposed_hosts` are also used by the launcher.
"""

from __future__ import annotations

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
    passes here (launch.settings.to_config: each node and LocalCluster)."""
    if cfg.role.name not in ROLES:
        raise ValueError(f"role={cfg.role.name!r} is not one of {ROLES}")
    gguf_file = cfg.model.gguf_file
    if gguf_file and (not str(gguf_file).endswith(".gguf") or "/" in str(gguf_file)):
        raise ValueError(
            f"model.gguf_file={gguf_file!r} is not a .gguf file name (model.path is its directory)"
        )
    if cfg.worker.replicas < 1:
        raise ValueError(f"worker.replicas must be at least 1, got {cfg.worker.replicas}")
    from odmoe.worker.expert_cache import CACHE_POLICIES, check_cache_spec

    check_cache_spec(cfg.worker.cache)
    if cfg.worker.cache_policy not in CACHE_POLICIES:
        raise ValueError(f"worker.cache_policy={cfg.worker.cache_policy!r} is not one of {CACHE_POLICIES}")
    if cfg.cluster.homes not in ("room", "even"):
        raise ValueError(f"cluster.homes={cfg.cluster.homes!r} is not one of room, even")
    cfg.topology  # noqa: B018 - raises on a workers/group_size mismatch or too many replicas
    fault = fault_of(cfg)  # the lab overlay's (lab=on); none in the product's schema
    if fault.node and fault.action not in FAULT_ACTIONS:
        raise ValueError(f"fault.action={fault.action!r} is not one of {FAULT_ACTIONS}")
    if cfg.failover.heartbeat_interval_s <= 0 or cfg.failover.heartbeat_timeout_s <= 0:
        raise ValueError("failover.heartbeat_interval_s and heartbeat_timeout_s must be positive")
    if cfg.failover.no_worker_grace_s < 0:
        raise ValueError(
            f"failover.no_worker_grace_s must be >= 0 (0: fail at once), got "
            f"{cfg.failover.no_worker_grace_s:g}"
        )
    if cfg.failover.beat_interval_s < 0:
        raise ValueError(
            f"failover.beat_interval_s must be >= 0 (0: off), got {cfg.failover.beat_interval_s:g}"
        )
    if cfg.failover.beat_interval_s > 0:
        try:
            suspicion_settings(cfg).check()
        except ValueError as exc:
            raise ValueError(
                f"failover.suspicion_threshold, acceptable_pause_s, beat_min_std_s: {exc}"
            ) from None
    f = cfg.failover
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
    if cfg.server.max_waiting < 1 or cfg.server.request_timeout_s <= 0:
        raise ValueError("server.max_waiting must be >= 1 and server.request_timeout_s > 0")
    if cfg.server.client_ping_s < 0.1 or cfg.server.client_ping_timeout_s < 0.1:
        raise ValueError(
            "server.client_ping_s and server.client_ping_timeout_s must be at least 0.1 s, got "
            f"{cfg.server.client_ping_s:g} and {cfg.server.client_ping_timeout_s:g}"
        )
    if cfg.server.max_running < 1:
        raise ValueError(f"server.max_running must be >= 1, got {cfg.server.max_running}")
    if cfg.server.decode not in ("batched", "per_request"):
        raise ValueError(f"server.decode must be batched or per_request, got {cfg.server.decode!r}")
    if cfg.prefill.chunk_tokens < 0:
        raise ValueError(f"prefill.chunk_tokens must be >= 0 (0: off), got {cfg.prefill.chunk_tokens}")
    if not 0 <= cfg.server.http_port < 65536:
        raise ValueError(f"server.http_port must lie in [0, 65535], got {cfg.server.http_port}")
    if cfg.worker.slots < 1:
        raise ValueError(f"worker.slots must be at least 1, got {cfg.worker.slots}")
    from odmoe.tools.memory import parse_bytes
    from odmoe.worker.expert_store import STORES

    if cfg.worker.store not in STORES:
        raise ValueError(f"worker.store={cfg.worker.store!r} is not one of {', '.join(STORES)}")
    try:
        parse_bytes(cfg.worker.host_memory)
    except ValueError as exc:
        raise ValueError(f"worker.host_memory: {exc}") from None
    try:
        parse_bytes(cfg.node.memory)
    except ValueError as exc:
        raise ValueError(f"node.memory: {exc}") from None
    try:
        parse_bytes(cfg.server.kv_cache_memory)
    except ValueError as exc:
        raise ValueError(f"server.kv_cache_memory: {exc}") from None
    if cfg.worker.decompress_threads < 1:
        raise ValueError(f"worker.decompress_threads must be at least 1, got {cfg.worker.decompress_threads}")
    if cfg.role.name == "worker" and not 0 <= cfg.worker.index < cfg.cluster.workers:
        raise ValueError(f"worker.index={cfg.worker.index} is outside 0..{cfg.cluster.workers - 1}")
    if not 0 <= cfg.cluster.min_workers <= cfg.cluster.workers:
        raise ValueError(
            f"cluster.min_workers={cfg.cluster.min_workers} must be within 0..cluster.workers "
            f"({cfg.cluster.workers}; 0: all of them)"
        )
    joining = cfg.cluster.join_port >= 0 and not cfg.cluster.worker_addresses  # they come by the link
    if cfg.role.name == "main" and not joining and len(cfg.cluster.worker_addresses) != cfg.cluster.workers:
        raise ValueError(
            f"role=main needs cluster.worker_addresses with {cfg.cluster.workers} entries, "
            f"got {len(cfg.cluster.worker_addresses)}"
        )
    if joining and cfg.role.name == "main" and not cfg.security.enabled:
        raise ValueError(
            "cluster.join_port without cluster.worker_addresses admits nodes by the join link, which needs "
            "security.enabled=true (its certificate's fingerprint and secret are what a box checks)"
        )
    if cfg.join and not cfg.security.enabled:
        raise ValueError("join=LINK needs security.enabled=true: the link is checked by TLS and a secret")
    check_device("model.device", cfg.model.device)
    check_device("shadow.device", cfg.shadow.device)
    check_device("worker.device", cfg.worker.device, allow_auto=True)
    from odmoe.shadow.precision import CPU_ONLY, PRECISIONS

    if cfg.shadow.precision in CPU_ONLY and cfg.shadow.device.startswith("cuda"):
        raise ValueError(
            f"shadow.precision={cfg.shadow.precision} is a CPU kernel of torch's; on CUDA use int8 or nf4"
        )
    if cfg.shadow.mode not in SHADOW_MODES:
        raise ValueError(f"shadow.mode={cfg.shadow.mode!r} is not one of {SHADOW_MODES}")
    for name in ("inject_wrong", "inject_wrong_token"):
        if not 0.0 <= (rate := getattr(emulation_of(cfg), name)) <= 1.0:
            raise ValueError(f"emulation.{name} must lie in [0, 1], got {rate}")
    if cfg.shadow.precision not in PRECISIONS:
        raise ValueError(f"shadow.precision={cfg.shadow.precision!r} is not one of {', '.join(PRECISIONS)}")
    cfg.miss.validate()
    make_plan(cfg.alignment)  # raises on a bad mode, negative periods or bounds
    if not 0 <= cfg.shadow.nice <= 19:
        raise ValueError(f"shadow.nice must lie in 0..19 (an os.nice increment), got {cfg.shadow.nice}")
    if cfg.shadow.hedge_margin < 0:
        raise ValueError(f"shadow.hedge_margin must be >= 0 (0: off), got {cfg.shadow.hedge_margin}")
    Speculation(1, cfg.alignment.max_ahead)  # raises on max_ahead < 1
    if cfg.prefill.mini_batch < 0:
        raise ValueError(f"prefill.mini_batch must be >= 0 (0: one batch), got {cfg.prefill.mini_batch}")
    if cfg.prefill.placement not in PREFILL_PLACEMENTS:
        raise ValueError(
            f"prefill.placement={cfg.prefill.placement!r} is not one of {', '.join(PREFILL_PLACEMENTS)}"
        )
    _validate_security(cfg)
    if cfg.role.name == "local":
        if not cfg.prompt:
            raise ValueError("prompt is empty")
        if cfg.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {cfg.max_new_tokens}")


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
