"""Suite `compression`: odmoe's lossless expert store, in one run on the same weights.

1. Ratios (stored / raw bytes) over every expert of the model, per dtype and tensor kind: odmoe's
   store (exponent byte zstd-coded in chunks, sign+mantissa raw: what a load moves), zipnn (when
   installed; on a copy, as it compresses in place), plain zstd and lz4 of the whole tensor, and the
   Shannon bound of the exponent field ((H(exponent) + the other bits) / all bits: what any coder of
   the exponent alone, with the rest stored raw, could reach). Also on random-init weights.
2. Decompression speed: GB/s of decompressed expert bytes through the store's own load path
   (chunks on a pool of N threads, recombined into a slot), per thread count; zipnn's beside it.
3. Decode tokens/s of clusters with `worker.store=memory|compressed|disk` (the pack file present)
   and of the LRU offloader, all at `compression.dtype` over a storage-bound emulated link
   (`compression.bandwidth_gbps`). The link charges the bytes a load moves: compressed bytes for
   the compressed and disk (pack) stores — fewer bytes moved is the point of compressing.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash
import zstandard

from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.tools.model_names import resolve_model
from odmoe.worker.bitfields import byte_view, join_into, split
from odmoe.worker.compressed_tensor import DEFAULT_CHUNK_ELEMS, MemoryBytes, compress, exponent_compressor
from odmoe.worker.expert_pack import write_pack
from odmoe.worker.expert_sources import CompressedExpert
from odmoe_bench import plots
from odmoe_bench.baselines import run_in_child
from odmoe_bench.cluster_runs import cluster_words, run_cluster, spread, summarise
from odmoe_bench.config import BenchConfig, BenchLink
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, prompts

KINDS = ("gate_up", "down")
METHODS = ("odmoe", "zstd", "lz4", "zipnn")
RATIOS = ("odmoe", "zipnn", "zstd", "lz4", "bound")  # the ratio table's columns
EXPONENT_BITS = {torch.bfloat16: (7, 8), torch.float16: (10, 5), torch.float32: (23, 8)}  # (shift, width)


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.compression
    report: dict = {"ratios": {}, "speed": {}, "decode": {}}
    models = {"model": model_path}
    if suite.random_init and cfg.model != "tiny":
        models["random-init (tiny)"] = resolve_model("tiny")
    for label, path in models.items():
        experts = _experts(path)
        report["ratios"][label] = {d: ratios(experts, getattr(torch, d)) for d in suite.dtypes}
        _print_ratios(label, path, report["ratios"][label])
    experts = _experts(model_path)
    for d in suite.dtypes:
        report["speed"][d] = speed(experts, getattr(torch, d), suite.threads, suite.speed_repeats)
    _print_speed(report["speed"])
    report["coders"] = coders(experts)
    report["chunk_stages_us"] = chunk_stages(experts)
    _print_coders(report["coders"], report["chunk_stages_us"])
    if suite.systems:
        report["decode"] = decode(cfg, model_path)
        _print_decode(report["decode"], suite)
    out.write("compression", "compression", report)
    plots.compression(report, out.path("compression", "png"), _subtitle(cfg))
    return report


def _subtitle(cfg: BenchConfig) -> str:
    c = cfg.compression
    return f"decode: {c.dtype}, {c.bandwidth_gbps:g} Gbit/s + {c.latency_ms:g} ms emulated storage link"


def _experts(path: str) -> list[tuple[str, torch.Tensor]]:
    ckpt = open_checkpoint(path)
    out = []
    for layer in ckpt.moe_layers:
        for e in range(ckpt.num_experts):
            w = ckpt.expert(layer, e)
            out += [("gate_up", w.gate_up), ("down", w.down)]
    return out


# -- 1. ratios -----------------------------------------------------------------------------------
def ratios(experts: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, dict]:
    """Per kind and "all": raw bytes and stored/raw of each method, over every expert at dtype."""
    zipnn, lz4, zstd = _zipnn(dtype), _lz4(), zstandard.ZstdCompressor(level=3)
    sums = {kind: dict.fromkeys(("raw", *METHODS), 0) for kind in KINDS}
    counts = {kind: 0 for kind in KINDS}
    for kind, weights in experts:
        t = weights.to(dtype).contiguous()
        row = sums[kind]
        row["raw"] += t.numel() * t.element_size()
        row["odmoe"] += compress(t)[0].nbytes
        row["zstd"] += len(zstd.compress(_bytes(t)))
        row["lz4"] += len(lz4.compress(_bytes(t))) if lz4 else 0
        row["zipnn"] += len(zipnn.compress(t.clone())) if zipnn else 0  # it compresses in place
        counts[kind] = counts[kind] + exponent_counts(t)
    sums["all"] = {k: sums["gate_up"][k] + sums["down"][k] for k in sums["gate_up"]}
    counts["all"] = counts["gate_up"] + counts["down"]
    rows = {}
    for kind, row in sums.items():
        raw = max(row["raw"], 1)
        out = {"raw_bytes": row["raw"], **{m: row[m] / raw for m in METHODS}}
        out["lz4"] = out["lz4"] if lz4 else None
        out["zipnn"] = out["zipnn"] if zipnn else None
        out["bound"], out["exponent_entropy_bits"] = shannon_bound(counts[kind], dtype)
        rows[kind] = out
    return rows


def exponent_counts(t: torch.Tensor) -> np.ndarray:
    """How often each value of t's exponent field occurs."""
    shift, width = EXPONENT_BITS[t.dtype]
    u = byte_view(t).view("<u2" if t.element_size() == 2 else "<u4").reshape(-1)
    return np.bincount(((u >> shift) & ((1 << width) - 1)).astype(np.int64), minlength=1 << width)


