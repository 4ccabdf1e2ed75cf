"""Suite `ablation` (the paper's Fig. 8): decode tokens/s of cases 1-6, spread over repeated requests.

1 shadow + token + KV alignment, 2 token only, 3 KV only, 4 no alignment, 5 no shadow model: random
prefetch, 6 no shadow: load after routing. Each case is its own local cluster with the suite's link;
`ablation.repeats` requests (different prompts) after a warm-up give the spread.
"""

from __future__ import annotations

from odmoe.models.open_model import load_tokenizer
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words, run_cluster, summarise
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import PROMPT_TOKENS, Table, prompts

CASES = {
    1: "token + KV alignment",
    2: "token alignment",
    3: "KV alignment",
    4: "no alignment",
    5: "random prefetch",
    6: "load after routing",
}
TABLE = Table(
    "case:<26:case",
    "decode tok/s:13.1f:decode_tokens_per_s.mean",
    "± stdev:9.1f:decode_tokens_per_s.stdev",
    "recall:8.3f:recall",
    "in time:8.3f:timely_recall",
    "stall ms/tok:13.2f:stall_ms_per_token",
    "reloads/tok:12.2f:reloads_per_token",
)


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.ablation
    tokenizer = load_tokenizer(model_path)
    requests = prompts(tokenizer, suite.repeats)
    TABLE.header()
    rows = []
    for case in suite.cases:
        row = summarise(
            run_cluster(model_path, cluster_words(cfg, f"ablation=case{case}"), requests, suite.new_tokens)
        )
        row.update(case=case, label=CASES[case])
        rows.append(row)
        TABLE.record(row, case=f"{case} {CASES[case]}")
    report = {"new_tokens": suite.new_tokens, "prompt_tokens": PROMPT_TOKENS, "rows": rows}
    out.write("ablation", "ablation", report)
    plots.ablation(rows, out.path("ablation", "png"), out.describe(suite.new_tokens))
    return report
