"""Suite `recall` (the paper's Fig. 3): recall vs output-token index for every shadow precision x
alignment, with a next-layer-gate and a frequency predictor on the same tokens.

How: `replay.reference_trajectory` decodes each prompt greedily as main does; each shadow
(precision x alignment) is re-played against it (recall counts every prediction whenever it arrived,
so timing cannot change it). Then, for `recall.cross_check` precisions, a real cluster (main, shadow,
workers as processes) decodes the same prompts with token + KV alignment: its tokens must equal the
replay's and its Eq. 3 recall is reported beside the replay's, with the share that arrived in time.
"""

from __future__ import annotations

import time
from pathlib import Path

from odmoe.main.alignment import AlignmentSchedule
from odmoe.main.recall import RecallCounter
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.shadow.shadow_model import model_bytes
from odmoe_bench import plots
from odmoe_bench.cluster_runs import cluster_words, pooled_recall, run_cluster
from odmoe_bench.config import BenchConfig
from odmoe_bench.replay import (
    Trajectory,
    load_reference,
    load_shadow,
    reference_trajectory,
    replay_shadow,
)
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import PROMPT_TOKENS, Table, fmt, prompts

TABLE = Table("predictor:<28", "recall:8.4f", "first 16:10.4f", "last 16:9.4f", "MiB:8.2f", "s:6.0f")


def score(trajectories, predictions: list[dict]) -> dict:
    counter = RecallCounter()
    for traj, predicted in zip(trajectories, predictions, strict=True):
        for position, activated in sorted(traj.activated.items()):
            counter.add(*position, predicted.get(position), activated)
    return counter.report()


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    suite = cfg.recall
    ckpt = open_checkpoint(model_path)
    tokenizer = load_tokenizer(model_path)
    eos = tokenizer.eos_token_id
    requests = prompts(tokenizer, suite.prompts)
    reference = load_reference(model_path)
    start = time.perf_counter()
    trajs = [
        reference_trajectory(reference, p, suite.new_tokens, ckpt.num_experts, ckpt.top_k, {eos})
        for p in requests
    ]
    decode_tokens = sum(t.iterations for t in trajs)
    print(
        f"reference: {len(trajs)} prompts, {decode_tokens} decode tokens ({time.perf_counter() - start:.0f}s)"
    )
    rows = [
        {"predictor": "next-layer gate", **score(trajs, [t.next_layer_gate for t in trajs])},
        {"predictor": "frequency", **score(trajs, [t.frequency for t in trajs])},
    ]
    TABLE.header()
    for row in rows:
        _print_row(row, None, 0)
    for precision in suite.precisions:
        shadow = load_shadow(model_path, precision)
        mib = model_bytes(shadow) / 2**20
        for name, (token_period, kv_period) in suite.alignments.items():
            start = time.perf_counter()
            schedule = AlignmentSchedule(token_period, kv_period)
            predicted = [replay_shadow(shadow, t, schedule, ckpt.num_experts) for t in trajs]
            row = {
                "predictor": f"shadow {precision}, {name}",
                "precision": precision,
                "alignment": name,
                "token_period": token_period,
                "kv_period": kv_period,
                "shadow_weight_bytes": int(mib * 2**20),
                **score(trajs, predicted),
            }
            rows.append(row)
            _print_row(row, mib, time.perf_counter() - start)
        del shadow
    checks = [_cross_check(cfg, model_path, precision, requests, trajs) for precision in suite.cross_check]
    report = {
        "prompts": suite.prompts,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": suite.new_tokens,
        "decode_tokens": decode_tokens,
        "rows": rows,
        "cluster_cross_check": checks,
    }
    out.write("recall", "recall", report)
    plots.recall_vs_token(
        rows,
        suite.precisions,
        out.path("recall", "png"),
        f"{len(trajs)} prompts x {suite.new_tokens} new tokens, {PROMPT_TOKENS}-token prompts; "
        f"model {Path(model_path).name}",
    )
    return report


def _print_row(row: dict, mib: float | None, seconds: float) -> None:
    per = list(row["per_token"].values())
    first = sum(per[:16]) / len(per[:16]) if per else None
    last = sum(per[-16:]) / len(per[-16:]) if per else None
    TABLE.row(row["predictor"], row["overall"], first, last, mib, seconds)


def _cross_check(cfg: BenchConfig, model_path: str, precision: str, prompts, trajs) -> dict:
    """The same prompts through a real cluster with token + KV alignment every iteration."""
    tokens = min(cfg.recall.cross_check_tokens, cfg.recall.new_tokens)
    words = cluster_words(
        cfg, f"shadow.precision={precision}", "alignment.token_period=1", "alignment.kv_period=1"
    )
    run = run_cluster(model_path, words, prompts, tokens)
    identical = all(ids == t.tokens[:tokens] for ids, t in zip(run.token_ids, trajs, strict=True))
    ckpt = open_checkpoint(model_path)
    shadow = load_shadow(model_path, precision)
    replayed = []
    for traj in trajs:
        cut = _truncate(traj, tokens)
        replayed.append((cut, replay_shadow(shadow, cut, AlignmentSchedule(1, 1), ckpt.num_experts)))
    check = {
        "precision": precision,
        "new_tokens": tokens,
        "tokens_identical_to_reference": identical,
        "cluster_recall": pooled_recall(run.stats),
        "cluster_timely_recall": pooled_recall(run.stats, "timely_recall"),
        "replay_recall": score([c for c, _ in replayed], [p for _, p in replayed])["overall"],
    }
    print(
        f"cross-check {precision}, token+KV, {tokens} tokens: "
        f"cluster recall {fmt(check['cluster_recall'], 0, '.4f')} "
        f"(in time {fmt(check['cluster_timely_recall'], 0, '.4f')}), "
        f"replay {fmt(check['replay_recall'], 0, '.4f')}, "
        f"tokens identical: {identical}",
        flush=True,
    )
    return check


def _truncate(traj: Trajectory, tokens: int) -> Trajectory:
    keep = tokens - 1  # decode iterations 1..tokens-1
    return Trajectory(
        prompt_ids=traj.prompt_ids,
        tokens=traj.tokens[:tokens],
        kv_rows={n: r for n, r in traj.kv_rows.items() if n <= keep},
        activated={p: e for p, e in traj.activated.items() if p[0] <= keep},
    )
