"""Suite `memory`: what each node holds at real width, how that grows with the model, how fast a node
is ready, and how fast the disk serves when the cluster's memory is below the model.

Real-width Mixtral-shaped bf16 checkpoints of `memory.layers` MoE layers each (hidden 1024,
intermediate 3584, 8 experts of 21 MiB: ~0.17 GiB a layer), made once under the model cache by
`odmoe-make-model --fast-fill`'s code. Every cluster runs with each node in its own memory cgroup
(odmoe.launch.memory_cgroups), so the kernel's own account (page cache included) is read beside each
process's resident memory (/proc: VmHWM, the peak; VmRSS, RssAnon, RssFile once serving).

Part 1, per checkpoint and per system (`memory.systems`), 4 workers in 2 groups, no limit:
- `defaults`: odmoe's defaults (shadow.precision=auto, worker.cache=auto: the cache is the store);
- `paper`: preset=paper with worker.only_own_layers=true (cacheless workers; each group stores its
  layers; the shadow as the defaults);
- `disk`: worker.store=disk with nothing kept (worker.host_memory=1: every expert read on each load).
Per node: peak and steady resident memory (anonymous, file-backed), the cgroup's peak, time to ready
and what it read at start; the slope of each role's steady memory over the checkpoint's size; the
tokens against one process's (`identical`).
Part 2: the shadow alone at each precision (`memory.shadow_precisions`), each load in a process of
its own (benchmarks/shadow_memory.py): peak while loading against steady, weight bytes over the bf16's.
Part 3, the disk path (`memory.disk_fractions`, on the largest checkpoint): worker.store=disk with
each worker's cgroup limit its fixed cost plus fraction x its share of the experts (the cluster's
memory for experts = fraction x the checkpoint), the defaults otherwise: decode tokens/s, bytes read
per token, the workers' memory pressure (the kernel's PSI "some" stall share while decoding, the
system-wide figure of /proc/pressure/memory and /proc/pressure/io) and the disk's own read bandwidth
(O_DIRECT reads of the checkpoint).
Part 4, start-up at scale (`memory.startup_workers`): one worker of the largest checkpoint started
alone with the checkpoint's pages dropped from the page cache: its time to ready against its share's
bytes at the disk's bandwidth.
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from odmoe.launch.memory_cgroups import MemoryCgroups
from odmoe.memory_plan import MARGIN_BYTES, PROCESS_BYTES
from odmoe.node_memory import process_memory
from odmoe.tools.model_factory import default_cache_dir, make_wide_model
from odmoe_bench import plots
from odmoe_bench.config import BenchConfig
from odmoe_bench.results import ResultsDir
from odmoe_bench.wide_model import wide_spec

GiB, MiB = 1 << 30, 1 << 20
SYSTEM_WORDS = {
    "defaults": [],
    "paper": ["preset=paper", "worker.only_own_layers=true", "shadow.precision=auto"],
    "disk": ["worker.store=disk", "worker.host_memory=1"],
}


def run(cfg: BenchConfig, model_path: str, out: ResultsDir) -> dict:
    m = cfg.memory
    if reason := MemoryCgroups.available():
        raise ValueError(f"suite memory runs each node in a memory cgroup: {reason}")
    models = [_model(m, layers) for layers in m.layers]
    rows, shadow_rows = [], []
    for path in models:
        size = _disk_bytes(path)
        want = _reference(path, m.prompt, m.new_tokens)
        for system in m.systems:
            print(f"-- {Path(path).name} ({size / GiB:.2f} GiB): {system}", flush=True)
            row = _cluster(path, SYSTEM_WORDS[system], m, {})
            row.update(model=Path(path).name, checkpoint_bytes=size, system=system)
            row["identical"] = row.pop("token_ids") == want
            rows.append(row)
        for precision in m.shadow_precisions:
            print(f"-- {Path(path).name}: the shadow at {precision}", flush=True)
            shadow_rows.append(
                {"model": Path(path).name, "checkpoint_bytes": size, **_shadow(path, precision)}
            )
    disk = _disk_path(models[-1], m) if m.disk_fractions else []
    bandwidth = _disk_bandwidth(models[-1])
    report = {
        "rows": rows,
        "shadow": shadow_rows,
        "slopes": _slopes(rows),
        "disk_path": disk,
        "disk_read_bytes_per_s": bandwidth,
        "startup": [_startup(models[-1], workers, bandwidth) for workers in m.startup_workers],
        "identical": all(r["identical"] for r in rows) and all(d["identical"] for d in disk),
    }
    _print(report)
    ran = {
        "model": models,
        "emulated_link": None,
        "cluster": {"workers": 4, "group_size": 2, "systems": m.systems},
    }
    out.write("memory", "memory", report, meta=ran)  # not bench.model / bench.cluster: its own
    plots.memory(report, out.path("memory", "png"), f"{m.new_tokens} new tokens; 4 workers in 2 groups")
    return report


def _model(m, layers: int) -> str:
    target = default_cache_dir() / f"memory-mixtral-{layers}x{m.hidden}x{m.intermediate}"
    if not (target / "odmoe_model.json").is_file():
        print(f"making {target}", flush=True)
        make_wide_model(wide_spec(m, layers=layers), target)
    return str(target)


def _disk_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def _reference(path: str, prompt: str, new_tokens: int) -> list[int]:
    """One process's greedy tokens, in a child process so its memory is gone before the clusters."""
    code = (
        "import json,sys,torch;from transformers import AutoModelForCausalLM,AutoTokenizer;"
        "p,t,n=sys.argv[1],sys.argv[2],int(sys.argv[3]);m=AutoModelForCausalLM.from_pretrained(p);"
        "ids=AutoTokenizer.from_pretrained(p)(t,return_tensors='pt')['input_ids'];"
        "o=m.generate(ids,attention_mask=torch.ones_like(ids),do_sample=False,max_new_tokens=n);"
        "print(json.dumps(o[0,ids.shape[1]:].tolist()))"
    )
    return _child(code, path, prompt, str(new_tokens))


