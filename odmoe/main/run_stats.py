"""What a request's DoneEvent reports: its timings, what its exchanges cost, recall, the shadow.

Contract: `request_stats(run, experts, main, recall, end)` turns one finished `RequestRun` and its
`RunContext.traffic` into the stats dict clients receive (`Done.stats_json`, the HTTP usage, the
benchmarks' JSON). Pure assembly: it computes nothing the run did not count. Costs several running
requests shared (an expert loaded once for all of them) are this request's share (`ExpertTraffic`).
"""

from __future__ import annotations

from dataclasses import asdict

from odmoe.main.expert_traffic import ExpertTraffic
from odmoe.main.recall import RecallCounter
from odmoe.main.remote_experts import RemoteExperts
from odmoe.main.request_run import RequestRun
from odmoe.models.main_model import MainModel
from odmoe.tools.memory import peak_rss_bytes
from odmoe.worker.device_slots import device_peak_bytes


def request_stats(
    run: RequestRun, experts: RemoteExperts, main: MainModel, recall: RecallCounter, end: float
) -> dict:
    traffic = run.ctx.traffic
    first = run.clock.first_token_at or end
    decode_tokens = max(len(run.streamed) - 1, 0)
    return {
        **timing_stats(run, first, end),
        "experts_loaded": traffic.experts_loaded,
        "bytes_loaded": traffic.bytes_loaded,
        "worker_load_s": traffic.load_s,
        "worker_compute_s": traffic.compute_s,
        "main_wait_on_workers_s": traffic.wait_s,
        **memory_stats(run, experts, main),
        "decode": {**asdict(traffic.decode), "seconds": end - first, "tokens": decode_tokens},
        # continuous batching: how many requests decoded together with this one, per iteration
        "batch_size_mean": sum(sizes) / len(sizes) if (sizes := run.clock.batch_sizes) else 0.0,
        "batch_size_max": max(run.clock.batch_sizes, default=0),
        "emulated_link": {
            # from each worker's pong; absent where its load link is not emulated
            f"worker{w}": {"bandwidth_gbps": p.link[0], "latency_ms": p.link[1]}
            for w, p in sorted(experts.members.pongs.items())
            if p.link
        }
        or None,
        "prefill": prefill_stats(traffic, first - run.clock.start),
        "recall": recall.report(),
        "timely_recall": traffic.timely_recall.report(),
        "per_worker": {f"worker{w}": asdict(row) for w, row in sorted(traffic.per_worker.items())},
        "preloaded": traffic.preloaded,
        "reloads": traffic.reloads,
        "stall_s": sum(traffic.stall_s_per_layer.values()),
        "stall_s_per_layer": dict(sorted(traffic.stall_s_per_layer.items())),
        **exactness_stats(traffic),
        "hedging": hedging_stats(traffic),
        "cache": cache_stats(traffic),
        **shadow_stats(experts, run.request_id),
        "resumed_tokens": len(run.resumed),
        "finish_reason": run.finish_reason,
        "seed": run.chooser.seed if run.chooser.sampling else None,
        "failover": failover_stats(experts, traffic, run.clock.start_us),
        "alignment": run.schedule.plan.report(),
        # failover.steer_stragglers: the stragglers as of the request's end (odmoe.main.stragglers)
        "stragglers": experts.stragglers.report() if experts.stragglers is not None else None,
        # failover.resend_late_*: decode calls sent again for being late, since main started
        "late_calls": experts.late.report() if getattr(experts, "late", None) is not None else None,
    }


def timing_stats(run: RequestRun, first: float, end: float) -> dict:
    """Its tokens, time to the first, decode speed after it, the whole request's time."""
    new_ids = run.streamed
    decode_tokens = max(len(new_ids) - 1, 0)
    decode_s = end - first
    return {
        "request_id": run.request_id,
        "prompt_tokens": run.prompt_len,
        "new_tokens": len(new_ids),
        "ttft_s": first - run.clock.start,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0,
        "total_s": end - run.clock.start,
    }


def memory_stats(run: RequestRun, experts: RemoteExperts, main: MainModel) -> dict:
    """Peak RSS per node; the paper's GPU memory (main's weights, KV cache aside, and each worker's
    expert slots); CUDA's own counter (max_memory_allocated) per node process, 0 on a CPU."""
    traffic = run.ctx.traffic
    return {
        "peak_rss_bytes": {
            "main": peak_rss_bytes(),
            **{f"worker{w}": b for w, b in sorted(traffic.worker_peak_rss.items())},
        },
        "device_bytes": {
            "main": main.device_bytes,
            **{f"worker{w}": p.device_bytes for w, p in sorted(experts.members.pongs.items())},
        },
        "device_peak_bytes": {
            "main": device_peak_bytes(main.device),
            "shadow": _shadow_peak(experts, run.request_id),
            **{f"worker{w}": b for w, b in sorted(traffic.worker_device_peak.items())},
        },
    }


