"""Suite `alignment` (the paper's Fig. 9): decode tokens/s over token_period x kv_period.

Each cell is its own local cluster (the suite's shadow precision and link), `alignment.repeats`
requests after a warm-up; the heatmaps show mean decode tokens/s, recall (Eq. 3) and the shadow's
mean late departure. Alignment trades the shadow's late start against its drift: which side wins
depends on the hardware, so this is a sweep, not a constant.
"""

from __future__ import annotations

from odmoe.models.open_model import load_tokenizer
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words, run_cluster, summarise
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import Table, prompts

TABLE = Table(
    "token:>6:token_period",
    "kv:>4:kv_period",
    "decode tok/s:14.1f:decode_tokens_per_s.mean",
    "± stdev:9.1f:decode_tokens_per_s.stdev",
    "recall:8.3f:recall",
    "in time:8.3f:timely_recall",
    "late ms:9.2f:late_departure_ms_mean",
)
PANELS = [
    ("decode_tokens_per_s", "decode tokens/s (mean)", "{:.1f}"),
    ("recall", "recall (Eq. 3)", "{:.3f}"),
    ("late_departure_ms_mean", "late departure ms (mean)", "{:.2f}"),
]


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.alignment
    tokenizer = load_tokenizer(model_path)
    requests = prompts(tokenizer, suite.repeats)
    TABLE.header()
    rows = []
    for token_period in suite.token_periods:
        for kv_period in suite.kv_periods:
            words = cluster_words(
                cfg, f"alignment.token_period={token_period}", f"alignment.kv_period={kv_period}"
            )
            row = summarise(run_cluster(model_path, words, requests, suite.new_tokens))
            row.update(token_period=token_period, kv_period=kv_period)
            row["decode_tokens_per_s_mean"] = row["decode_tokens_per_s"]["mean"]
            rows.append(row)
            TABLE.record(row)
    report = {"new_tokens": suite.new_tokens, "repeats": suite.repeats, "rows": rows}
    out.write("alignment", "alignment", report)
    panels = [("decode_tokens_per_s_mean", *PANELS[0][1:]), *PANELS[1:]]
    plots.heatmaps(
        rows,
        panels,
        out.path("alignment", "png"),
        f"alignment periods (paper Fig. 9)\n{out.describe(suite.new_tokens)}, "
        f"{suite.repeats} requests per cell",
    )
    return report
