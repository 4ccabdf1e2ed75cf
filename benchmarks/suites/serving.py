"""Suite `serving`: the cluster as a serving system, many users at once (continuous batching).

One local cluster (`serving.max_running` requests decode together, the benchmark's emulated link),
driven by client threads streaming through main's gRPC API (odmoe.Client: token ids, so every
request is checked against its alone reference, transformers' `generate()` with the same greedy or
seeded parameters):
- closed loop: `c` clients for each c in `serving.concurrency`, each sending its next request as soon
  as the last one ends (`requests_per_client` each);
- open loop: requests arriving as a Poisson process at each rate of `serving.rates` (req/s) for
  `open_requests` requests, whatever the cluster's state (a request refused with 429 is counted).
Per load it reports total output tokens/s, TTFT and inter-token latency (p50 / p99, client side),
expert bytes loaded per generated token and the mean batch size (main's Prometheus counters before
and after), and how many requests' tokens differed from running alone (must be 0).

With `serving.guidellm` (the path of a `guidellm` executable, in a venv of its own: it wants a newer
torch than odmoe pins) the same cluster is then driven through the OpenAI HTTP API by GuideLLM at the
same concurrencies (synthetic prompts of `prompt_tokens`, `new_tokens` out, its `ignore_eos`), offline
with the model's own tokenizer directory, and its figures are reported beside ours.
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import threading
import time

import grpc
import httpx

import odmoe
from odmoe.models.open_model import load_tokenizer
from odmoe_bench.cluster_runs import cluster_words
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, percentile, prompts
from odmoe_bench.workload import reference_tokens

SAMPLINGS = [{}, {"do_sample": True, "temperature": 0.8, "seed": 11}]  # greedy, seeded
LOADS = Table(
    "load:<14:name",
    "tok/s:10.1f:tokens_per_s",
    "x c=1:10.2f:throughput_x",
    "TTFT p50:10.1f:ttft_p50_ms",
    "p99:10.1f:ttft_p99_ms",
    "ITL p50:10.2f:itl_p50_ms",
    "p99:10.2f:itl_p99_ms",
    "bytes/tok:>10:megabytes",
    "batch:10.2f:batch_size_mean",
    "differ:>10:differ",
)
GUIDELLM = Table(
    "guidellm:<14:concurrency",
    "tok/s:10.1f:output_tokens_per_s",
    "TTFT p50:10.1f:ttft_p50_ms",
    "p99:10.1f:ttft_p99_ms",
    "ITL p50:10.2f:itl_p50_ms",
    "p99:10.2f:itl_p99_ms",
    "errors:>8:errored",
)


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    from odmoe_bench import plots

    suite = cfg.serving
    tok = load_tokenizer(model_path)
    requests = prompts(tok, suite.prompts, suite.prompt_tokens)
    wanted = _alone_references(model_path, requests, suite.new_tokens)
    words = cluster_words(cfg, f"server.max_running={suite.max_running}", "server.max_waiting=1024")
    loads = []
    with odmoe.LocalCluster(model_path, overrides=words) as cluster:
        _one(cluster, requests[0], 4, {})  # warm-up: every node's first request is slow
        for c in suite.concurrency:
            loads.append(_measure(cluster, f"closed c={c}", lambda c=c: _closed(cluster, requests, c, suite)))
        for rate in suite.rates:
            loads.append(
                _measure(cluster, f"open {rate:g}/s", lambda r=rate: _open(cluster, requests, r, suite))
            )
        external = _guidellm(cluster, model_path, suite, out) if suite.guidellm else None
    for load in loads:
        load["differ"] = sum(tuple(r["tokens"]) != wanted[tuple(r["key"])] for r in load["requests"])
        load.update(_summary(load))
    alone = next((x for x in loads if x["name"] == "closed c=1"), {})
    base, alone_ttft, alone_itl = (alone.get(k) for k in ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms"))
    for load in loads:
        load["throughput_x"] = load["tokens_per_s"] / base if base else None
        load["ttft_x"] = load["ttft_p50_ms"] / alone_ttft if alone_ttft and load["ttft_p50_ms"] else None
        load["itl_x"] = load["itl_p50_ms"] / alone_itl if alone_itl and load["itl_p50_ms"] else None
    report = {
        "max_running": suite.max_running,
        "prompt_tokens": suite.prompt_tokens,
        "new_tokens": suite.new_tokens,
        "loads": [{k: v for k, v in x.items() if k != "requests"} for x in loads],
        "requests": {x["name"]: x["requests"] for x in loads},
        "guidellm": external,
    }
    _print(report, out.describe(suite.new_tokens))
    out.write("serving", "serving", report)
    plots.serving(report, out.path("serving", "png"), out.describe(suite.new_tokens))
    return report


def _alone_references(path: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """(prompt index, sampling index) -> transformers' tokens for that request in one process."""
    return {
        (p, s): tuple(reference_tokens(path, ids, new_tokens, sampling))
        for p, ids in enumerate(prompts)
        for s, sampling in enumerate(SAMPLINGS)
    }


