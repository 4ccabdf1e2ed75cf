"""benchmarks/suite_kit.py: the table every suite prints reads as the hand-formatted lines it replaced,
and the suites' few statistics."""

from __future__ import annotations

import pytest

from odmoe_bench.suite_kit import Table, alternated, change_pct, median, percentile

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_a_table_prints_what_the_hand_formatted_lines_did(capsys):
    """Suite ablation's header and row as they were written before the kit (one f-string each)."""
    table = Table(
        "case:<26:case",
        "decode tok/s:13.1f:decode_tokens_per_s.mean",
        "recall:8.3f:recall",
        "reloads/tok:12.2f:reloads_per_token",
    )
    table.header()
    row = {"decode_tokens_per_s": {"mean": 45.123}, "recall": None, "reloads_per_token": 4.2857}
    table.record(row, case="1 token + KV alignment")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{'case':<26}{'decode tok/s':>13}{'recall':>8}{'reloads/tok':>12}"
    assert out[1] == f"{'1 token + KV alignment':<26}{45.123:13.1f}{'-':>8}{4.2857:12.2f}"


def test_a_cell_none_prints_the_tables_word_and_a_bool_its_name():
    table = Table("node:<6", "equal:>6", "s:6.2f", sep=" ", none="n/a")
    assert table.line("main", True, None) == f"{'main':<6} {'True':>6} {'n/a':>6}"
    assert table.line("w1", False, 0.5) == f"{'w1':<6} {'False':>6} {0.5:6.2f}"
    assert Table("x:8.1%").line(0.123) == "   12.3%"  # a ratio as a percent, as compression printed it


def test_the_statistics_skip_what_is_missing():
    assert median([3.0, None, 1.0, 2.0]) == 2.0 and median([None]) is None
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0 and percentile([1.0, 2.0], 0.99) == 2.0
    assert percentile([], 0.5) is None
    assert change_pct(110.0, 100.0) == pytest.approx(10.0) and change_pct(None, 1.0) is None


def test_alternated_rounds_reverse_the_order_so_neither_side_always_runs_first():
    assert [alternated(r, ("on", "off")) for r in range(3)] == [("on", "off"), ("off", "on"), ("on", "off")]
