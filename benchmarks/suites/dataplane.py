"""Suite `dataplane`: what a remote decode layer costs against the wire it travels on (issue 13).

Measured in one run, on one machine, so the figures can be set against each other:

1. wire: round trips of a message shaped like one decode layer's expert call (a ComputeExperts
   header and one hidden row in, an ExpertsResult header and one row out) between this process's
   DEALER and a ROUTER in a process of its own (benchmarks/wire_echo.py): `raw` (the frames echoed,
   nothing decoded: ZeroMQ's own cost) and `codec` (both ends encode and decode with odmoe's codec,
   as main and a worker do), each plain and with CURVE. Variants are interleaved round by round so
   load on the machine hits all of them alike; medians count.
2. codec: encoding and decoding each message in-process, microseconds.
3. layers: a resident-experts local cluster (`emulation.resident=true`, no shadow: nothing is loaded,
   so what remains is the data plane), security on and off, against the same model in this process
   through transformers' `generate()` (one torch thread, as every cluster node has). Per decode
   layer: (cluster's decode seconds per token - the reference's) / MoE layers. Requests are
   interleaved over the three; tokens must be identical.
4. stages: where a cluster's decode layer goes, from main's stats (µs per layer, medians over
   requests): `prepare` (split, place, encode every call), `round_trip` (from the first send to the
   last answer's frames in hand), of it `worker` (that worker's own time: decode, compute; not its
   encoding and sending, which stay in the round trip with the wire and the wake-ups), `take` (main
   decoding and checking the answers), `combine`; beside them the reference's own experts call per
   decode layer (timed by forward hooks), which a remote layer replaces.
5. floors: the same exchange with none of odmoe's code on it. Main (this process) fans raw frames
   out to `cluster.group_size` echo processes, `top_k` calls a round, and the round is set against
   the one-process experts call. In the first, each echo spins the workers' measured compute time
   and this process spins between rounds. In the second (`floor_with_experts`), each echo computes
   the model's experts with the workers' own `expert_forward`, and this process applies main's own
   weights between rounds (MainWork): the caches see real work on both sides, as in the cluster.
   The distance from the second floor to the cluster's experts call is odmoe's own per-layer code.

The issue's goal: a remote decode layer costs at most ~2x the raw round trip (the layer overhead
with security on against raw CURVE, off against raw plain). Beside it, the raw round trip of
processes that idled `spaced_gap_ms` before each (as a cluster's do between decode layers: a
process that slept wakes slower, with cold caches), printed as a second ratio; the goal stays the
back-to-back one.

`dataplane.pin=true` gives each end a core: this process (the reference, the echo's client) and
main on CPU 0, the echo and every worker on CPU 1, so the figures show the data plane without the
wake-ups queueing for a shared core (with `cluster.workers=1`: one process per core, as two boxes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import zmq
from transformers import AutoModelForCausalLM

import odmoe
from odmoe.launch.local_cluster import NodePlacement
from odmoe.models.checkpoint import Checkpoint
from odmoe.models.main_model import resolve_dtype
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.transport.messages import ComputeExperts, ExpertsResult, Step, from_frames, to_frames
from odmoe_bench import plots
from odmoe_bench.baselines import timed_generate
from odmoe_bench.cluster_runs import cluster_words
from odmoe_bench.config import BenchConfig, DataplaneSuite
from odmoe_bench.results import ResultsDir
from odmoe_bench.suite_kit import median, prompts
from odmoe_bench.wire_echo import busy


@dataclasses.dataclass(frozen=True)
class EchoExperts:
    """What the real-compute floor's echoes compute: `layer`'s experts of `model`, with `kernel`."""

    model: str
    layer: int
    kernel: str


class MainWork:
    """Main's own layer work for the real-compute floor: a row through each of the checkpoint's
    non-expert matrices (attention projections, routers, lm_head) in turn, carrying on where the
    last call stopped, so over a token's layers the cache sees what main's work makes it see."""

    def __init__(self, ckpt: Checkpoint):
        # the embedding is a lookup of one row, not a matmul: left out
        weights = sorted(ckpt.non_expert_state_dict().items())
        matrices = [w for k, w in weights if w.dim() == 2 and "embed" not in k]
        self.work = [(w, torch.ones(1, w.shape[1], dtype=w.dtype)) for w in matrices]
        self.next = 0

    def __call__(self, seconds: float) -> None:
        start = time.perf_counter()
        with torch.inference_mode():
            while time.perf_counter() - start < seconds:
                w, x = self.work[self.next % len(self.work)]
                torch.nn.functional.linear(x, w)
                self.next += 1


WIRE = (("raw", "plain"), ("raw", "curve"), ("codec", "plain"), ("codec", "curve"))
SYSTEMS = ("reference", "security_on", "security_off")
STAGES = ("prepare", "round_trip", "worker", "take", "combine")
RAW_OF = {"security_on": "raw_curve", "security_off": "raw_plain"}  # the wire each cluster is set against


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    with _pinned(cfg.dataplane.pin) as pinning:
        return _run(cfg, model_path, out, pinning)


@contextlib.contextmanager
def _pinned(pin: bool):
    """With `pin`, this process on CPU 0 for the run (its children choose their own with taskset)."""
    if not pin:
        yield None
        return
    if shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2:
        raise RuntimeError("dataplane.pin=true needs taskset and at least two CPUs")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        yield "this process and main on CPU 0; the echo and every worker on CPU 1"
    finally:
        os.sched_setaffinity(0, before)


def _taskset(pinning: str | None, cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if pinning else []


def _run(cfg: BenchConfig, model_path: str, out: ResultsDir, pinning: str | None) -> dict:
    suite = cfg.dataplane
    ckpt = open_checkpoint(model_path)
    row = torch.randn(1, ckpt.config.hidden_size).to(resolve_dtype("auto", ckpt))
    print(f"-- wire: one decode layer's message, {row.numel() * row.element_size()} B row", flush=True)
    wire = measure_wire(suite, row, pinning)
    codec = measure_codec(suite, row)
    print("-- layers: resident-experts cluster (security on, off) vs one process", flush=True)
    layers = measure_layers(cfg, model_path, len(ckpt.moe_layers), pinning)
    spin_us = layers["worker_compute_us_per_expert"]["security_off"]
    top_k = int(getattr(ckpt.config, "num_experts_per_tok", 2))
    fanout = None
    if suite.fanout_rounds > 0:
        print(
            f"-- floor: {top_k} calls fanned out to {cfg.cluster.group_size} echoes, "
            f"each busy {spin_us:.0f} µs per call"
        )
        fanout = measure_fanout(suite, row, cfg.cluster.group_size, top_k, spin_us, pinning)
        fanout["floor_us_per_layer"] = fanout["median"] - layers["reference_experts_us_per_layer"]
    computing = None
    if suite.fanout_rounds > 0 and suite.floor_with_experts:
        experts = EchoExperts(model_path, ckpt.moe_layers[0], layers["kernel"])
        print(
            f"-- floor with real compute: echoes compute layer {experts.layer}'s experts, {experts.kernel}",
            flush=True,
        )
        computing = measure_fanout(
            suite, row, cfg.cluster.group_size, top_k, 0.0, pinning, expert=experts, main_work=MainWork(ckpt)
        )
        computing["floor_us_per_layer"] = computing["median"] - layers["reference_experts_us_per_layer"]
    report = {
        "pinned": pinning,
        "spread": suite.spread,
        "spaced_gap_ms": suite.spaced_gap_ms,
        "hidden_size": ckpt.config.hidden_size,
        "row_bytes": row.numel() * row.element_size(),
        "moe_layers": len(ckpt.moe_layers),
        "wire_us": wire,
        "codec_us": codec,
        "layers": layers,
        "fanout_us": fanout,
        "fanout_computing_us": computing,
    }
    report["goal"] = goal(report)
    print_report(report)
    out.write("dataplane", "dataplane", report)
    plots.dataplane(report, out.path("dataplane", "png"), f"{model_path.rstrip('/').split('/')[-1]}")
    return report


# -- 1. wire ---------------------------------------------------------------------------------------
def _message(row: torch.Tensor) -> tuple[ComputeExperts, list]:
    step = Step("dataplane-0123456789abcdef", 17, 3)  # a request id as long as main's (uuid hex)
    return ComputeExperts.single(step, 5, "eager", row.shape[0]), [row]


def _echo(
    mode: str,
    security: str,
    pinning: str | None,
    spin_us: float = 0.0,
    expert: EchoExperts | None = None,
    cpu: int | None = None,
) -> tuple[subprocess.Popen, zmq.Socket]:
    """One echo process (raw: busy `spin_us`, or computing `expert`, before each answer) and this
    process's DEALER to it; on `cpu` when given (as a spread worker), else as `pinning` says."""
    where = ["taskset", "-c", str(cpu)] if cpu is not None else _taskset(pinning, 1)
    cmd = [*where, sys.executable, "-m", "odmoe_bench.wire_echo", "--mode", mode]
    if spin_us:
        cmd += ["--spin-us", str(spin_us)]
    if expert is not None:
        cmd += ["--model", expert.model, "--layer", str(expert.layer), "--kernel", expert.kernel]
    public = secret = b""
    if security == "curve":
        public, secret = zmq.curve_keypair()
        cmd.append("--curve")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if secret:
        proc.stdin.write(secret.decode() + "\n")
        proc.stdin.flush()
    port = int(proc.stdout.readline())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if public:
        sock.curve_serverkey = public
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(f"tcp://127.0.0.1:{port}")
    return proc, sock


