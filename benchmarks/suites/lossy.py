"""Suite `lossy`: what the opt-in lossy miss policies cost in quality for what they gain in speed.

Settings: `reload` (lossless, the baseline), `buddy` over a sweep of its TAE percentile τ, and
`importance` over a sweep of its α, each at every `inject_wrong` level, with a low-precision shadow
aligned on tokens only (`token_period`, `kv_period`) so misses are real. Per setting:
- quality: perplexity of held-out windows the trained model never saw, teacher forced in this
  process with the same substitution decisions (benchmarks/lossy_quality.py), and the substitution
  rate there;
- through a real cluster on the suite's emulated link (`speed=true`): decode tokens/s, stall per
  token, reloads and substitutions per token, and token agreement: the fraction of greedy tokens
  equal to the reload run's on the same prompts (reload's tokens are transformers' own).
Prints the table, writes JSON, and draws the speed-quality curve of each policy (lossy.png).
"""

from __future__ import annotations

import statistics
import sys
import time

from transformers import AutoModelForCausalLM

from odmoe.lossy.miss_policy import MissConfig
from odmoe.lossy.substitution import profile_path
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.shadow.shadow_model import load_shadow_model
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words, run_cluster, summarise
from odmoe_bench.config import BenchConfig, LossySuite
from odmoe_bench.lossy_quality import inject_wrong, perplexity, score_window, shadow_predictions
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, prompts
from odmoe_bench.workload import TRAINING_CORPUS_BYTES

HELD_OUT_FROM = 500  # held-out windows are prompts 500.. (cluster prompts are 0..)

# one space between columns; each width below is the column's less that space
TABLE = Table(
    "inject:6.2f:inject_wrong",
    "policy:<11:policy",
    "value:>5:value",
    "ppl:8.3f:perplexity",
    "subs/tok:8.3f:substitutions_per_token",
    "miss rate:9.3f:miss_rate",
    "agree:6.3f:agreement",
    "tok/s:7.1f:cluster.decode_tokens_per_s.mean",
    "stall ms/tok:12.2f:cluster.stall_ms_per_token",
    "reloads/tok:11.2f:cluster.reloads_per_token",
    "c.subs/tok:10.2f:cluster_substitutions_per_token",
    sep=" ",
)


def settings(suite: LossySuite) -> list[tuple[str, float | None, MissConfig]]:
    """(policy, swept value, config) of every setting the suite runs, reload first."""
    common = dict(budget=suite.budget, alpha=suite.buddy_alpha, k_max=suite.buddy_k_max)
    out: list[tuple[str, float | None, MissConfig]] = [("reload", None, MissConfig())]
    out += [("buddy", p, MissConfig("buddy", tae_percentile=p, **common)) for p in suite.buddy_percentiles]
    out += [
        ("importance", a, MissConfig("importance", importance_alpha=a, **common))
        for a in suite.importance_alphas
    ]
    return out


def ensure_profile(model_path: str, tokens: int) -> None:
    """odmoe-profile's default output, made once (over the model's training corpus, not the held-out text)."""
    if profile_path(model_path).is_file():
        return
    from odmoe.launch.profile import main as profile_main

    print(f"profiling {model_path} over {tokens} calibration tokens", flush=True)
    if profile_main([model_path, "--tokens", str(tokens)]) != 0:
        raise RuntimeError("odmoe-profile failed")


def miss_words(cfg: MissConfig) -> list[str]:
    return [
        f"miss.policy={cfg.policy}",
        f"miss.budget={cfg.budget}",
        f"miss.tae_percentile={cfg.tae_percentile}",
        f"miss.alpha={cfg.alpha}",
        f"miss.k_max={cfg.k_max}",
        f"miss.importance_alpha={cfg.importance_alpha}",
    ]