def _one(cluster, ids: list[int], new_tokens: int, sampling: dict, client=None) -> dict:
    """One streamed request: its tokens, when it started, its first token, every token's arrival."""
    own = client is None
    client = client or odmoe.Client(cluster.address, credentials=cluster.credentials)
    start, times, tokens = time.perf_counter(), [], []
    try:
        for piece in client.stream(ids, max_new_tokens=new_tokens, **sampling):
            times.append(time.perf_counter())
            tokens.append(piece.token_id)
    finally:
        if own:
            client.close()
    return {"start": start, "end": time.perf_counter(), "times": times, "tokens": tokens}


def _closed(cluster, prompts, clients: int, suite) -> list[dict]:
    rows: list[dict] = []

    def client_loop(c: int) -> None:
        with odmoe.Client(cluster.address, credentials=cluster.credentials) as client:
            for j in range(suite.requests_per_client):
                p, s = (c * suite.requests_per_client + j) % len(prompts), (c + j) % len(SAMPLINGS)
                row = _one(cluster, prompts[p], suite.new_tokens, SAMPLINGS[s], client)
                rows.append({**row, "key": (p, s), "client": c})

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def _open(cluster, prompts, rate: float, suite) -> list[dict]:
    """Poisson arrivals at `rate` req/s (seeded): each request on its own thread at its time."""
    rng = random.Random(suite.seed)
    rows: list[dict] = []
    refused: list[int] = []

    def arrive(i: int, at: float) -> None:
        time.sleep(max(at - time.perf_counter(), 0.0))
        p, s = i % len(prompts), i % len(SAMPLINGS)
        try:
            rows.append({**_one(cluster, prompts[p], suite.new_tokens, SAMPLINGS[s]), "key": (p, s)})
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            refused.append(i)

    t0, at, threads = time.perf_counter() + 0.2, 0.0, []
    for i in range(suite.open_requests):
        threads.append(threading.Thread(target=arrive, args=(i, t0 + at)))
        at += rng.expovariate(rate)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if refused:
        rows.append({"refused": len(refused)})
    return rows


def _measure(cluster, name: str, drive) -> dict:
    before, cpu_before = _counters(cluster), {**cluster.cpu_seconds(), "client": time.process_time()}
    start = time.perf_counter()
    rows = drive()
    wall = time.perf_counter() - start
    after, cpu_after = _counters(cluster), {**cluster.cpu_seconds(), "client": time.process_time()}
    refused = sum(r.pop("refused", 0) for r in rows if "refused" in r)
    rows = [r for r in rows if "tokens" in r]
    delta = {k: after[k] - before[k] for k in before}
    generated = delta["generation_tokens"]
    print(f"   {name}: {len(rows)} requests in {wall:.1f}s", flush=True)
    return {
        "name": name,
        "wall_s": wall,
        "refused": refused,
        "bytes_per_token": delta["bytes_loaded"] / generated if generated else None,
        "batch_size_mean": delta["batch_sum"] / delta["batch_count"] if delta["batch_count"] else None,
        # where the time goes: each node's CPU (user + system, all threads) per generated token, and
        # this process's (the clients: the same cores)
        "cpu_ms_per_token": {
            node: (cpu_after[node] - used) * 1e3 / generated
            for node, used in cpu_before.items()
            if node in cpu_after and generated
        },
        "requests": [
            {
                "key": list(r["key"]),
                "tokens": r["tokens"],
                "ttft_s": r["times"][0] - r["start"] if r["times"] else None,
                "itl_s": [b - a for a, b in zip(r["times"], r["times"][1:], strict=False)],
                "start": r["start"] - start,
                "end": r["end"] - start,
            }
            for r in rows
        ],
    }


def _counters(cluster) -> dict[str, float]:
    """Main's Prometheus counters this suite reads: bytes loaded, tokens, batch sizes."""
    page = httpx.get(f"{cluster.http_url}/metrics", **cluster.http_auth).text

    def total(pattern: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{pattern}(?:{{[^}}]*}})? (\S+)$", page, re.M))

    return {
        "bytes_loaded": total("odmoe:expert_bytes_loaded_total"),
        "generation_tokens": total("odmoe:generation_tokens_total"),
        "batch_sum": total("odmoe:batch_size_sum"),
        "batch_count": total("odmoe:batch_size_count"),
    }