def _round_trips(
    sock: zmq.Socket, mode: str, row: torch.Tensor, rounds: int, gap_s: float = 0.0
) -> list[float]:
    """Each round trip's seconds: raw sends fixed frames and touches nothing that comes back;
    codec encodes the call and decodes the answer, as main's _send/_take do. With `gap_s`, both
    ends idle that long before each round trip (not timed), as between a cluster's decode layers."""
    message, tensors = _message(row)
    fixed = [bytes(f) for f in to_frames(message, tensors)]
    times = []
    for _ in range(rounds):
        if gap_s:
            time.sleep(gap_s)
        start = time.perf_counter()
        if mode == "raw":
            sock.send_multipart(fixed, copy=False)
            sock.recv_multipart(copy=False)
        else:
            sock.send_multipart(to_frames(message, tensors), copy=False)
            result, rows = from_frames(sock.recv_multipart(copy=False))
            assert isinstance(result, ExpertsResult) and rows[0].shape == row.shape
        times.append(time.perf_counter() - start)
    return times


def measure_wire(suite: DataplaneSuite, row: torch.Tensor, pinning: str | None = None) -> dict:
    """Median round trip in µs per variant (and each repeat's median, to show the spread)."""
    ends = {v: _echo(*v, pinning) for v in WIRE}
    try:
        per_repeat: dict[str, list[float]] = {f"{m}_{s}": [] for m, s in WIRE}
        for (mode, _), (_, sock) in ends.items():
            _round_trips(sock, mode, row, suite.warmup_rounds)  # connect, handshake, first allocations
        for _ in range(suite.repeats):
            for (mode, security), (_, sock) in ends.items():
                times = _round_trips(sock, mode, row, suite.rounds)
                per_repeat[f"{mode}_{security}"].append(statistics.median(times) * 1e6)
        if suite.spaced_gap_ms > 0:  # the same wire for processes that slept between round trips
            for (mode, security), (_, sock) in ends.items():
                if mode == "raw":
                    times = _round_trips(sock, mode, row, suite.spaced_rounds, suite.spaced_gap_ms / 1e3)
                    per_repeat[f"raw_{security}_spaced"] = [statistics.median(times) * 1e6]
    finally:
        _stop(ends.values())
    return {k: {"median": statistics.median(v), "repeats": v} for k, v in per_repeat.items()}


