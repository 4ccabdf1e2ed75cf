"""Suite `prefill`: time to first token of batched prefill per prefill setting, beside one process.

Each entry of `prefill.configurations` (`prefill.mini_batch` x `prefill.placement`, optionally
`prefill.compute_per_mini_batch`) is a local cluster of its own without a shadow (the prompt is what
is measured; the suite's cluster shape and link). Per prompt length it sends the same prompt
`prefill.repeats` times after a warm-up and keeps the median request's TTFT (main's own figure) with
main's split of it: its own work, the critical path's expert load + compute, transfer and queueing.
The single-process reference is transformers' `generate()` in this process with `prefill.threads`
torch threads (each cluster node runs on one). Rows computed per mini-batch are not bit-exact by
design; every other row's first token must be the reference's.

Then, with `prefill.prompt_kv`, two clusters with a low-precision shadow aligned on tokens only (no
periodic K/V) say whether handing the shadow main's prompt K/V (`alignment.prefill_kv`) changes the
recall of the first decode tokens.
"""

from __future__ import annotations

import statistics

from odmoe.models.open_model import load_tokenizer
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words, recall_per_token, run_cluster
from odmoe_bench.config import BenchConfig, prefill_configuration
from odmoe_bench.results import ResultsDir
from odmoe_bench.workload import prompt_ids


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.prefill
    tokenizer = load_tokenizer(model_path)
    prompts = {n: prompt_ids(tokenizer, 0, n) for n in suite.lengths}  # one prompt, cut to each length
    report: dict = {"lengths": suite.lengths, "repeats": suite.repeats, "threads": suite.threads}
    if suite.prompt_kv:
        report["prompt_kv"] = prompt_kv_effect(cfg, model_path, tokenizer)
        _print_prompt_kv(report["prompt_kv"])
    reference = reference_ttft(model_path, prompts, suite.repeats, suite.threads)
    report["reference_ttft_s"] = {n: r["ttft_s"] for n, r in reference.items()}
    report["reference_first_token"] = {n: r["token_id"] for n, r in reference.items()}
    print(
        f"TTFT ms (median of {suite.repeats}); reference single process: "
        + ", ".join(f"{n} tokens {s * 1e3:.1f}" for n, s in report["reference_ttft_s"].items())
    )
    print(
        f"{'mini_batch':>10} {'placement':9} {'exact':6}"
        + "".join(f"{f'{n} tok':>9}" for n in suite.lengths)
        + f"{'experts/layer ' + '|'.join(map(str, suite.lengths)):>22}"
    )
    report["rows"] = []
    for configuration in suite.configurations:
        row = cluster_ttft(cfg, model_path, configuration, prompts, report["reference_first_token"])
        report["rows"].append(row)
        _print_row(row, suite.lengths)
    _print_summary(report)
    out.write("prefill", "prefill", report)
    plots.prefill(report, out.path("prefill", "png"), _describe(cfg, out))
    return report


def reference_ttft(model_path: str, prompts: dict[int, list[int]], repeats: int, threads: int) -> dict:
    """transformers in this process: per length, the median TTFT of `repeats` one-token generates."""
    import torch
    from transformers import AutoModelForCausalLM

    from odmoe_bench.baselines import timed_generate

    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # as a cluster node runs; the suites after this one get theirs back
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path).eval()
        timed_generate(model, next(iter(prompts.values())), 1)  # warm-up, as the clusters get
        result = {}
        for n, ids in prompts.items():
            runs = [timed_generate(model, ids, 1) for _ in range(repeats)]
            result[str(n)] = {
                "ttft_s": statistics.median(r["ttft_s"] for r in runs),
                "token_id": runs[0]["token_ids"][0],
            }
    finally:
        torch.set_num_threads(before)
    return result


