"""Suite `ablation` (the paper's Fig. 8): decode tokens/s of cases 1-6, spread over repeated requests.

1 shadow + token + KV alignment, 2 token only, 3 KV only, 4 no alignment, 5 no shadow model: random
prefetch, 6 no shadow: load after routing. Each case is its own local cluster with the suite's link;
`ablation.repeats` requests (different prompts) after a warm-up give the spread.
"""

from __future__ import annotations

from odmoe.benchmarks import plots
from odmoe.benchmarks.cluster_runs import cluster_words, run_cluster, summarise
from odmoe.benchmarks.config import BenchConfig
from odmoe.benchmarks.results import ResultsDir, fmt
from odmoe.benchmarks.workload import prompt_ids
from odmoe.models.open_model import load_tokenizer

CASES = {
    1: "token + KV alignment",
    2: "token alignment",
    3: "KV alignment",
    4: "no alignment",
    5: "random prefetch",
    6: "load after routing",
}
PROMPT_TOKENS = 32


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.ablation
    tokenizer = load_tokenizer(model_path)
    prompts = [prompt_ids(tokenizer, i, PROMPT_TOKENS) for i in range(suite.repeats)]
    print(
        f"{'case':<26}{'decode tok/s':>13}{'± stdev':>9}{'recall':>8}{'in time':>8}"
        f"{'stall ms/tok':>13}{'reloads/tok':>12}",
        flush=True,
    )
    rows = []
    for case in suite.cases:
        row = summarise(
            run_cluster(model_path, cluster_words(cfg, f"ablation=case{case}"), prompts, suite.new_tokens)
        )
        row.update(case=case, label=CASES[case])
        rows.append(row)
        d = row["decode_tokens_per_s"]
        print(
            f"{case} {CASES[case]:<24}{d['mean']:13.1f}{d['stdev']:9.1f}{fmt(row['recall'])}"
            f"{fmt(row['timely_recall'])}{row['stall_ms_per_token']:13.2f}{row['reloads_per_token']:12.2f}",
            flush=True,
        )
    report = {"new_tokens": suite.new_tokens, "prompt_tokens": PROMPT_TOKENS, "rows": rows}
    out.write("ablation", "ablation", report)
    plots.ablation(rows, out.path("ablation", "png"), out.describe(suite.new_tokens))
    return report