def agreement(tokens: list[list[int]], lossless: list[list[int]]) -> float:
    """Fraction of greedy tokens equal to the lossless run's, position by position, over all prompts."""
    same = total = 0
    for got, want in zip(tokens, lossless, strict=True):
        n = max(len(got), len(want))
        same += sum(a == b for a, b in zip(got, want, strict=False))
        total += n
    return same / total if total else 1.0


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.lossy
    ensure_profile(model_path, suite.profile_tokens)
    checkpoint = open_checkpoint(model_path)
    experts = checkpoint.num_experts
    tokenizer = load_tokenizer(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    shadow = load_shadow_model(model_path, suite.shadow_precision)
    windows = prompts(tokenizer, suite.texts, suite.text_tokens, first=HELD_OUT_FROM)
    predictions = [shadow_predictions(shadow, ids, experts) for ids in windows]
    requests = prompts(tokenizer, suite.prompts, suite.prompt_tokens)
    TABLE.header()
    rows, started = [], time.perf_counter()
    for rate in suite.inject_wrong:
        wrong = [inject_wrong(p, rate, experts, seed=i) for i, p in enumerate(predictions)]
        lossless: list[list[int]] | None = None
        for policy, value, miss in settings(suite):
            scored = [
                score_window(model, ids, suite.prompt_tokens, p, miss, model_path, experts)
                for ids, p in zip(windows, wrong, strict=True)
            ]
            decode_positions = sum(r.scored + 1 for r in scored)
            row = {
                "inject_wrong": rate,
                "policy": policy,
                "value": value,
                "miss": vars(miss),
                "perplexity": perplexity(scored),
                "substitutions_per_token": sum(r.substitutions for r in scored) / decode_positions,
                "miss_rate": sum(r.misses for r in scored) / max(sum(r.activated for r in scored), 1),
            }
            if suite.speed:
                words = cluster_words(
                    cfg,
                    f"shadow.precision={suite.shadow_precision}",
                    f"emulation.inject_wrong={rate}",
                    f"alignment.token_period={suite.token_period}",
                    f"alignment.kv_period={suite.kv_period}",
                    *miss_words(miss),
                )
                run_ = run_cluster(model_path, words, requests, suite.new_tokens)
                lossless = run_.token_ids if policy == "reload" else lossless
                summary = summarise(run_)
                decode = [s["new_tokens"] - 1 for s in run_.stats]
                row["cluster"] = summary
                row["agreement"] = agreement(run_.token_ids, lossless or run_.token_ids)
                row["cluster_substitutions_per_token"] = statistics.mean(
                    s["substitutions"] / max(d, 1) for s, d in zip(run_.stats, decode, strict=True)
                )
                row["exact"] = all(s["exact"] for s in run_.stats)
            rows.append(row)
            _print_row(row)
    print(f"({time.perf_counter() - started:.0f}s)", file=sys.stderr)
    report = {
        "suite_settings": vars(suite),
        "held_out_windows": suite.texts,
        "training_corpus_bytes": TRAINING_CORPUS_BYTES,
        "quality_method": "teacher-forced in-process with the cluster's substitution decisions",
        "rows": rows,
    }
    out.write("lossy", "lossy", report)
    plots.lossy(rows, out.path("lossy", "png"), subtitle(cfg, out))
    return report


def subtitle(cfg: BenchConfig, out: ResultsDir) -> str:
    """What the figure was measured on (the suite's own shadow, not cluster.shadow_precision)."""
    c, link, suite = cfg.cluster, cfg.link, cfg.lossy
    on = f"{link.bandwidth_gbps:g} Gbit/s + {link.latency_ms:g} ms emulated load link"
    return (
        f"{c.workers} workers in groups of {c.group_size}, {on if out.link_on else 'no emulated link'}, "
        f"{suite.new_tokens} new tokens; {suite.shadow_precision} shadow, token period {suite.token_period}, "
        f"KV period {suite.kv_period}; budget {suite.budget}/token; {suite.texts} held-out windows"
    )


def _print_row(row: dict) -> None:
    value = None if row["value"] is None else f"{row['value']:g}"
    TABLE.record(row, value=value)