def exactness_stats(t: ExpertTraffic) -> dict:
    """Whether the request is the model's output: a lossy miss policy that computed a resident
    expert in place of a missed one makes it not (`exact` false), each substitution listed."""
    return {
        "exact": not t.substitutions_per_layer,
        "substitutions": sum(t.substitutions_per_layer.values()),
        "substitutions_per_layer": dict(sorted(t.substitutions_per_layer.items())),
        "substituted": [list(s) for s in t.substituted],  # [iteration, layer, missing, computed]
    }


def cache_stats(t: ExpertTraffic) -> dict:
    """worker.cache: this request's experts computed from a worker's cache and the bytes that saved,
    in all and per layer; per worker, its cache so far (cumulative over every request it served),
    with its evictions per layer."""
    fields = ("capacity", "cached", "hits", "misses", "bytes_saved", "evictions", "home", "home_cached")

    def worker(row: list[int]) -> dict:
        out = dict(zip(fields, row, strict=False))
        pairs = row[len(fields) :]  # then (layer, evictions) pairs: CacheBook.report
        out["evictions_per_layer"] = dict(zip(pairs[::2], pairs[1::2], strict=True))
        return out

    return {
        "hits": t.cache_hits,
        "bytes_saved": t.cache_bytes_saved,
        "hits_per_layer": dict(sorted(t.cache_hits_per_layer.items())),
        "workers": {f"worker{w}": worker(row) for w, row in sorted(t.cache.items())},
    }


def hedging_stats(t: ExpertTraffic) -> dict:
    """Hedged prefetch: what the hedges cost (bytes loaded) against what they saved (hits).
    Counted by the workers as of their last answer in this request, so a hedge loaded after a
    worker's last answer is missing (at most one layer's)."""
    loads, used, nbytes = (sum(row[i] for row in t.hedging.values()) for i in range(3))
    timely = t.timely_recall.report()
    activated, hits = timely["activated"], (timely["overall"] or 0.0) * timely["activated"]
    return {
        "hedge_loads": loads,
        "hedges_used": used,
        "hedge_bytes": nbytes,
        "hedge_bytes_fraction": nbytes / t.bytes_loaded if t.bytes_loaded else 0.0,
        "hedge_hits": t.hedge_hits,
        "timely_recall_with_hedges": (hits + t.hedge_hits) / activated if activated else None,
    }


def prefill_stats(t: ExpertTraffic, ttft: float) -> dict:
    """TTFT split: main's own work, and the time it waited on workers split into the busiest
    worker's loading + computing (the critical path) and the rest (transfer and queueing)."""
    p = t.prefill
    per_layer = p.experts_per_layer
    return {
        "main_s": ttft - p.wait_s,
        "wait_on_workers_s": p.wait_s,
        "critical_load_compute_s": p.critical_s,
        "transfer_s": max(p.wait_s - p.critical_s, 0.0),
        "load_s": p.load_s,
        "compute_s": p.compute_s,
        "experts_per_layer": per_layer,
        "experts_per_layer_mean": sum(per_layer.values()) / len(per_layer) if per_layer else 0.0,
    }


def failover_stats(experts: RemoteExperts, traffic: ExpertTraffic, since_us: float) -> dict:
    events = [e for e in experts.members.events if e.at_us >= since_us]
    return {
        "live_workers": sorted(experts.members.live),
        "resent_calls": traffic.resent,
        "events": [asdict(e) for e in events],
    }


def _shadow_peak(experts: RemoteExperts, request: str) -> int:
    shadow = experts.shadow
    return shadow.observations(request).device_peak_bytes if shadow is not None else 0


def shadow_stats(experts: RemoteExperts, request: str) -> dict:
    shadow = experts.shadow
    lost = {"shadow_lost_at_us": shadow.lost_at_us} if shadow is not None and shadow.lost_at_us else {}
    if shadow is None or not shadow.was_active(request):
        return {"shadow": False, **lost}
    seen = shadow.observations(request)
    ahead, late, forward = seen.lookahead_layers, seen.late_departure_s, seen.forward_s
    idle, layers = seen.alignment_wait_s, max(len(shadow.order), 1)
    return {
        "shadow": True,
        "shadow_forward_s_mean": sum(forward.values()) / len(forward) if forward else None,
        "shadow_alignment_wait_s_mean": sum(idle.values()) / len(idle) if idle else None,
        "lookahead_layers_mean": sum(ahead) / len(ahead) if ahead else None,
        # the same lookahead in decode iterations (MoE layers per iteration)
        "lookahead_iterations_mean": sum(ahead) / len(ahead) / layers if ahead else None,
        # speculative: iterations ahead of main's newest report when it started one; rollbacks
        "shadow_ahead_mean": sum(seen.ahead.values()) / len(seen.ahead) if seen.ahead else None,
        "shadow_rollbacks": seen.rollbacks,
        "late_departure_s": sum(late.values()),
        "late_departure_s_mean": sum(late.values()) / len(late) if late else None,
        **lost,
    }