def cluster_ttft(
    cfg: BenchConfig,
    model_path: str,
    configuration: str,
    prompts: dict[int, list[int]],
    reference_tokens: dict[str, int],
) -> dict:
    """One cluster with this prefill setting: per length, the median request's TTFT and main's split."""
    mini_batch, placement, per_part = prefill_configuration(configuration)
    words = cluster_words(
        cfg,
        f"prefill.mini_batch={mini_batch}",
        f"prefill.placement={placement}",
        f"prefill.compute_per_mini_batch={str(per_part).lower()}",
        "shadow.enabled=false",
    )
    repeats = cfg.prefill.repeats
    requests = [ids for ids in prompts.values() for _ in range(repeats)]
    run = run_cluster(model_path, words, requests, new_tokens=1)
    row = {
        "configuration": configuration,
        "mini_batch": mini_batch,
        "placement": placement,
        "bit_exact": not per_part,
        "words": words,
    }
    for i, n in enumerate(prompts):
        stats = run.stats[i * repeats : (i + 1) * repeats]
        first_tokens = [ids[0] for ids in run.token_ids[i * repeats : (i + 1) * repeats]]
        mid = sorted(stats, key=lambda s: s["ttft_s"])[repeats // 2]
        row[str(n)] = {
            "ttft_s": mid["ttft_s"],
            "split": {k: v for k, v in mid["prefill"].items() if k != "experts_per_layer"},
            "first_token_is_reference": all(t == reference_tokens[str(n)] for t in first_tokens),
        }
    return row


def prompt_kv_effect(cfg: BenchConfig, model_path: str, tokenizer) -> dict:
    """Recall of the first decode tokens, averaged over prompts, with the shadow's own prompt K/V
    ("False") and with main's ("True")."""
    suite = cfg.prefill
    prompts = [prompt_ids(tokenizer, i, n) for i, n in enumerate(suite.prompt_kv_lengths)]
    recall = {}
    for prefill_kv in (False, True):
        words = cluster_words(
            cfg,
            f"shadow.precision={suite.prompt_kv_precision}",
            "alignment.token_period=1",
            "alignment.kv_period=0",
            f"alignment.prefill_kv={str(prefill_kv).lower()}",
        )
        run = run_cluster(model_path, words, prompts, max(suite.prompt_kv_tokens) + 1)
        per_token = recall_per_token(run.stats)
        recall[str(prefill_kv)] = {str(t): per_token.get(t) for t in suite.prompt_kv_tokens}
    return {
        "precision": suite.prompt_kv_precision,
        "lengths": suite.prompt_kv_lengths,
        "recall_per_token": recall,
    }


def _print_row(row: dict, lengths: list[int]) -> None:
    experts = "|".join(f"{row[str(n)]['split']['experts_per_layer_mean']:.2f}" for n in lengths)
    print(
        f"{row['mini_batch']:>10} {row['placement']:9} {'yes' if row['bit_exact'] else 'no':6}"
        + "".join(f"{row[str(n)]['ttft_s'] * 1e3:9.1f}" for n in lengths)
        + f"{experts:>22}",
        flush=True,
    )


def _print_summary(report: dict) -> None:
    longest = str(max(report["lengths"]))
    best = min(report["rows"], key=lambda r: r[longest]["ttft_s"])
    split = best[longest]["split"]
    print(
        f"\nsplit of the fastest {longest}-token TTFT "
        f"(mini_batch {best['mini_batch']}, {best['placement']}): "
        f"main {split['main_s'] * 1e3:.1f} ms, "
        f"critical load+compute {split['critical_load_compute_s'] * 1e3:.1f} ms"
        f" (load {split['load_s'] * 1e3:.1f}, compute {split['compute_s'] * 1e3:.1f} summed over workers), "
        f"transfer/queueing {split['transfer_s'] * 1e3:.1f} ms"
    )
    differ = [
        r["configuration"]
        for r in report["rows"]
        if r["bit_exact"] and not all(r[str(n)]["first_token_is_reference"] for n in report["lengths"])
    ]
    print(f"bit-exact configurations whose first token is not the single process's: {differ or 'none'}")


def _print_prompt_kv(kv: dict) -> None:
    tokens = list(next(iter(kv["recall_per_token"].values())))
    print(
        f"shadow recall at decode tokens {'/'.join(tokens)} ({kv['precision']} shadow, token alignment only, "
        "no periodic KV):"
    )
    for key, label in (("False", "its own prompt K/V"), ("True", "main's prompt K/V")):
        values = kv["recall_per_token"][key].values()
        print(f"  {label:18}: " + " ".join("-" if r is None else f"{r:.4f}" for r in values))


def _describe(cfg: BenchConfig, out: ResultsDir) -> str:
    c, link = cfg.cluster, cfg.link
    on = f"{link.bandwidth_gbps:g} Gbit/s + {link.latency_ms:g} ms emulated load link"
    return (
        f"{c.workers} workers in groups of {c.group_size}, no shadow, "
        f"{on if out.link_on else 'no emulated link'}, "
        f"TTFT: the median of {cfg.prefill.repeats} request(s) per length; "
        f"one process: {cfg.prefill.threads} torch thread(s)"
    )
