"""Suite `security`: what authenticated, encrypted transport costs (odmoe/transport/security.py).

Each round starts two local clusters on the same model side by side, one with security on (the
default: CurveZMQ on every ZeroMQ socket, gRPC over TLS with the bearer token) and one with
`security.enabled=false` (the start order alternates between rounds), then streams the same
prompts through both, alternating which goes first, so both see the same machine load. Reported per
mode: decode tokens/s (main's own figure: the decode loop, where every expert call crosses CURVE),
TTFT as the client sees it (TLS included), the cluster's wall-clock start, and main's connect time
(from its first connection to the last worker's Pong: TCP + CURVE handshakes + ZAP + a ping). The
tokens of both must be identical: security changes who may talk, never what is said.
"""

from __future__ import annotations

import json
import time

import odmoe
from odmoe.models.open_model import load_tokenizer
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, alternated, change_pct, median, prompts

MODES = ("on", "off")
TABLE = Table(
    "security:<10",
    *(f"{h}:14.2f" for h in ("decode tok/s", "TTFT ms", "main TTFT ms", "start s", "connect ms")),
)


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:

    suite = cfg.security
    tok = load_tokenizer(model_path)
    requests = prompts(tok, suite.prompts, suite.prompt_tokens)
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    starts: dict[str, list[dict]] = {m: [] for m in MODES}
    mismatches = 0
    for rnd in range(suite.rounds):
        clusters = {}
        try:
            for mode in alternated(rnd, MODES):
                words = cluster_words(cfg, f"security.enabled={'true' if mode == 'on' else 'false'}")
                began = time.perf_counter()
                clusters[mode] = odmoe.LocalCluster(model_path, overrides=words).start()
                wall = time.perf_counter() - began
                starts[mode].append({"start_s": wall, "connect_s": clusters[mode].main_info.get("connect_s")})
                _request(clusters[mode].client, requests[0], 4)  # warm-up
            for r in range(suite.repeats):
                for ids in requests:
                    texts = {}
                    for mode in alternated(rnd + r, MODES):
                        row = _request(clusters[mode].client, ids, suite.new_tokens)
                        texts[mode] = row.pop("token_ids")
                        rows[mode].append(row)
                    mismatches += texts["on"] != texts["off"]
        finally:
            for cluster in clusters.values():
                cluster.stop()
    report = {
        "rounds": suite.rounds,
        "requests_per_mode": len(rows["on"]),
        "prompt_tokens": suite.prompt_tokens,
        "new_tokens": suite.new_tokens,
        "tokens_differ": mismatches,
        "modes": {m: _summary(rows[m], starts[m]) for m in MODES},
        "rows": rows,
        "starts": starts,
    }
    on, off = report["modes"]["on"], report["modes"]["off"]
    report["cost"] = {
        "decode_tokens_per_s_pct": change_pct(on["decode_tokens_per_s"], off["decode_tokens_per_s"]),
        "ttft_ms": _ms(_diff(on["ttft_s"], off["ttft_s"])),
        "start_s": _diff(on["start_s"], off["start_s"]),
        "connect_ms": _ms(_diff(on["connect_s"], off["connect_s"])),
    }
    _print(report)
    out.write("security", "security", report)
    plots.security(report, out.path("security", "png"), out.describe(suite.new_tokens))
    return report


def _request(client, ids, new_tokens: int) -> dict:
    start, first, token_ids, stats = time.perf_counter(), None, [], {}
    for reply in client._replies(ids, new_tokens):
        if reply.WhichOneof("kind") == "token":
            first = first or time.perf_counter()
            token_ids.append(reply.token.token_id)
        else:
            stats = json.loads(reply.done.stats_json)
    return {
        "ttft_s": (first or time.perf_counter()) - start,
        "e2e_s": time.perf_counter() - start,
        "decode_tokens_per_s": stats.get("decode_tokens_per_s"),
        "main_ttft_s": stats.get("ttft_s"),
        "token_ids": token_ids,
    }


def _summary(rows: list[dict], starts: list[dict]) -> dict:
    return {
        "decode_tokens_per_s": median(r["decode_tokens_per_s"] for r in rows),
        "ttft_s": median(r["ttft_s"] for r in rows),
        "main_ttft_s": median(r["main_ttft_s"] for r in rows),
        "e2e_s": median(r["e2e_s"] for r in rows),
        "start_s": median(s["start_s"] for s in starts),
        "connect_s": median(s["connect_s"] for s in starts),
    }


def _diff(on: float | None, off: float | None) -> float | None:
    return None if on is None or off is None else on - off


def _print(report: dict) -> None:
    print(
        f"{report['rounds']} rounds, {report['requests_per_mode']} requests per mode, "
        f"{report['prompt_tokens']} prompt tokens, {report['new_tokens']} new tokens; "
        f"token sequences differing: {report['tokens_differ']}"
    )
    TABLE.header()
    for mode, s in report["modes"].items():
        TABLE.row(
            mode,
            s["decode_tokens_per_s"],
            _ms(s["ttft_s"]),
            _ms(s["main_ttft_s"]),
            s["start_s"],
            _ms(s["connect_s"]),
        )
    c = {k: v or 0 for k, v in report["cost"].items()}
    print(
        f"cost of security: decode {c['decode_tokens_per_s_pct']:+.1f} %, TTFT {c['ttft_ms']:+.1f} ms, "
        f"start {c['start_s']:+.1f} s, main's connect {c['connect_ms']:+.1f} ms"
    )


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3
