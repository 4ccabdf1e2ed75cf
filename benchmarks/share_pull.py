"""Each box pulls its share (issue 48): bytes pulled per role against its share, at real width.

    python -m odmoe_bench.share_pull [--layers 8] [--hidden 1024] [--intermediate 3584]
        [--workers 4] [--group-size 2] [--rate-mbps 800] [--out benchmarks/results/share-pull.json]

A Mixtral-shaped bf16 checkpoint of real width (random weights, `make_wide_model`, sharded) is
served by the Share service over TLS with the cluster's token on 127.0.0.1 (what `role=seed` or a
main with `cluster.join_port` runs); a worker (worker.only_own_layers: its group's layers), main's
standby and the shadow each pull into an empty directory as `model.pull_from` does, then again (a
second start). Printed per role: MiB pulled, its share (its tensors' bytes), pulled / share - 1
(the small files and safetensors headers), seconds and MiB/s, the disk the sparse copy takes, and
what the second start pulled. Then one pull capped at --rate-mbps, to show the cap holds.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from odmoe.launch.pull import choose_for
from odmoe.launch.settings import compose
from odmoe.models.checkpoint_index import build_index
from odmoe.models.share_pull import pull_share
from odmoe.rpc import odmoe_pb2_grpc
from odmoe.tools.model_factory import make_wide_model
from odmoe.transport.security import ClientCredentials, ServerSecrets, init_key_dir
from odmoe.transport.share_server import serve_share
from odmoe_bench.results import write_report
from odmoe_bench.wide_model import add_wide_model_args, wide_spec


def _disk(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_wide_model_args(parser)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--rate-mbps", type=float, default=800.0)
    parser.add_argument("--out", default="benchmarks/results/share-pull.json")
    args = parser.parse_args(argv)
    spec = wide_spec(args)
    words = [
        f"cluster.workers={args.workers}", f"cluster.group_size={args.group_size}",
        "worker.only_own_layers=true", "worker.index=0",
    ]  # fmt: skip
    report: dict = {"spec": spec.name, "workers": args.workers, "group_size": args.group_size, "roles": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        model = make_wide_model(spec, root / "model", max_shard_size="500MB")
        report["made_s"] = time.perf_counter() - start
        start = time.perf_counter()
        index = build_index(model)
        report["index_s"] = time.perf_counter() - start
        report["checkpoint_bytes"] = index.total_bytes
        keys = init_key_dir(root / "keys", args.workers)
        server, port, servicer = serve_share(
            model, index, "127.0.0.1", 0, ServerSecrets.from_key_dir(keys.root)
        )
        credentials = ClientCredentials.from_key_dir(keys.root)
        channel = credentials.channel(f"127.0.0.1:{port}", [("grpc.max_receive_message_length", 64 << 20)])
        stub = odmoe_pb2_grpc.ShareStub(channel)
        print(f"checkpoint {spec.name}: {index.total_bytes / 2**20:.0f} MiB in {len(index.files)} files")
        print(f"{'role':<8}{'pulled MiB':>12}{'share MiB':>11}{'over share':>11}{'s':>7}{'MiB/s':>8}"
              f"{'disk MiB':>10}{'2nd start':>11}")  # fmt: skip
        for role in ("worker", "main", "shadow"):
            # role=main's own checks want worker addresses; what it pulls depends on the role alone
            cfg = compose(["role=worker", *words, "security.enabled=false"])
            choose = choose_for(cfg, role)
            dest = root / f"pulled-{role}"
            first = pull_share(stub, dest, choose, metadata=credentials.metadata)
            share = sum(t.nbytes for t in index.tensors if t.name in choose(index, dest))
            again = pull_share(stub, dest, choose, metadata=credentials.metadata)
            row = {
                "pulled_bytes": first.pulled_bytes,
                "share_bytes": share,
                "over_share": first.pulled_bytes / share - 1,
                "seconds": first.seconds,
                "mib_per_s": first.pulled_bytes / 2**20 / first.seconds,
                "disk_bytes": _disk(dest),
                "second_start_bytes": again.pulled_bytes,
                "of_checkpoint": first.pulled_bytes / index.total_bytes,
            }
            report["roles"][role] = row
            mib = {k: row[k] / 2**20 for k in ("pulled_bytes", "disk_bytes", "second_start_bytes")}
            print(
                f"{role:<8}{mib['pulled_bytes']:12.1f}{share / 2**20:11.1f}{row['over_share']:11.2%}"
                f"{row['seconds']:7.1f}{row['mib_per_s']:8.0f}{mib['disk_bytes']:10.1f}"
                f"{mib['second_start_bytes']:11.1f}"
            )
        cfg = compose(["role=worker", *words, "security.enabled=false"])
        capped = pull_share(
            stub, root / "capped", choose_for(cfg, "worker"), rate_bytes_s=args.rate_mbps * 1e6 / 8,
            metadata=credentials.metadata,
        )  # fmt: skip
        rate = capped.pulled_bytes * 8 / 1e6 / capped.seconds
        report["capped"] = {"cap_mbps": args.rate_mbps, "measured_mbps": rate, "seconds": capped.seconds}
        print(
            f"capped at {args.rate_mbps:.0f} Mbit/s: {rate:.0f} Mbit/s measured over {capped.seconds:.1f} s"
        )
        report["bytes_sent_by_source"] = servicer.bytes_sent
        channel.close()
        server.stop(grace=0)
    report["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