def shannon_bound(counts: np.ndarray, dtype: torch.dtype) -> tuple[float, float]:
    """(H(exponent field) + the other bits) / all bits, and H in bits per element."""
    p = counts[counts > 0] / max(counts.sum(), 1)
    entropy = float(-(p * np.log2(p)).sum())
    bits, width = dtype.itemsize * 8, EXPONENT_BITS[dtype][1]
    return (entropy + bits - width) / bits, entropy


def _bytes(t: torch.Tensor) -> bytes:
    return byte_view(t).tobytes()


def _lz4():
    try:
        import lz4.frame

        return lz4.frame
    except ImportError:
        return None


def _zipnn(dtype: torch.dtype, threads: int = 1):
    try:
        from zipnn import ZipNN
    except ImportError:
        return None
    name = str(dtype).removeprefix("torch.")
    return ZipNN(input_format="torch", bytearray_dtype=name, threads=threads)


def _print_ratios(label: str, path: str, by_dtype: dict) -> None:
    print(f"\nstored / raw bytes, every expert of {label} ({path})")
    table = Table(
        "dtype:<10", "tensor:<9", "raw MiB:9.2f", *(f"{k}:8.1%" for k in RATIOS), "H(exp) bits:13.2f"
    )
    table.header()
    for dtype, rows in by_dtype.items():
        for kind, r in rows.items():
            table.row(
                dtype, kind, r["raw_bytes"] / 2**20, *(r[k] for k in RATIOS), r["exponent_entropy_bits"]
            )
    for name, coder in (("zipnn", _zipnn(torch.bfloat16)), ("lz4", _lz4())):
        if coder is None:
            print(f"{name}: not installed (pip install {name}, the compression extra): its column is empty")