def _child(code: str, *args: str):
    """What the Python `code` run in a child process with `args` printed last (JSON); RuntimeError
    with its stderr's tail where it failed."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{code[:60]}... failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _psi(kind: str) -> float:
    """The kernel's cumulative "some" stall time in seconds for `kind` (memory / io), system-wide."""
    try:
        line = Path(f"/proc/pressure/{kind}").read_text().splitlines()[0]
    except OSError:
        return 0.0
    return int(line.rsplit("total=", 1)[1]) / 1e6


def _cluster(path: str, words: list[str], m, limits: dict[str, int]) -> dict:
    """One cluster in cgroups: a warm-up request, then `m.new_tokens` timed; per node memory."""
    from odmoe import LocalCluster

    start = time.time()
    with MemoryCgroups(limits) as cg:
        with LocalCluster(
            path, workers=4, group_size=2, overrides=words, place=cg.place, ready_timeout_s=1800
        ) as c:
            ready_s = time.time() - start
            c.client.generate(m.prompt, max_new_tokens=2)
            psi = (_psi("memory"), _psi("io"), time.perf_counter())
            got = c.client.generate(m.prompt, max_new_tokens=m.new_tokens)
            wall = time.perf_counter() - psi[2]
            psi_memory, psi_io = (_psi("memory") - psi[0]) / wall, (_psi("io") - psi[1]) / wall
            nodes = {}
            for node in c.nodes:
                s = process_memory(node.process.pid)
                nodes[node.name] = {
                    "peak": s.peak,
                    "steady": s.resident,
                    "anonymous": s.anonymous,
                    "file_backed": s.file_backed,
                    "ready_s": node.ready_s,
                }
            for name, info in c.ready_info().items():
                nodes[name].update(read_bytes=info.get("read_bytes", 0), read_s=info.get("read_s", 0.0))
        for name, cgm in cg.report().items():
            if name in nodes:
                nodes[name].update(cgroup_peak=cgm.peak, cgroup_limit=cgm.limit, oom_kills=cgm.oom_kills)
    stats = got.stats
    return {
        "nodes": nodes,
        "cluster_ready_s": ready_s,
        "decode_tokens_per_s": stats["decode_tokens_per_s"],
        "bytes_loaded_per_token": stats["bytes_loaded"] / max(len(got.token_ids), 1),
        "recall_in_time": (stats.get("recall") or {}).get("overall"),
        "psi_memory_some": psi_memory,
        "psi_io_some": psi_io,
        "token_ids": got.token_ids,
    }


