"""Fault injection fires once, at or past the configured point of the node's n-th request."""

import pytest

from odmoe.config import FaultConfig
from odmoe.tools.faults import FaultTrigger

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_fires_only_for_its_node():
    assert not FaultTrigger(FaultConfig(node="worker1"), "worker0").matches("r", 5, 5)
    assert not FaultTrigger(FaultConfig(node=""), "worker0").matches("r", 5, 5)


def test_at_or_past_the_point_of_the_nth_request():
    t = FaultTrigger(FaultConfig(node="main", request=2, iteration=3, layer=1), "main")
    assert not t.matches("a", 9, 9)  # first request
    assert not t.matches("b", 3, 0)
    assert t.matches("b", 3, 1)
    assert t.matches("b", 4, 0)  # a point the node reached later: still fires
    assert not t.matches("c", 9, 9)  # the third request


def test_layer_minus_one_is_the_first_layer_of_the_iteration_and_parts_count():
    t = FaultTrigger(FaultConfig(node="worker0", iteration=0, part=2), "worker0")
    assert not t.matches("r", 0, 0, part=1)
    assert t.matches("r", 0, 0, part=2)


def test_records_before_acting(tmp_path, monkeypatch):
    record = tmp_path / "faults.jsonl"
    t = FaultTrigger(FaultConfig(node="shadow", action="stop", record=str(record)), "shadow")
    signals = []
    monkeypatch.setattr("os.kill", lambda pid, sig: signals.append(sig))
    t.at("r", 1, 0)
    t.at("r", 2, 0)  # fires once
    assert len(record.read_text().splitlines()) == 1 and len(signals) == 1