# -- 2. decompression speed ----------------------------------------------------------------------
def speed(experts, dtype: torch.dtype, threads: list[int], repeats: int) -> dict:
    """GB/s of decompressed bytes, odmoe's load path (pool of N) and zipnn's (threads=N), per N."""
    pairs = [(experts[i][1].to(dtype), experts[i + 1][1].to(dtype)) for i in range(0, len(experts), 2)]
    stored = []
    for gate_up, down in pairs:
        a, blob_a = compress(gate_up)
        b, blob_b = compress(down, base=len(blob_a))
        stored.append(CompressedExpert(a, b, MemoryBytes(blob_a + blob_b), False, "bench"))
    slot = (torch.empty_like(pairs[0][0]), torch.empty_like(pairs[0][1]))
    raw = sum((g.numel() + d.numel()) * dtype.itemsize for g, d in pairs)
    row: dict = {"raw_bytes": raw, "odmoe_gbps": {}, "zipnn_gbps": {}}
    for n in threads:
        with ThreadPoolExecutor(n) as pool:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                for expert in stored:
                    expert.load_into(*slot, pool)
                times.append(time.perf_counter() - start)
        row["odmoe_gbps"][n] = raw / statistics.median(times) / 1e9
        zipnn = _zipnn(dtype, threads=n)
        if zipnn is not None:
            blobs = [zipnn.compress(t.clone()) for pair in pairs for t in pair]
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                for blob in blobs:
                    zipnn.decompress(blob)
                times.append(time.perf_counter() - start)
            row["zipnn_gbps"][n] = raw / statistics.median(times) / 1e9
    return row


def _print_speed(rows: dict) -> None:
    print("\ndecompression GB/s (decompressed expert bytes per second; median of repeats)")
    for dtype, r in rows.items():
        for n, gbps in r["odmoe_gbps"].items():
            z = r["zipnn_gbps"].get(n)
            zipnn = f"zipnn {z:.2f}" if z is not None else "zipnn -"
            print(f"{dtype:<10}{n} thread(s): odmoe {gbps:.2f}   {zipnn}")


def coders(experts, sample: int = 8) -> dict[str, dict]:
    """bf16 exponent streams of `sample` gate_up tensors in 64 Ki chunks: bits per exponent and
    compress / decompress MB/s (of exponent bytes) of zstd level 3, level 19 and odmoe's parameters."""
    streams = [split(t.to(torch.bfloat16).contiguous())[0].tobytes() for k, t in experts[: 2 * sample]]
    chunks = [s[i : i + DEFAULT_CHUNK_ELEMS] for s in streams for i in range(0, len(s), DEFAULT_CHUNK_ELEMS)]
    raw = sum(len(c) for c in chunks)
    out = {}
    for name, level in (("zstd level 3", 3), ("zstd level 19", 19), ("odmoe parameters", None)):
        coder, decoder = exponent_compressor(level), zstandard.ZstdDecompressor()
        start = time.perf_counter()
        blobs = [coder.compress(c) for c in chunks]
        packed = time.perf_counter() - start
        start = time.perf_counter()
        for b in blobs:
            decoder.decompress(b)
        unpacked = time.perf_counter() - start
        out[name] = {
            "bits_per_exponent": sum(len(b) for b in blobs) * 8 / raw,
            "compress_mb_s": raw / packed / 1e6,
            "decompress_mb_s": raw / unpacked / 1e6,
        }
    return out


def chunk_stages(experts, repeats: int = 50) -> dict[str, float]:
    """Microseconds per stage of one 64 Ki-element bf16 chunk: checksum, zstd, recombine."""
    t = experts[0][1].to(torch.bfloat16).contiguous()
    ct, data = compress(t)
    c = ct.chunks[0]
    chunk = data[c.offset : c.offset + c.nbytes]
    decoder = zstandard.ZstdDecompressor()
    exp = np.frombuffer(decoder.decompress(chunk[: c.exponent_len], max_output_size=c.elems), np.uint8)
    rest = np.frombuffer(chunk[c.exponent_len :], np.uint8).reshape(c.elems, 1)
    dest = byte_view(torch.empty_like(t))[: c.elems]
    stages = {
        "checksum": lambda: xxhash.xxh3_64_intdigest(chunk),
        "zstd": lambda: decoder.decompress(chunk[: c.exponent_len], max_output_size=c.elems),
        "recombine": lambda: join_into(dest, exp, rest, torch.bfloat16),
    }
    out = {"elems": c.elems}
    for name, stage in stages.items():
        start = time.perf_counter()
        for _ in range(repeats):
            stage()
        out[name] = (time.perf_counter() - start) / repeats * 1e6
    return out


