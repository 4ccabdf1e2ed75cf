"""A node's reported peak memory is its own (odmoe.tools.memory.peak_rss_bytes), not that of the
process that spawned it: Linux carries getrusage's ru_maxrss across exec, so a node started by a
large process (a benchmark holding the reference model, a test runner) reported the parent's peak."""

from __future__ import annotations

import subprocess
import sys

import pytest

from odmoe.tools.memory import PeakEvery, peak_rss_bytes

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


def test_an_answers_peak_is_read_at_most_every_interval():
    """Every worker answer carries the peak: reading /proc each time cost 6 % of a decode."""
    reads, now = [], [0.0]

    def read() -> int:
        reads.append(now[0])
        return len(reads) * 100

    peak = PeakEvery(every_s=0.1, read=read, clock=lambda: now[0])
    assert [peak(), peak(), peak()] == [100, 100, 100] and reads == [0.0]
    now[0] = 0.05
    assert peak() == 100 and len(reads) == 1
    now[0] = 0.1
    assert peak() == 200 and reads == [0.0, 0.1]