def _stop(ends) -> list[str]:
    """Close each DEALER and let its echo go (it leaves when its stdin closes); what each printed last."""
    last = []
    for proc, sock in ends:
        sock.close(0)
        proc.stdin.close()
        last.append(proc.stdout.read().strip())
        proc.wait(timeout=10)
    return last


def measure_fanout(
    suite: DataplaneSuite,
    row: torch.Tensor,
    echoes: int,
    calls: int,
    spin_us: float,
    pinning: str | None,
    expert: EchoExperts | None = None,
    main_work=busy,
) -> dict:
    """µs from the first send to the last answer of `calls` raw messages dealt round-robin over
    `echoes` echo processes that each stay busy `spin_us` per message (or, with `expert` and
    `spin_us` 0, compute one of those experts on the row); this process busy `fanout_gap_us`
    before each round (`main_work(seconds)`: a spin, or MainWork), as main is with its own layer
    work (median of the rounds)."""
    ends = []
    # with the workers spread (worker i on CPU i, as LocalCluster places them), echo i sits there too
    cpus = sorted(os.sched_getaffinity(0)) if suite.spread and not pinning else []
    try:
        for i in range(echoes):
            ends.append(
                _echo("raw", "plain", pinning, spin_us, expert, cpus[i % len(cpus)] if cpus else None)
            )
        message, tensors = _message(row)
        fixed = [bytes(f) for f in to_frames(message, tensors)]
        poller = zmq.Poller()
        for _, sock in ends:
            poller.register(sock, zmq.POLLIN)
        times = []
        for r in range(suite.warmup_rounds + suite.fanout_rounds):
            main_work(suite.fanout_gap_us / 1e6)
            start = time.perf_counter()
            for c in range(calls):
                ends[c % echoes][1].send_multipart(fixed, copy=False)
            owed = calls
            while owed:
                for sock, _ in poller.poll():
                    sock.recv_multipart(copy=False)
                    owed -= 1
            if r >= suite.warmup_rounds:
                times.append(time.perf_counter() - start)
    finally:
        computed = [float(line) for line in _stop(ends) if line]
    out = {
        "median": statistics.median(times) * 1e6,
        "echoes": echoes,
        "calls": calls,
        "spin_us": spin_us,
        "gap_us": suite.fanout_gap_us,
    }
    if expert is not None:  # what a call's compute took in the echoes (their medians' median)
        out.update(expert=dataclasses.asdict(expert), compute_us=statistics.median(computed))
    return out