def _summary(load: dict) -> dict:
    rows = load["requests"]
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    itl = [x for r in rows for x in r["itl_s"]]
    tokens = sum(len(r["tokens"]) for r in rows)
    span = max((r["end"] for r in rows), default=0.0) - min((r["start"] for r in rows), default=0.0)
    ms = 1e3
    return {
        "requests_done": len(rows),
        "tokens": tokens,
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "ttft_p50_ms": percentile(ttft, 0.5) * ms if ttft else None,
        "ttft_p99_ms": percentile(ttft, 0.99) * ms if ttft else None,
        "itl_p50_ms": percentile(itl, 0.5) * ms if itl else None,
        "itl_p99_ms": percentile(itl, 0.99) * ms if itl else None,
        "e2e_mean_s": statistics.fmean(r["end"] - r["start"] for r in rows) if rows else None,
    }


def _print(report: dict, described: str) -> None:
    print(f"serving, {described}, up to {report['max_running']} running requests")
    LOADS.header()
    for x in report["loads"]:
        megabytes = f"{x['bytes_per_token'] / 1e6:.2f}M" if x["bytes_per_token"] else None
        refused = f"  ({x['refused']} refused)" if x["refused"] else ""
        print(LOADS.line(*LOADS.cells(x, megabytes=megabytes)) + refused, flush=True)
    cores = len(os.sched_getaffinity(0))
    print(f"CPU ms per generated token, by node (what {cores} cores cap tokens/s at: {cores} s / the total):")
    for x in report["loads"]:
        cpu = x.get("cpu_ms_per_token") or {}
        total = sum(cpu.values())
        nodes = ", ".join(f"{node} {ms:.1f}" for node, ms in sorted(cpu.items()))
        cap = f"{cores * 1e3 / total:.0f} tok/s" if total else "-"
        print(f"{x['name']:<14}{nodes}; total {total:.1f} (cap {cap})")


def _guidellm(cluster, model_path: str, suite, out: ResultsDir) -> dict:
    """GuideLLM through the HTTP API at each concurrency: its report file, command and figures."""
    name = httpx.get(f"{cluster.http_url}/v1/models", **cluster.http_auth).json()["data"][0]["id"]
    report = out.path("serving-guidellm", "json")
    backend = f"kind=openai_http,target={cluster.http_url},model={name},verify=false"
    command = [
        suite.guidellm, "run",
        "--backend", backend + (f",api_key={cluster.token}" if cluster.token else ""),
        "--profile", "kind=concurrent,streams=1",
        "--override", "profile.streams", ",".join(str(c) for c in suite.concurrency),
        "--constraint", f"kind=max_requests,count={suite.guidellm_requests}",
        "--tokenizer", f"kind=huggingface_auto,model={model_path}",
        "--data", f"kind=synthetic_text,prompt_tokens={suite.prompt_tokens},output_tokens={suite.new_tokens}",
        "--output", f"kind=json,path={report}",
        "--disable-console-interactive",
    ]  # fmt: skip
    shown = " ".join(command).replace(cluster.token, "<token>") if cluster.token else " ".join(command)
    print(f"   guidellm: {shown}", flush=True)
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    rows = []
    for bench in json.loads(report.read_text())["benchmarks"]:
        m = bench["metrics"]

        def stat(key: str, which: str, m=m) -> float | None:
            got = (m.get(key) or {}).get("successful") or {}
            return got.get(which) if which in got else (got.get("percentiles") or {}).get(which)

        rows.append(
            {
                "concurrency": bench["config"]["strategy"].get("streams"),
                "output_tokens_per_s": stat("output_tokens_per_second", "mean"),
                "ttft_p50_ms": stat("time_to_first_token_ms", "median"),
                "ttft_p99_ms": stat("time_to_first_token_ms", "p99"),
                "itl_p50_ms": stat("inter_token_latency_ms", "median"),
                "itl_p99_ms": stat("inter_token_latency_ms", "p99"),
                "requests": (m["request_totals"] or {}).get("successful"),
                "errored": (m["request_totals"] or {}).get("errored"),
            }
        )
    GUIDELLM.header()
    for r in rows:
        GUIDELLM.record(r, concurrency=f"  c={r['concurrency']}", errored=r["errored"] or 0)
    return {"command": shown, "report": str(report), "rows": rows}
