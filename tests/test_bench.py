"""The benchmark suites' pure parts and their config: predictors, recall replay, LRU offloader,
timeline merge, and that every suite composes. (The suites themselves run in CI as
`odmoe-bench suite=quick`.)"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from odmoe.main.alignment import AlignmentSchedule
from odmoe.models.checkpoint import Checkpoint
from odmoe.tools.trace import Tracer, merge
from odmoe.worker.expert_store import Link
from odmoe_bench import plots
from odmoe_bench.baselines import build, timed_generate
from odmoe_bench.config import SUITES, prefill_configuration, suite_summaries
from odmoe_bench.predictors import FrequencyPredictor
from odmoe_bench.replay import load_reference, load_shadow, reference_trajectory, replay_shadow
from odmoe_bench.suites.recall import score
from odmoe_bench.suites.timeline import summarise

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def compose_bench(words):
    from hydra import compose, initialize_config_module

    from odmoe_bench.cli import to_bench_config

    with initialize_config_module("odmoe_bench.conf", version_base="1.3"):
        return to_bench_config(compose("bench", overrides=words))


@pytest.mark.parametrize("suite", SUITES)
def test_every_suite_composes(suite):
    cfg = compose_bench([f"suite={suite}"])
    assert cfg.suite == suite
    # a failure's cost is the protocol's, not the weights': those suites default to the tiny model
    assert cfg.model == (
        "tiny" if suite in ("quick", "faults", "network", "soak", "frontdoor", "security") else "trained"
    )


def test_bad_bench_config_is_refused():
    with pytest.raises(ValueError, match="ablation.cases"):
        compose_bench(["suite=ablation", "ablation.cases=[1,9]"])
    with pytest.raises(ValueError, match="precision"):
        compose_bench(["suite=recall", "recall.precisions=[fp8]"])
    with pytest.raises(ValueError, match="network.cases"):
        compose_bench(["suite=network", "network.cases=[jitter]"])
    with pytest.raises(ValueError, match="loss must lie"):
        compose_bench(["suite=network", "network.loss=1.5"])
    with pytest.raises(ValueError, match="soak.loss must lie below 1"):
        compose_bench(["suite=soak", "soak.network=true", "soak.loss=[0.1,1.0]"])
    with pytest.raises(ValueError, match="soak.hole_s must be"):
        compose_bench(["suite=soak", "soak.hole_s=[10,1]"])
    with pytest.raises(ValueError, match="soak.keep_serving"):
        compose_bench(["suite=soak", "soak.keep_serving=4"])
    compose_bench(["suite=soak", "soak.network=true", "soak.hole_s=[1,3]", "soak.loss=[0.01,0.05]"])
    with pytest.raises(ValueError, match="prefill.configurations"):
        compose_bench(["suite=prefill", "prefill.configurations=['4:striped']"])
    with pytest.raises(ValueError, match="cache.skew"):
        compose_bench(["suite=cache", "cache.skew=1.0"])
    with pytest.raises(ValueError, match="cache.systems"):
        compose_bench(["suite=cache", "cache.systems=[odmoe_random_homes]"])
    compose_bench(["suite=cache", "cache.skew=0.5", "cache.systems=[odmoe,odmoe_even_homes]"])


def test_prefill_configurations_name_mini_batch_placement_and_per_mini_batch():
    assert prefill_configuration("0:modulo") == (0, "modulo", False)
    assert prefill_configuration("16:balanced:per_mini_batch") == (16, "balanced", True)
    for bad in ("modulo", "-4:modulo", "4:modulo:exact", "4:balanced:per_mini_batch:x"):
        with pytest.raises(ValueError, match="MINI_BATCH"):
            prefill_configuration(bad)


def test_frequency_predictor_picks_most_frequent_then_lowest_id():
    f = FrequencyPredictor(top_k=2)
    assert f.predict(0) == []
    for experts in ([1, 4], [4, 6], [6, 2], [4, 1]):
        f.observe(0, experts)
    assert f.predict(0) == [1, 4]  # 4 three times, then 1/6 tie twice: lower id wins


@pytest.fixture(scope="module")
def trajectory(model_dirs):
    path = model_dirs["mixtral"]
    ckpt = Checkpoint(path)
    ids = AutoTokenizer.from_pretrained(path)("def f(x):\n    return")["input_ids"]
    traj = reference_trajectory(load_reference(path), ids, 10, ckpt.num_experts, ckpt.top_k, set())
    return path, ckpt, ids, traj


def test_reference_trajectory_is_greedy_generate(trajectory):
    path, _, ids, traj = trajectory
    x = torch.tensor([ids])
    ref = AutoModelForCausalLM.from_pretrained(path).generate(
        x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=10
    )
    assert traj.tokens == ref[0, len(ids) :].tolist()
    assert len(traj.activated) == traj.iterations * len(ckpt_layers(trajectory))
    assert all(len(e) == 2 for e in traj.activated.values())


def ckpt_layers(trajectory):
    return trajectory[1].moe_layers


def test_exact_shadow_replayed_has_recall_one_and_quantized_less(trajectory):
    path, ckpt, _, traj = trajectory
    exact = replay_shadow(load_shadow(path, "fp32"), traj, AlignmentSchedule(0, 0), ckpt.num_experts)
    assert score([traj], [exact])["overall"] == 1.0
    nf4 = replay_shadow(load_shadow(path, "nf4"), traj, AlignmentSchedule(0, 0), ckpt.num_experts)
    assert score([traj], [nf4])["overall"] < 1.0
    # the baselines predict from what main computed: better than chance (2 of 8), not perfect here
    gate = score([traj], [traj.next_layer_gate])["overall"]
    assert 0.25 < gate <= 1.0


def test_lru_offloader_is_lossless_and_counts_hits(model_dirs):
    path = model_dirs["qwen2_moe"]  # shared experts on main, routed ones through the LRU cache
    ids = [5, 17, 42, 99, 7]
    ref = timed_generate(AutoModelForCausalLM.from_pretrained(path).eval(), ids, 8)
    model, device_bytes, lru = build("lru_offloader", path, lru_experts=4, link=Link())
    out = timed_generate(model, ids, 8)
    assert out["token_ids"] == ref["token_ids"]
    assert lru.misses > 0 and lru.slots.busy <= 4 and device_bytes > 0


def test_timeline_merge_names_nodes_and_lanes(tmp_path):
    main, worker = Tracer("main", str(tmp_path)), Tracer("worker0", str(tmp_path))
    main.span("main", "L0", 0, 100, iteration=1)
    main.flow("main", "compute/r/1/0/3", True, 100)
    worker.flow("compute", "compute/r/1/0/3", False, 150)
    worker.span("load", "load L0 e3", 50, 250, iteration=1, used=False)
    worker.span("compute", "compute L0 e3", 250, 300, iteration=1)
    main.flush(), worker.flush()
    trace = merge(tmp_path)
    json.dumps(trace)  # a valid Chrome trace is plain JSON
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"main", "worker0", "load", "compute"} <= names
    flows = [e for e in trace["traceEvents"] if e["ph"] in "sf"]
    assert len({e["id"] for e in flows}) == 1 and len(flows) == 2
    from odmoe_bench.suites.timeline import _named_lanes

    rows = summarise(_named_lanes(trace["traceEvents"]))
    assert rows[1]["loads"] == 1 and rows[1]["unused_loads"] == 1 and rows[1]["main_ms"] == 0.1


def test_tracer_off_records_nothing(tmp_path):
    t = Tracer("main", None)
    t.span("main", "L0", 0, 1)
    t.flush()
    assert not t.events and not list(tmp_path.iterdir())


@pytest.mark.integration
@pytest.mark.extended  # ~65 s: CI runs it
def test_bench_sweep_runs_a_cluster_per_job(model_dirs, tmp_path, reap_children):
    """`odmoe-bench -m`: each job starts local clusters from inside the running Hydra app (whose
    config root is not odmoe-launch's) and writes its own results."""
    import subprocess
    import sys

    out = tmp_path / "results"
    subprocess.run(
        [
            sys.executable, "-m", "odmoe_bench.cli", "-m", "suite=timeline",
            f"model={model_dirs['mixtral']}", "link.bandwidth_gbps=1,8", f"results_dir={out}",
            "timeline.new_tokens=3", "timeline.iterations=[1]", f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        check=True,
        timeout=300,
    )  # fmt: skip
    written = sorted(p.name for p in out.glob("timeline-link*.json"))
    assert len(written) == 2 and "bandwidth_gbps_1" in written[0] and "bandwidth_gbps_8" in written[1]


def test_compression_suite_bound_and_ratios():
    import numpy as np

    from odmoe_bench.suites.compression import exponent_counts, ratios, shannon_bound

    # two exponent values, equally often: H = 1 bit, so bf16's bound is (1 + 8) / 16
    t = torch.tensor([1.0, 2.0] * 500, dtype=torch.bfloat16)
    counts = exponent_counts(t)
    assert counts[127] == counts[128] == 500 and counts.sum() == 1000
    bound, entropy = shannon_bound(counts, torch.bfloat16)
    assert entropy == pytest.approx(1.0) and bound == pytest.approx(9 / 16)
    assert shannon_bound(np.eye(1, 256, 127, dtype=np.int64)[0] * 7, torch.float32)[1] == 0.0
    g = torch.Generator().manual_seed(0)
    experts = [(kind, torch.randn(96, 80, generator=g) * 0.02) for kind in ("gate_up", "down") * 3]
    rows = ratios(experts, torch.bfloat16)
    assert rows["all"]["raw_bytes"] == 6 * 96 * 80 * 2
    assert rows["all"]["bound"] <= rows["all"]["odmoe"] < rows["all"]["zstd"] < 1.0


@pytest.mark.parametrize(
    "suite,draw",
    [
        ("compression", lambda d, out: plots.compression(d, out, "redrawn")),
        ("faults", lambda d, out: plots.faults(d["rows"], out, "redrawn")),
        ("network", lambda d, out: plots.network(d["rows"], out, "redrawn")),
        ("ablation", lambda d, out: plots.ablation(d["rows"], out, "redrawn")),
        ("soak", lambda d, out: plots.soak(d["samples"], d["events"], out, "redrawn")),
        ("lookahead", lambda d, out: plots.lookahead(d, out, "redrawn")),
        ("lookahead-hedging", lambda d, out: plots.lookahead(d, out, "redrawn")),  # part 2 alone
    ],
)
def test_a_figure_is_redrawn_from_its_committed_results_file(suite, draw, tmp_path):
    """Regression: the compression figure was built but never saved, so CI found no compression.png."""
    data = json.loads((RESULTS / f"{suite}.json").read_text())
    out = tmp_path / f"{suite}.png"
    draw(data, out)
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize("prompt_kv", [False, True])
def test_prefill_figure_is_redrawn_from_the_earlier_scripts_results(prompt_kv, tmp_path):
    """The suite writes its rows as the earlier benchmarks/prefill.py script did (the committed
    prefill.json and prefill-prompt-kv.json), so its figure draws from them: the TTFT bars, and the
    recall panel where there is one."""
    data = json.loads((RESULTS / "prefill.json").read_text())
    if prompt_kv:
        kv = json.loads((RESULTS / "prefill-prompt-kv.json").read_text())["recall_per_token"]
        data["prompt_kv"] = {"precision": "int8_dynamic", "lengths": [16, 64, 128], "recall_per_token": kv}
    out = tmp_path / "prefill.png"
    plots.prefill(data, out, "redrawn")
    assert out.stat().st_size > 10_000


def test_wilson_lower_bound_of_a_recall():
    """The hedging goal is judged on this bound: a handful of misses in a small sample must not pass
    it, dozens in a large one may."""
    from odmoe_bench.suites.lookahead import wilson_low

    assert wilson_low(0, 0) == 0.0
    assert wilson_low(4063, 4064) < 0.999 < 4063 / 4064  # the old 4 x 128 sample: even 1 miss decides nothing
    assert 0.999 < wilson_low(65280 - 46, 65280) < (65280 - 46) / 65280  # 32 x 256: 46 misses
    assert wilson_low(100, 100) == pytest.approx(0.963, abs=1e-3)  # the textbook all-successes case


def test_cpu_per_token_pools_requests_and_sums_the_workers(monkeypatch):
    from odmoe_bench.cluster_runs import ClusterRun, cpu_per_token

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    run = ClusterRun(words=[], token_ids=[[1] * 10, [2] * 30])
    run.cpu_s = [
        {"main": 0.04, "worker0": 0.01, "worker1": 0.02, "client": 0.01},
        {"main": 0.12, "worker0": 0.03, "worker1": 0.05, "client": 0.02},
    ]
    run.wall_s = [0.05, 0.15]
    cpu = cpu_per_token(run)
    assert cpu["ms_per_token"] == pytest.approx({"client": 0.75, "main": 4.0, "workers": 2.75})
    assert cpu["total_ms_per_token"] == pytest.approx(7.5)
    assert cpu["cores_busy"] == pytest.approx(0.3 / 0.2)
    assert cpu["bound_tokens_per_s"] == pytest.approx(2 * 40 / 0.3)  # 2 cores / 7.5 ms
    assert cpu["tokens_per_s"] == pytest.approx(200.0)
    assert cpu_per_token(ClusterRun(words=[])) is None


def test_the_busiest_links_load_time_per_token():
    from odmoe_bench.suites.lookahead import _busiest_link

    stats = [
        {"new_tokens": 10, "per_worker": {"worker0": {"load_s": 0.02}, "worker1": {"load_s": 0.05}}},
        {"new_tokens": 30, "per_worker": {"worker0": {"load_s": 0.10}, "worker1": {"load_s": 0.03}}},
    ]
    assert _busiest_link(stats) == pytest.approx(0.12 / 40 * 1e3)  # worker0: 3 ms per token
    assert _busiest_link([{"new_tokens": 5, "per_worker": {"worker0": {"load_s": 0.0}}}]) is None  # resident


def test_clusters_are_compared_with_the_lru_offloader_prompt_by_prompt(capsys):
    from odmoe_bench.suites.lookahead import _print_vs_lru, _ratios

    def row(system, precision, per_request):
        return {
            "system": system,
            "precision": precision,
            "decode_per_request": per_request,
            "decode_tokens_per_s": sum(per_request) / len(per_request),
        }

    rows = [
        row("speculative", "fp32", [120.0, 100.0, 90.0]),
        row("lru_offloader", "-", [100.0, 125.0, 60.0]),
        row("resident_workers", "-", [200.0]),  # not comparable prompt by prompt
    ]
    _ratios(rows)
    _print_vs_lru(rows)
    assert rows[0]["vs_lru_per_prompt"] == pytest.approx([1.2, 0.8, 1.5])
    assert "faster on 2 of 3 prompts" in capsys.readouterr().out
    assert "vs_lru_per_prompt" not in rows[2]


def test_every_suite_has_its_config_its_module_and_a_line_in_each_help_text():
    """The suites are listed in one place (SUITES, each benchmarks/conf/suite/<name>.yaml's opening
    comment); a suite added without its config, module or help line fails here."""
    repo = Path(__file__).resolve().parents[1]
    configs = {p.stem for p in (repo / "benchmarks/conf/suite").glob("*.yaml")}
    assert configs == set(SUITES)
    summaries = suite_summaries()
    assert all(len(summaries[name]) > 20 for name in SUITES), summaries
    modules = {p.stem for p in (repo / "benchmarks/suites").glob("*.py")} - {"__init__"}
    assert modules | {"quick"} == (set(SUITES) - {"eval"}) | {"eval_harness"}
    bench_help = (repo / "benchmarks/cli.py").read_text()
    assert [n for n in SUITES if f"suite={n} " not in bench_help] == []


def test_the_suites_reference_decode_is_transformers_greedy_and_seeded(model_dirs):
    """benchmarks/workload.reference_tokens: the one reference decode every suite compares with."""
    import torch
    from transformers import AutoModelForCausalLM

    from odmoe_bench.workload import reference_tokens

    path, ids = model_dirs["mixtral"], [5, 9, 200, 31]
    model = AutoModelForCausalLM.from_pretrained(path)
    x = torch.tensor([ids])
    greedy = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=6)
    assert reference_tokens(path, ids, 6) == greedy[0, 4:].tolist()
    torch.manual_seed(11)
    sampled = model.generate(
        x, attention_mask=torch.ones_like(x), do_sample=True, temperature=0.8, max_new_tokens=6
    )
    seeded = reference_tokens(path, ids, 6, {"do_sample": True, "temperature": 0.8, "seed": 11})
    assert seeded == sampled[0, 4:].tolist()