def _shadow(path: str, precision: str) -> dict:
    """The shadow's memory at one precision, loaded in a process of its own (shadow_memory)."""
    code = (
        "import json,sys;from odmoe_bench.shadow_memory import measure_memory;"
        "print(json.dumps(measure_memory(sys.argv[1],sys.argv[2],False)))"
    )
    try:
        return {"precision": precision, **_child(code, path, precision)}
    except RuntimeError as failed:
        return {"precision": precision, "error": str(failed)[-500:]}


def _slopes(rows: list[dict]) -> dict:
    """Per system and role, the least-squares slope of steady resident bytes over checkpoint bytes
    (workers: their mean), and the intercept (what a node costs whatever the model)."""
    out: dict = {}
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        if len({r["checkpoint_bytes"] for r in mine}) < 2:
            continue
        for role in ("main", "shadow", "worker"):
            xs, ys = [], []
            for r in mine:
                values = [n["steady"] for name, n in r["nodes"].items() if name.rstrip("0123456789") == role]
                if values:
                    xs.append(r["checkpoint_bytes"])
                    ys.append(statistics.mean(values))
            if len(xs) >= 2:
                slope, intercept = statistics.linear_regression(xs, ys)
                out.setdefault(system, {})[role] = {"slope": slope, "intercept_bytes": intercept}
    return out


def _disk_path(path: str, m) -> list[dict]:
    size = _disk_bytes(path)
    want = _reference(path, m.prompt, m.new_tokens)
    expert_bytes = 3 * m.hidden * m.intermediate * 2
    experts_total = m.experts * m.layers[-1] * expert_bytes
    rows = []
    for fraction in m.disk_fractions:
        budget = int(fraction * experts_total / 4)
        limit = PROCESS_BYTES + MARGIN_BYTES + 2 * expert_bytes + budget
        print(
            f"-- disk path at {fraction:g} x the experts in the workers' memory ({limit / GiB:.2f} GiB each)"
        )
        row = _cluster(path, ["worker.store=disk"], m, {"worker": limit})
        row.update(fraction=fraction, worker_limit=limit, checkpoint_bytes=size)
        row["identical"] = row.pop("token_ids") == want
        rows.append(row)
    return rows