# -- 2. codec --------------------------------------------------------------------------------------
def measure_codec(suite: DataplaneSuite, row: torch.Tensor) -> dict:
    """µs to encode / decode each message of a decode layer's exchange, in this process."""
    message, tensors = _message(row)
    result = ExpertsResult(message.step, 0, [5], [1e-4], [2e-4], [0], [False], [0.0], 123_456_789)
    frames = {
        "compute": [zmq.Frame(bytes(f)) for f in to_frames(message, tensors)],
        "result": [zmq.Frame(bytes(f)) for f in to_frames(result, tensors)],
    }
    work = {
        "encode_compute": lambda: to_frames(message, tensors),
        "decode_compute": lambda: from_frames(frames["compute"]),
        "encode_result": lambda: to_frames(result, tensors),
        "decode_result": lambda: from_frames(frames["result"]),
    }
    samples: dict[str, list[float]] = {k: [] for k in work}
    for _ in range(suite.repeats):
        for name, fn in work.items():
            for _ in range(50):
                fn()
            start = time.perf_counter()
            for _ in range(suite.rounds):
                fn()
            samples[name].append((time.perf_counter() - start) / suite.rounds * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


# -- 3. layers -------------------------------------------------------------------------------------
def measure_layers(cfg: BenchConfig, model_path: str, moe_layers: int, pinning: str | None = None) -> dict:
    suite = cfg.dataplane
    tok = load_tokenizer(model_path)
    requests = prompts(tok, suite.prompts, suite.prompt_tokens, first=200)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every node of a local cluster (cluster.torch_threads=1)
    reference = AutoModelForCausalLM.from_pretrained(model_path).eval()
    experts_s = _time_decode_experts(reference)
    clusters = {}
    rows: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    differ = 0
    try:
        for system in SYSTEMS[1:]:
            on = "true" if system == "security_on" else "false"
            words = cluster_words(
                cfg,
                "emulation.resident=true",
                "shadow.enabled=false",
                f"security.enabled={on}",
                *(["cluster.spread_workers=true"] if suite.spread else []),
            )
            place = None
            if pinning:
                place = lambda name: NodePlacement(prefix=_taskset(pinning, 0 if name == "main" else 1))  # noqa: E731
            clusters[system] = odmoe.LocalCluster(model_path, overrides=words, place=place).start()
        for system in SYSTEMS:  # warm-up: first-request costs are not the data plane's
            _generate(system, reference, clusters, requests[0], 4)
        for r in range(suite.layer_repeats):
            for i, ids in enumerate(requests):
                order = SYSTEMS[(r + i) % 3 :] + SYSTEMS[: (r + i) % 3]
                tokens = {}
                for system in order:
                    experts_s.clear()
                    row = _generate(system, reference, clusters, ids, suite.new_tokens)
                    if system == "reference":
                        row["experts_us_per_layer"] = statistics.mean(experts_s) * 1e6
                    tokens[system] = row.pop("token_ids")
                    rows[system].append(row)
                differ += any(t != tokens["reference"] for t in tokens.values())
    finally:
        torch.set_num_threads(threads)
        for cluster in clusters.values():
            cluster.stop()
    per_token = {s: median(r["decode_s_per_token"] for r in rows[s]) for s in SYSTEMS}
    summary = {
        "prompts": suite.prompts,
        "repeats": suite.layer_repeats,
        "new_tokens": suite.new_tokens,
        "token_sequences_differing": differ,
        "kernel": reference.config._experts_implementation,  # the experts kernel every node runs
        "decode_ms_per_token": {s: v * 1e3 for s, v in per_token.items()},
        # per decode layer, above the same layer in one process
        "overhead_us_per_layer": {
            s: (per_token[s] - per_token["reference"]) / moe_layers * 1e6 for s in SYSTEMS[1:]
        },
        # main blocked on workers per decode layer, and one expert's compute on a worker
        "wait_us_per_layer": {s: median(r["wait_us_per_layer"] for r in rows[s]) for s in SYSTEMS[1:]},
        "worker_compute_us_per_expert": {
            s: median(r["compute_us_per_expert"] for r in rows[s]) for s in SYSTEMS[1:]
        },
        # where a cluster's decode layer goes, and the one-process experts call it replaces
        "stages_us_per_layer": {
            s: {k: median(r["stages_us"][k] for r in rows[s]) for k in STAGES} for s in SYSTEMS[1:]
        },
        "reference_experts_us_per_layer": median(r["experts_us_per_layer"] for r in rows["reference"]),
        "rows": rows,
    }
    # The experts call alone: main's whole remote call (prepare + round trip + take + combine) above
    # the one-process experts call it replaces. The per-token figure above also holds what main does
    # once a token and the reference does not (streaming it to the client, detokenizing) and main's
    # own layers running slower in a process that slept while the workers computed.
    reference_call = summary["reference_experts_us_per_layer"]
    summary["call_overhead_us_per_layer"] = {
        s: st["prepare"] + st["round_trip"] + st["take"] + st["combine"] - reference_call
        for s, st in summary["stages_us_per_layer"].items()
    }
    return summary


def _generate(system: str, reference, clusters: dict, ids: list[int], new_tokens: int) -> dict:
    if system == "reference":
        run = timed_generate(reference, ids, new_tokens)
        decode_tokens = run["new_tokens"] - 1
        return {
            "decode_s_per_token": 1 / run["decode_tokens_per_s"] if decode_tokens else None,
            "token_ids": run["token_ids"],
        }
    result = clusters[system].client.generate(ids, max_new_tokens=new_tokens)
    d = result.stats["decode"]
    return {
        "decode_s_per_token": d["seconds"] / d["tokens"],
        "wait_us_per_layer": d["wait_s"] / d["layers"] * 1e6,
        "compute_us_per_expert": d["compute_s"] / d["experts"] * 1e6,
        "stages_us": {k: d[f"{k}_s"] / d["layers"] * 1e6 for k in STAGES},
        "token_ids": result.token_ids,
    }


def _time_decode_experts(model) -> list[float]:
    """Forward hooks on every experts module: the seconds of each one-token (decode) call, appended."""
    times: list[float] = []
    started = [0.0]

    def pre(module, args):
        started[0] = time.perf_counter()

    def post(module, args, output):
        if args[0].shape[0] == 1:  # hidden [T, H]: one token is a decode step
            times.append(time.perf_counter() - started[0])

    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            experts.register_forward_pre_hook(pre)
            experts.register_forward_hook(post)
    return times


# -- the verdict -----------------------------------------------------------------------------------
def goal(report: dict) -> dict:
    """The issue's figure: layer overhead / raw round trip, security on against CURVE, off against plain."""
    wire, over = report["wire_us"], report["layers"]["overhead_us_per_layer"]
    raw = {s: wire[k]["median"] for s, k in RAW_OF.items()}
    verdict = {**{s: over[s] / raw[s] for s in raw}, "target": 2.0}
    fanout = report.get("fanout_us")
    if fanout:  # the exchange with no software at all: how far below the goal the wire itself is
        verdict["floor_security_off"] = fanout["floor_us_per_layer"] / raw["security_off"]
    computing = report.get("fanout_computing_us")
    if computing:  # the same with the echoes computing real experts: the wire and a woken compute
        verdict["floor_computing_security_off"] = computing["floor_us_per_layer"] / raw["security_off"]
    call = report["layers"].get("call_overhead_us_per_layer")
    if call:  # the experts call alone (no per-token costs)
        verdict.update({f"call_{s}": call[s] / raw[s] for s in raw})
    if "raw_plain_spaced" in wire:  # beside it, against the wire between processes that slept
        verdict.update({f"{s}_vs_spaced": over[s] / wire[f"{k}_spaced"]["median"] for s, k in RAW_OF.items()})
    return verdict


def print_report(report: dict) -> None:
    w, c, lay = report["wire_us"], report["codec_us"], report["layers"]
    if report.get("pinned"):
        print(f"\npinned: {report['pinned']}")
    if report.get("spread"):
        print("\neach worker on a core of its own (cluster.spread_workers=true)")
    print(f"\nround trip of one decode layer's call ({report['row_bytes']} B row), µs, median:")
    print(f"{'':<8}{'plain':>10}{'CURVE':>10}")
    for mode in ("raw", "codec"):
        print(f"{mode:<8}{w[f'{mode}_plain']['median']:10.1f}{w[f'{mode}_curve']['median']:10.1f}")
    if "raw_plain_spaced" in w:
        print(
            f"{'raw, after sleeping between round trips':<8}"
            f"{w['raw_plain_spaced']['median']:10.1f}{w['raw_curve_spaced']['median']:10.1f}"
        )
    print("codec in-process, µs: " + ", ".join(f"{k} {v:.1f}" for k, v in c.items()))
    ms = lay["decode_ms_per_token"]
    print(
        f"decode ms/token: one process {ms['reference']:.2f}, cluster security on {ms['security_on']:.2f}, "
        f"off {ms['security_off']:.2f} ({report['moe_layers']} MoE layers; "
        f"token sequences differing: {lay['token_sequences_differing']})"
    )
    print(
        f"where a decode layer goes, µs (medians); one process's experts call: "
        f"{lay['reference_experts_us_per_layer']:.1f}"
    )
    for s, st in lay["stages_us_per_layer"].items():
        print(
            f"  {s:<13} prepare {st['prepare']:7.1f} | round trip {st['round_trip']:7.1f} (worker "
            f"{st['worker']:.1f}, of it compute {lay['worker_compute_us_per_expert'][s]:.1f}; wire, "
            f"wake-ups, sends, worker encode {st['round_trip'] - st['worker']:.1f}) | decode answers "
            f"{st['take']:6.1f} | combine {st['combine']:6.1f}"
        )
    for s in ("security_on", "security_off"):
        raw = w[RAW_OF[s]]["median"]
        print(
            f"{s:<13} overhead per decode layer {lay['overhead_us_per_layer'][s]:8.1f} µs "
            f"= {report['goal'][s]:.2f} x raw round trip ({raw:.1f} µs); main waited "
            f"{lay['wait_us_per_layer'][s]:.1f} µs per layer, worker computed "
            f"{lay['worker_compute_us_per_expert'][s]:.1f} µs per expert"
        )
        if f"{s}_vs_spaced" in report["goal"]:
            print(f"{'':<13} = {report['goal'][f'{s}_vs_spaced']:.2f} x the raw round trip after sleeping")
        if s == "security_off" and (f := report.get("fanout_us")):
            print(
                f"{'':<13} the floor: {f['calls']} raw calls fanned out to {f['echoes']} echoes busy "
                f"{f['spin_us']:.0f} µs each took {f['median']:.1f} µs, {f['floor_us_per_layer']:.1f} µs "
                f"above the one-process call = {report['goal']['floor_security_off']:.2f} x raw"
            )
        if s == "security_off" and (f := report.get("fanout_computing_us")):
            print(
                f"{'':<13} the floor with real compute (main applying its own weights between rounds): "
                f"the echoes computing an expert each "
                f"({f['compute_us']:.0f} µs a call, the workers "
                f"{lay['worker_compute_us_per_expert'][s]:.0f}) "
                f"took {f['median']:.1f} µs, {f['floor_us_per_layer']:.1f} µs above the one-process call "
                f"= {report['goal']['floor_computing_security_off']:.2f} x raw"
            )
        if f"call_{s}" in report["goal"]:
            print(
                f"{'':<13} the experts call alone (main's remote call above the one-process call): "
                f"{lay['call_overhead_us_per_layer'][s]:.1f} µs = {report['goal'][f'call_{s}']:.2f} x raw"
            )
