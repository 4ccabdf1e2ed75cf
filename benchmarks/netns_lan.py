"""A local cluster spread over network namespaces joined by a shaped bridge: a LAN on one machine.

    python benchmarks/netns_lan.py [--model tiny|trained|DIR] [--gbit 1] [--latency-ms 0.1] [--tokens 64]

Each node (main, shadow, worker0..N-1) runs in a namespace of its own (`odmoe-<node>`) with one
veth pair into a bridge (`odmoe-br`, 10.77.0.254/24) in this namespace, where the client runs. Both
ends of every veth are shaped with `tc netem delay L rate B` (the paper's LAN: 1 Gbit/s, 0.1 ms);
where the kernel has no sch_netem, `tbf rate B` shapes bandwidth alone and the report says the
latency was not emulated. `drop` and `heal` (iptables in a node's namespace) make a node's link
lose a share of its packets, or all of them, and take that away again (tests/test_network_faults.py).
The script only creates and removes its own namespaces, veths and bridge (10.77.0.0/24), also
after an error or Ctrl-C; it needs root and iproute2. It prints decode tokens/s
and TTFT of the same cluster on plain loopback and on the shaped LAN (tokens must be identical) and
writes benchmarks/results/netns-lan.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time

from odmoe.launch.local_cluster import NodePlacement
from odmoe.models.open_model import load_tokenizer
from odmoe.tools.model_names import resolve_model
from odmoe_bench.cluster_runs import run_cluster
from odmoe_bench.results import RESULTS, write_report
from odmoe_bench.workload import prompt_ids

SUBNET, BRIDGE = "10.77.0", "odmoe-br"
BRIDGE_ADDRESS = f"{SUBNET}.254"  # the root namespace's side: the client (and any relay) lives here


class Lan:
    """The namespaces, veths and bridge of one run; `with Lan(...)` removes them whatever happens."""

    def __init__(self, nodes: list[str], gbit: float, latency_ms: float):
        self.nodes, self.gbit, self.latency_ms = nodes, gbit, latency_ms
        self.latency_emulated = True
        self.shaping: list[str] = []

    @staticmethod
    def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), check=check, capture_output=True, text=True)

    def namespace(self, node: str) -> str:
        return f"odmoe-{node}"

    def address(self, node: str) -> str:
        return f"{SUBNET}.{self.nodes.index(node) + 1}"

    def placement(self, node: str) -> NodePlacement:
        return NodePlacement(
            prefix=["ip", "netns", "exec", self.namespace(node)], words=[f"cluster.host={self.address(node)}"]
        )

    def __enter__(self) -> Lan:
        self._remove()  # leftovers of a run that was killed
        try:
            self._run("ip", "link", "add", BRIDGE, "type", "bridge")
            self._run("ip", "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", BRIDGE)
            self._run("ip", "link", "set", BRIDGE, "up")
            for i, node in enumerate(self.nodes):
                ns, inner, outer = self.namespace(node), f"odm{i}n", f"odm{i}h"
                self._run("ip", "netns", "add", ns)
                self._run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
                self._run("ip", "link", "set", inner, "netns", ns)
                self._run("ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", inner)
                self._run("ip", "-n", ns, "link", "set", inner, "up")
                self._run("ip", "-n", ns, "link", "set", "lo", "up")
                self._run("ip", "link", "set", outer, "master", BRIDGE)
                self._run("ip", "link", "set", outer, "up")
                self._shape(["ip", "netns", "exec", ns], inner)
                self._shape([], outer)
        except BaseException:
            self._remove()
            raise
        return self

    def _shape(self, prefix: list[str], dev: str) -> None:
        netem = [*prefix, "tc", "qdisc", "add", "dev", dev, "root", "netem"]
        netem += ["delay", f"{self.latency_ms}ms", "rate", f"{self.gbit}gbit"]
        if self._run(*netem, check=False).returncode == 0:
            self.shaping.append(" ".join(netem[len(prefix) :]).replace(f"dev {dev} ", "dev DEV "))
            return
        self.latency_emulated = False  # no sch_netem in this kernel: bandwidth only
        burst = max(64_000, int(self.gbit * 1e9 / 8 / 100))  # 10 ms of traffic
        tbf = [*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.gbit}gbit"]
        tbf += ["burst", str(burst), "latency", "50ms"]
        self._run(*tbf)
        self.shaping.append(" ".join(tbf[len(prefix) :]).replace(f"dev {dev} ", "dev DEV "))

    def drop(
        self, node: str, probability: float = 1.0, peer: str | None = None, bridge: bool = False
    ) -> None:
        """Drop this share of the node's packets, both ways, on its link into the bridge (iptables in
        its namespace: `statistic --mode random`, or every packet at 1.0 — a black hole while its
        process lives); with `peer`, only its packets to and from that node (a partition between
        the two). The client's traffic (the bridge's own address) is spared: the client's link is
        not the node's — unless `bridge`, for nodes that reach each other through relays listening
        on the bridge's address (their every packet then crosses it). `heal` takes every drop of
        the node away."""
        ns, dev = self.namespace(node), f"odm{self.nodes.index(node)}n"
        share = ["-m", "statistic", "--mode", "random", "--probability", f"{probability:g}"]
        match = share if probability < 1 else []
        for chain, way, side in (("INPUT", "-i", "-s"), ("OUTPUT", "-o", "-d")):
            spare = [] if bridge else ["!", side, BRIDGE_ADDRESS]
            whom = [side, self.address(peer)] if peer else spare
            rule = [chain, way, dev, *whom, *match, "-j", "DROP"]
            self._run("ip", "netns", "exec", ns, "iptables", "-w", "-A", *rule)

    def heal(self, node: str) -> None:
        for chain in ("INPUT", "OUTPUT"):
            self._run("ip", "netns", "exec", self.namespace(node), "iptables", "-w", "-F", chain)

    def _remove(self) -> None:
        for node in self.nodes:
            self._run("ip", "netns", "del", self.namespace(node), check=False)  # takes its veth pair along
        self._run("ip", "link", "del", BRIDGE, check=False)
        # the kernel frees a namespace (and its veths) in the background, seconds later after a run
        # with many sockets: wait, so a Lan made next does not find the names taken
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
            self._run("ip", "link", "show", f"odm{i}h", check=False).returncode == 0
            for i in range(len(self.nodes))
        ):
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        self._remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny | trained | a checkpoint directory")
    parser.add_argument("--gbit", type=float, default=1.0)
    parser.add_argument("--latency-ms", type=float, default=0.1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--overrides", nargs="*", default=[], help="more odmoe-launch words for both runs")
    parser.add_argument("--out", default=str(RESULTS / "netns-lan.json"))
    args = parser.parse_args()
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("netns_lan: needs iproute2 (ip, tc) and root")
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    prompts = [prompt_ids(tokenizer, i, 32) for i in range(3)]
    words = [f"cluster.workers={args.workers}", "cluster.group_size=2", *args.overrides]
    nodes = ["main", "shadow", *[f"worker{i}" for i in range(args.workers)]]
    report: dict = {"model": path, "gbit": args.gbit, "latency_ms": args.latency_ms, "words": words}
    runs = {"loopback": run_cluster(path, words, prompts, args.tokens)}
    with Lan(nodes, args.gbit, args.latency_ms) as lan:
        runs["lan"] = run_cluster(path, words, prompts, args.tokens, place=lan.placement)
        report.update(latency_emulated=lan.latency_emulated, shaping=sorted(set(lan.shaping)))
    report["tokens_identical"] = runs["lan"].token_ids == runs["loopback"].token_ids
    print(f"{'':10}{'decode tok/s':>14}{'TTFT ms':>10}{'main wait ms/token':>20}")
    for name, run in runs.items():
        row = {
            "decode_tokens_per_s": statistics.mean(s["decode_tokens_per_s"] for s in run.stats),
            "ttft_ms": statistics.mean(s["ttft_s"] for s in run.stats) * 1e3,
            "main_wait_ms_per_token": statistics.mean(
                s["decode"]["wait_s"] * 1e3 / max(s["decode"]["tokens"], 1) for s in run.stats
            ),
        }
        report[name] = row
        print(
            f"{name:10}{row['decode_tokens_per_s']:14.1f}{row['ttft_ms']:10.1f}{row['main_wait_ms_per_token']:20.2f}"
        )
    print(f"shaping: {'; '.join(report['shaping'])}")
    if not report["latency_emulated"]:
        print("note: this kernel has no sch_netem: bandwidth was shaped, latency was not emulated")
    print(f"tokens identical: {report['tokens_identical']}")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
