"""The LAN-on-one-machine script: nodes in their own network namespaces still produce the
reference's tokens, and everything the script created is gone afterwards. Needs root and
iproute2 (skipped elsewhere); slow."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "netns_lan.py"


def _can_make_namespaces() -> bool:
    probe = subprocess.run(["ip", "netns", "add", "odmoe-probe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "odmoe-probe"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.integration
def test_cluster_over_namespaces_gives_the_same_tokens_and_cleans_up(tmp_path, reap_children):
    try:
        if not _can_make_namespaces():
            pytest.skip("cannot create network namespaces here (needs root and iproute2)")
    except FileNotFoundError:
        pytest.skip("iproute2 is not installed")
    out = tmp_path / "lan.json"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny", "--tokens", "6", "--out", str(out)],
        check=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    assert report["tokens_identical"]
    assert report["lan"]["decode_tokens_per_s"] > 0 and report["shaping"]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "odmoe-" not in namespaces
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert "odmoe-br" not in links and "odm0h" not in links
