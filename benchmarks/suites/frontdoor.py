"""Suite `frontdoor`: what the OpenAI-compatible HTTP path costs against the gRPC path.

One local cluster; the same requests (prompt token ids, `frontdoor.new_tokens` each, greedy and
seeded-sampled) go through three client paths, interleaved request by request so drift in the
machine's load hits every path alike:
- grpc: `odmoe.Client.stream` (main's gRPC API);
- http_stream: the official `openai` client, `completions.create(stream=True)` (SSE);
- http_whole: the same, not streamed.
Per path it reports client-side TTFT (streamed paths), end-to-end time and decode tokens/s, and the
HTTP paths' overhead against gRPC per request and per token (paired differences, median). Every
path must give the same text for the same request: that is checked, not assumed.
"""

from __future__ import annotations

import statistics
import time

import odmoe
from odmoe.models.open_model import load_tokenizer
from odmoe_bench.cluster_runs import cluster_words
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, alternated, median, prompts

PATHS = ("grpc", "http_stream", "http_whole")
TABLE = Table(
    "path:<13",
    "TTFT ms:9.1f",
    "e2e ms:9.1f",
    "decode tok/s:14.1f",
    "Δe2e ms:>9",
    "Δe2e %:8.1f",
    "Δ/token ms:11.2f",
)


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    import httpx
    import openai

    suite = cfg.frontdoor
    tok = load_tokenizer(model_path)
    requests = prompts(tok, suite.prompts, suite.prompt_tokens)
    samplings = [{}, {"temperature": 0.8, "seed": 7}] if suite.sampled else [{}]
    rows: dict[str, list[dict]] = {p: [] for p in PATHS}
    mismatches = 0
    with odmoe.LocalCluster(model_path, overrides=cluster_words(cfg)) as cluster:
        api = openai.OpenAI(
            base_url=cluster.http_url + "/v1",
            api_key=cluster.token or "unused",
            max_retries=0,
            http_client=httpx.Client(verify=cluster.http_auth.get("verify", True)),
        )
        name = api.models.list().data[0].id
        _grpc(cluster.client, name, requests[0], 4, {})  # warm-up, both doors
        _http_stream(api, name, requests[0], 4, {})
        for r in range(suite.repeats):
            for ids in requests:
                for sampling in samplings:
                    texts = {}
                    for path in alternated(r, PATHS):
                        row = PATH_FUNCS[path](
                            cluster.client if path == "grpc" else api, name, ids, suite.new_tokens, sampling
                        )
                        texts[path] = row.pop("text")
                        rows[path].append(row)
                    mismatches += len(set(texts.values())) != 1
    report = {
        "new_tokens": suite.new_tokens,
        "prompt_tokens": suite.prompt_tokens,
        "requests_per_path": len(rows["grpc"]),
        "texts_differ": mismatches,
        "paths": {p: _summary(rows[p]) for p in PATHS},
        "overhead_vs_grpc": {p: _overhead(rows[p], rows["grpc"]) for p in PATHS[1:]},
        "rows": rows,
    }
    _print(report)
    out.write("frontdoor", "frontdoor", report)
    return report


def _grpc(client, _name, ids, new_tokens, sampling) -> dict:
    start, first, text, n = time.perf_counter(), None, [], 0
    do_sample = {"do_sample": True, **sampling} if sampling else {}
    for piece in client.stream(ids, max_new_tokens=new_tokens, **do_sample):
        first = first or time.perf_counter()
        text.append(piece.text)
        n += 1
    return _row(start, first, time.perf_counter(), n, "".join(text))


def _http_stream(api, name, ids, new_tokens, sampling) -> dict:
    start, first, text, n = time.perf_counter(), None, [], 0
    temperature = sampling.get("temperature", 0)
    stream = api.completions.create(
        model=name,
        prompt=ids,
        max_tokens=new_tokens,
        temperature=temperature,
        seed=sampling.get("seed"),
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].text)
        if chunk.usage:
            n = chunk.usage.completion_tokens
    return _row(start, first, time.perf_counter(), n, "".join(text))


def _http_whole(api, name, ids, new_tokens, sampling) -> dict:
    start = time.perf_counter()
    answer = api.completions.create(
        model=name,
        prompt=ids,
        max_tokens=new_tokens,
        temperature=sampling.get("temperature", 0),
        seed=sampling.get("seed"),
    )
    return _row(start, None, time.perf_counter(), answer.usage.completion_tokens, answer.choices[0].text)


PATH_FUNCS = {"grpc": _grpc, "http_stream": _http_stream, "http_whole": _http_whole}


def _row(start, first, end, tokens, text) -> dict:
    ttft = None if first is None else first - start
    decode = None if first is None or tokens < 2 else (tokens - 1) / (end - first)
    return {
        "ttft_s": ttft,
        "e2e_s": end - start,
        "tokens": tokens,
        "decode_tokens_per_s": decode,
        "text": text,
    }


def _summary(rows: list[dict]) -> dict:
    return {k: median(r[k] for r in rows) for k in ("ttft_s", "e2e_s", "decode_tokens_per_s")}


def _overhead(rows: list[dict], grpc: list[dict]) -> dict:
    """Paired (same request) differences against gRPC, median over requests."""
    e2e = [r["e2e_s"] - g["e2e_s"] for r, g in zip(rows, grpc, strict=True)]
    per_token = [d / max(g["tokens"], 1) for d, g in zip(e2e, grpc, strict=True)]
    ttft = [r["ttft_s"] - g["ttft_s"] for r, g in zip(rows, grpc, strict=True) if r["ttft_s"] and g["ttft_s"]]
    return {
        "e2e_ms": statistics.median(e2e) * 1e3,
        "e2e_pct": statistics.median(d / g["e2e_s"] for d, g in zip(e2e, grpc, strict=True)) * 100,
        "per_token_ms": statistics.median(per_token) * 1e3,
        "ttft_ms": statistics.median(ttft) * 1e3 if ttft else None,
    }


def _print(report: dict) -> None:
    print(
        f"{report['requests_per_path']} requests per path, {report['prompt_tokens']} prompt tokens, "
        f"{report['new_tokens']} new tokens; texts differing between paths: {report['texts_differ']}"
    )
    TABLE.header()
    for path, s in report["paths"].items():
        o = report["overhead_vs_grpc"].get(path) or {}  # none for gRPC itself: the base
        TABLE.row(
            path,
            s["ttft_s"] * 1e3 if s["ttft_s"] is not None else None,
            s["e2e_s"] * 1e3,
            s["decode_tokens_per_s"] or None,
            f"{o['e2e_ms']:.1f}" if o else "(base)",
            o.get("e2e_pct"),
            o.get("per_token_ms"),
        )