def _print_coders(rows: dict, stages: dict) -> None:
    print("\nbf16 exponent streams, 64 Ki chunks: bits/exponent, compress / decompress MB/s (exponent bytes)")
    for name, r in rows.items():
        print(
            f"{name:<18}{r['bits_per_exponent']:6.2f} bits  {r['compress_mb_s']:8.1f} MB/s  "
            f"{r['decompress_mb_s']:8.1f} MB/s"
        )
    print(
        f"one bf16 chunk of {stages['elems']} elements: checksum {stages['checksum']:.0f} us, "
        f"zstd {stages['zstd']:.0f} us, recombine {stages['recombine']:.0f} us"
    )


# -- 3. decode tokens/s --------------------------------------------------------------------------
def decode(cfg: BenchConfig, model_path: str) -> dict:
    suite = cfg.compression
    tokenizer = load_tokenizer(model_path)
    requests = prompts(tokenizer, suite.repeats, first=200)
    link_cfg = dataclasses.replace(cfg, link=BenchLink(suite.bandwidth_gbps, suite.latency_ms))
    results = {}
    with tempfile.TemporaryDirectory(prefix="odmoe-pack-") as pack_dir:
        if {"compressed", "disk"} & set(suite.systems):
            write_pack(open_checkpoint(model_path), pack_dir, getattr(torch, suite.dtype))
        for system in suite.systems:
            print(f"-- {system}", flush=True)
            if system == "lru_offloader":
                results[system] = _lru(cfg, model_path, requests)
                continue
            words = cluster_words(
                link_cfg,
                f"model.dtype={suite.dtype}",
                f"worker.store={system}",
                f"worker.pack_dir={pack_dir}",
            )
            run = run_cluster(model_path, words, requests, suite.new_tokens)
            row = summarise(run)
            row["token_ids"] = run.token_ids
            row["bytes_loaded_per_token"] = statistics.mean(
                s["bytes_loaded"] / max(s["new_tokens"] - 1, 1) for s in run.stats
            )
            results[system] = row
    first = next(iter(results.values()))["token_ids"]
    for row in results.values():
        row["tokens_identical"] = row["token_ids"] == first
    return results


def _lru(cfg: BenchConfig, model_path: str, prompts: list[list[int]]) -> dict:
    suite = cfg.compression
    cells = [{"name": "decode", "prompts": prompts, "new_tokens": suite.new_tokens}]
    report = run_in_child(
        "lru_offloader", model_path, cells, threads=1, lru_experts=suite.lru_experts,
        bandwidth_gbps=suite.bandwidth_gbps, latency_ms=suite.latency_ms, dtype=suite.dtype,
    )  # fmt: skip
    runs = report["cells"][0]["runs"]
    return {
        "decode_tokens_per_s": spread([r["decode_tokens_per_s"] for r in runs]),
        "lru_hit_rate": report["cells"][0].get("lru_hit_rate"),
        "peak_rss_bytes": {"lru_offloader": report["peak_rss_bytes"]},
        "token_ids": [r["token_ids"] for r in runs],
    }


def _print_decode(rows: dict, suite) -> None:
    print(
        f"\ndecode tokens/s at {suite.dtype} over a {suite.bandwidth_gbps:g} Gbit/s + "
        f"{suite.latency_ms:g} ms link, {suite.repeats} requests x {suite.new_tokens} tokens"
    )
    table = Table(
        "system:<16",
        "decode tok/s:>16",
        "stall ms/token:16.2f",
        "KiB moved/token:17.1f",
        "worker RSS MiB:16.0f",
    )
    table.header()
    for name, r in rows.items():
        d = r["decode_tokens_per_s"]
        moved = r.get("bytes_loaded_per_token")
        rss = r.get("peak_rss_bytes") or {}
        worker_rss = max((v for k, v in rss.items() if k.startswith(("worker", "lru"))), default=None)
        table.row(
            name,
            f"{d['mean']:9.1f} ± {d['stdev']:4.1f}",
            r.get("stall_ms_per_token"),
            moved / 1024 if moved else None,
            worker_rss and worker_rss / 2**20,
        )
    print(f"tokens identical across systems: {all(r['tokens_identical'] for r in rows.values())}")
