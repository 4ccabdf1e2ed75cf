"""A cluster joined only by the link at real width (issue 48): bytes each box pulls against its
share, time to serve, each node's peak memory, a box joining while requests run, tokens checked.

    python -m odmoe_bench.join_cluster [--layers 8] [--hidden 1024] [--intermediate 3584]
        [--workers 4] [--group-size 2] [--new-tokens 12] [--out benchmarks/results/join-cluster.json]

A Mixtral-shaped bf16 checkpoint of real width (random weights, `make_wide_model`) is on main's
side only. Main starts with the join door (`cluster.join_port=0`), `worker.only_own_layers=true` and
`cluster.min_workers=workers-1`; one box per node runs `odmoe-launch join=LINK` with a HOME of its own
(no keys, no checkpoint): the shadow and all workers but the last, which pull their shares and serve.
Then requests run back to back while the last box joins the serving cluster (growth). Printed: per
box its name, MiB pulled, its share's MiB (the tensors its role needs) and the excess, seconds from
its start until it served; main's time to serve; each node's peak RSS (VmHWM); how long the growing
box took until main used it; and whether every request's tokens equal transformers' own greedy
decoding of the same checkpoint (bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from odmoe.launch.pull import choose_for
from odmoe.launch.settings import compose
from odmoe.models.checkpoint_index import build_index
from odmoe.node_memory import process_memory
from odmoe.tools.model_factory import make_wide_model
from odmoe_bench.results import write_report
from odmoe_bench.wide_model import add_wide_model_args, wide_spec

PROMPT = "def fibonacci(n):"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(model: Path, new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens
        )
    return out[0, ids.shape[1] :].tolist()


def _peak_rss(root: psutil.Process) -> int:
    """The largest VmHWM among a box's processes (its node is a child of the launcher); 0 for one gone."""
    return max(process_memory(p.pid).peak for p in [root, *root.children(recursive=True)])


def _wait(what, timeout_s: float, why) -> float:
    start = time.monotonic()
    while not what():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(why())
        time.sleep(0.2)
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_wide_model_args(parser)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", default="benchmarks/results/join-cluster.json")
    args = parser.parse_args(argv)
    spec = wide_spec(args)
    shape = [f"cluster.workers={args.workers}", f"cluster.group_size={args.group_size}"]
    report: dict = {"spec": spec.name, "workers": args.workers, "group_size": args.group_size, "boxes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_wide_model(spec, root / "model", max_shard_size="500MB")
        index = build_index(model)
        report["checkpoint_bytes"] = index.total_bytes
        print(f"checkpoint {spec.name}: {index.total_bytes / 2**20:.0f} MiB", flush=True)
        want = _reference(model, args.new_tokens)
        key_dir, ready, log = root / "main-keys", root / "main.json", root / "main.log"
        port = _free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        main_proc = subprocess.Popen(
            [sys.executable, "-m", "odmoe.launch.cli", "role=main", f"model.path={model}", *shape,
             "worker.only_own_layers=true", f"cluster.min_workers={args.workers - 1}", "cluster.join_port=0",
             "server.http=false", f"cluster.main_port={port}", f"security.key_dir={key_dir}",
             f"node.ready_file={ready}"],
            stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env,
        )  # fmt: skip
        boxes: dict[str, tuple[subprocess.Popen, float]] = {}

        def start_box(b: str) -> None:
            home = root / b
            home.mkdir()
            proc = subprocess.Popen(
                [sys.executable, "-m", "odmoe.launch.cli", line], stdout=subprocess.DEVNULL,
                stderr=open(home / "log", "ab"), env={**env, "HOME": str(home)}, start_new_session=True,
            )  # fmt: skip
            boxes[b] = (proc, time.monotonic())

        try:
            _wait(lambda: (key_dir / "join-link").exists(), args.timeout_s, log.read_text)
            line = (key_dir / "join-link").read_text().split()[-1]
            first = args.workers  # the shadow and workers - 1 workers
            for b in range(first):
                start_box(f"box{b}")
            report["main_serving_s"] = _wait(ready.exists, args.timeout_s, log.read_text) + (
                boxes["box0"][1] - start
            )
            from odmoe import Client

            with Client(f"127.0.0.1:{port}", credentials=str(key_dir)) as client:
                runs: list[list[int]] = []
                stats: list[dict] = []
                grown = threading.Event()

                def keep_asking() -> None:
                    while not grown.is_set() or len(runs) < 2:
                        got = client.generate(PROMPT, max_new_tokens=args.new_tokens)
                        runs.append(list(got.token_ids))
                        stats.append(got.stats)

                asking = threading.Thread(target=keep_asking)
                asking.start()
                last = f"box{first}"
                start_box(last)
                report["growth_s"] = _wait(
                    lambda: args.workers - 1 in client.info()["live_workers"], args.timeout_s,
                    lambda: (root / last / "log").read_text()[-3000:],
                )  # fmt: skip
                grown.set()
                asking.join(timeout=args.timeout_s)
                after = client.generate(PROMPT, max_new_tokens=args.new_tokens)
                runs.append(list(after.token_ids))
                report["requests"] = len(runs)
                report["different"] = sum(r != want for r in runs)
                report["new_worker_experts"] = after.stats["per_worker"].get(f"worker{args.workers - 1}", {})
                report["peak_rss_main"] = after.stats["peak_rss_bytes"]["main"]
            print(f"main serving after {report['main_serving_s']:.1f} s (its boxes started at once)")
            print(f"{'box':<6}{'name':<9}{'pulled MiB':>11}{'share MiB':>11}{'over':>8}{'peak RSS MiB':>14}")
            for b, (proc, _) in sorted(boxes.items()):
                home = root / b
                name = json.loads(next(home.glob(".cache/odmoe/joined/*/identity.json")).read_text())["name"]
                record = next(home.glob(".cache/odmoe/pulled/*/odmoe-share.json"))
                pulled = json.loads(record.read_text())["pulled_bytes_total"]
                role = "shadow" if name == "shadow" else "worker"
                index_words = [f"worker.index={name.removeprefix('worker')}"] if role == "worker" else []
                cfg = compose(["role=worker", *shape, "worker.only_own_layers=true", *index_words,
                               "security.enabled=false"])  # fmt: skip
                share = sum(
                    t.nbytes for t in index.tensors if t.name in choose_for(cfg, role)(index, record.parent)
                )
                peak = _peak_rss(psutil.Process(proc.pid))
                report["boxes"][name] = {"pulled_bytes": pulled, "share_bytes": share, "peak_rss": peak}
                print(f"{b:<6}{name:<9}{pulled / 2**20:11.1f}{share / 2**20:11.1f}{pulled / share - 1:8.2%}"
                      f"{peak / 2**20:14.0f}")  # fmt: skip
            print(f"main peak RSS {report['peak_rss_main'] / 2**20:.0f} MiB")
            print(
                f"growth: worker{args.workers - 1}'s box served by main {report['growth_s']:.1f} s after it "
                f"started; then it computed {report['new_worker_experts'].get('experts', 0):.0f} experts of "
                f"a request"
            )
            print(f"{report['requests']} requests, {report['different']} with tokens unlike transformers'")
        finally:
            for proc, _ in boxes.values():
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            main_proc.terminate()
            for proc in [*(p for p, _ in boxes.values()), main_proc]:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    report["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
