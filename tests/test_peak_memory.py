"""A node's reported peak memory is its own (odmoe.tools.memory.peak_rss_bytes), not that of the
process that spawned it: Linux carries getrusage's ru_maxrss across exec, so a node started by a
large process (a benchmark holding the reference model, a test runner) reported the parent's peak."""

from __future__ import annotations

import subprocess
import sys

import pytest

from odmoe.tools.memory import peak_rss_bytes

CHILD = "from odmoe.tools.memory import peak_rss_bytes; print(peak_rss_bytes())"


@pytest.mark.integration  # starts a process
def test_a_process_spawned_by_a_large_one_reports_its_own_peak():
    ballast = b"\x01" * (600 << 20)  # written, so resident: this process's peak is now past 600 MiB
    assert peak_rss_bytes() >= 600 << 20
    child = int(
        subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    )
    del ballast
    assert child < 300 << 20, f"the child says its peak was {child / 2**20:.0f} MiB"