def _evict(path: str) -> None:
    """Drop the checkpoint's pages from the kernel's cache (posix_fadvise DONTNEED on each file), so
    that reading it comes from the disk; nothing else's pages are touched."""
    for file in Path(path).glob("*.safetensors"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _startup(path: str, workers: int, bandwidth: float | None) -> dict:
    """One worker of `workers` started alone with the checkpoint out of the page cache: its time to
    ready against reading its share at the disk's bandwidth, and against the same with its imports
    taken out (an interpreter importing the worker's modules, timed apart)."""
    import tempfile

    _evict(path)
    ready = Path(tempfile.mkdtemp()) / "ready.json"
    words = [
        "role=worker",
        "worker.index=0",
        f"cluster.workers={workers}",
        f"cluster.group_size={workers}",
        f"model.path={path}",
        "security.enabled=false",
        f"node.ready_file={ready}",
    ]
    start = time.perf_counter()
    node = subprocess.Popen(
        [sys.executable, "-m", "odmoe.launch.cli", *words],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not ready.exists() and node.poll() is None:
            time.sleep(0.05)
        ready_s = time.perf_counter() - start
        info = json.loads(ready.read_text()) if ready.exists() else {}
    finally:
        node.kill()
        node.wait()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import odmoe.nodes.worker"], check=True)
    import_s = time.perf_counter() - start
    read_bytes = info.get("read_bytes", 0)
    ideal_s = read_bytes / bandwidth if bandwidth else None
    return {
        "workers": workers,
        "ready_s": ready_s,
        "read_bytes": read_bytes,
        "read_s": info.get("read_s"),
        "import_s": import_s,
        "share_at_disk_bandwidth_s": ideal_s,
        "ready_over_disk": ready_s / ideal_s if ideal_s else None,
        "ready_less_imports_over_disk": (ready_s - import_s) / ideal_s if ideal_s else None,
    }


def _disk_bandwidth(path: str, chunk: int = 8 * MiB, total: int = 1 * GiB) -> float | None:
    """The disk's sequential read bandwidth, bypassing the page cache (O_DIRECT), over the checkpoint."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files or not hasattr(os, "O_DIRECT"):
        return None
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
    done, start = 0, time.perf_counter()
    try:
        fd = os.open(files[0], os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    try:
        while done < total:
            n = os.readv(fd, [buffer])
            if n <= 0:
                break
            done += n
    finally:
        os.close(fd)
    return done / (time.perf_counter() - start)


def _print(report: dict) -> None:
    print("\nmemory per node (GiB: peak / steady [anonymous + file-backed], cgroup peak; ready s)")
    for r in report["rows"]:
        print(
            f"{r['model']} {r['checkpoint_bytes'] / GiB:.2f} GiB, {r['system']}: identical {r['identical']}"
        )
        for name, n in r["nodes"].items():
            print(
                f"  {name:8s} {n['peak'] / GiB:.2f} / {n['steady'] / GiB:.2f} "
                f"[{n['anonymous'] / GiB:.2f} + {n['file_backed'] / GiB:.2f}], "
                f"cgroup {n.get('cgroup_peak', 0) / GiB:.2f}; ready {n['ready_s'] or 0:.1f} s"
                + (
                    f", read {n['read_bytes'] / GiB:.2f} GiB in {n['read_s']:.1f} s"
                    if n.get("read_bytes")
                    else ""
                )
            )
    for system, roles in report["slopes"].items():
        print(
            f"slope of steady bytes over checkpoint bytes, {system}: "
            + ", ".join(
                f"{role} {v['slope']:.3f} (+{v['intercept_bytes'] / GiB:.2f} GiB)"
                for role, v in roles.items()
            )
        )
    for s in report["shadow"]:
        if "error" in s:
            print(f"shadow {s['model']} {s['precision']}: failed")
            continue
        print(
            f"shadow {s['model']} {s['precision']}: weights {s.get('weight_over_bf16', 0):.2f} x bf16, "
            f"peak {s.get('peak_rss', 0) / GiB:.2f} / steady {s.get('steady_rss', 0) / GiB:.2f} GiB"
        )
    bw = report["disk_read_bytes_per_s"]
    print(f"disk read bandwidth (O_DIRECT): {bw / 2**20:.0f} MiB/s" if bw else "disk read bandwidth: n/a")
    for st in report["startup"]:
        ratio, without = st["ready_over_disk"], st["ready_less_imports_over_disk"]
        print(
            f"start-up, one worker of {st['workers']} alone, the checkpoint not in the page cache: "
            f"ready in {st['ready_s']:.1f} s, its share "
            f"{st['read_bytes'] / GiB:.2f} GiB read in {st['read_s'] or 0:.1f} s; at the disk's "
            f"bandwidth {st['share_at_disk_bandwidth_s'] or 0:.1f} s: "
            + (f"{ratio:.2f} x ({without:.2f} x less {st['import_s']:.1f} s of imports)" if ratio else "n/a")
        )
    for d in report["disk_path"]:
        print(
            f"disk path at {d['fraction']:g} x: {d['decode_tokens_per_s']:.2f} tokens/s, "
            f"{d['bytes_loaded_per_token'] / MiB:.0f} MiB read per token, PSI memory "
            f"{100 * d['psi_memory_some']:.1f} % io {100 * d['psi_io_some']:.1f} %, "
            f"identical {d['identical']}"
        )
