"""The generated gRPC code must be exactly what `make proto` produces from protos/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_protos(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(ROOT / "protos/odmoe/rpc/odmoe.proto"),
        ],
        check=True,
    )
    for name in ("odmoe_pb2.py", "odmoe_pb2.pyi", "odmoe_pb2_grpc.py"):
        fresh = (tmp_path / "odmoe/rpc" / name).read_text()
        assert (ROOT / "odmoe/rpc" / name).read_text() == fresh, f"odmoe/rpc/{name} drifted: run `make proto`"
