"""The phi-accrual detector (odmoe/transport/suspicion.py): late beats on a lossy, jittery link are
never a loss, a black hole always is within 1.5 s, and the bound follows the gaps it has seen.

Links are simulated: beats asked every 0.1 s, each lost with probability `loss` (either way) and
delayed by a random share of `jitter_s`, arrival times drawn from a seeded RNG that hypothesis picks."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odmoe.transport.suspicion import Suspicion, SuspicionSettings

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

INTERVAL = 0.1


def arrivals(seed: int, loss: float, jitter_s: float, seconds: float) -> list[float]:
    """When the answers to beats asked every INTERVAL arrive over a link losing `loss` of packets
    each way and delaying each by up to `jitter_s` (in arrival order)."""
    rng = random.Random(seed)
    times = []
    for i in range(int(seconds / INTERVAL)):
        if rng.random() < loss or rng.random() < loss:  # the ask, or the answer, is lost
            continue
        times.append(i * INTERVAL + 0.0005 + rng.random() * jitter_s + rng.random() * jitter_s)
    return sorted(times)


def fed(times: list[float]) -> Suspicion:
    s = Suspicion(SuspicionSettings(interval_s=INTERVAL))
    for t in times:
        s.beat(t)
    return s


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    loss=st.floats(0.0, 0.05),
    jitter_s=st.floats(0.0, 0.05),
)
def test_a_lossy_jittery_link_is_never_suspected_for_ten_minutes(seed, loss, jitter_s):
    s = Suspicion(SuspicionSettings(interval_s=INTERVAL))
    for t in arrivals(seed, loss, jitter_s, 600):
        # just before each answer arrives: the longest silence the link made so far
        assert not s.lost(t - 1e-6), f"lost at {t:.2f}s: phi {s.phi(t):.1f}, bound {s.bound_s:.2f}s"
        s.beat(t)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    loss=st.floats(0.0, 0.05),
    jitter_s=st.floats(0.0, 0.05),
    seconds=st.floats(0.5, 120),
)
def test_a_black_hole_is_declared_within_1_5_s_whatever_came_before(seed, loss, jitter_s, seconds):
    s = fed(arrivals(seed, loss, jitter_s, seconds))
    hole = s.last  # nothing arrives after this
    assert hole is not None
    deadline = s.deadline()
    assert deadline is not None and deadline - hole <= 1.5
    assert s.lost(deadline + 1e-9) and not s.lost(deadline - 1e-3)
    assert s.lost(hole + 1.5)


def test_nothing_is_suspected_before_the_first_beat_and_a_beat_clears_suspicion():
    s = Suspicion()
    assert s.phi(1e6) == 0 and not s.lost(1e6) and s.deadline() is None
    s.beat(10.0)
    assert s.lost(20.0)
    s.beat(20.0)
    assert not s.lost(20.1)


@settings(max_examples=50, deadline=None)
@given(gaps=st.lists(st.floats(0.01, 2.0), min_size=1, max_size=150), later=st.floats(0, 5))
def test_suspicion_only_grows_with_silence(gaps, later):
    s = Suspicion()
    t = 0.0
    for g in [0.0, *gaps]:
        t += g
        s.beat(t)
    assert s.phi(t + later) <= s.phi(t + later + 0.01)


def test_the_bound_follows_the_jitter_the_link_has_shown():
    clean = fed(arrivals(1, 0.0, 0.0, 30))
    wild = fed(arrivals(1, 0.0, 0.4, 30))  # gaps spread over 0.1 +- 0.4 s: deviation above the floor
    assert clean.bound_s == pytest.approx(INTERVAL + 0.5 + 5.61 * 0.05, abs=0.01)
    assert wild.bound_s > clean.bound_s + 0.2
    # the same silence: fatal after a clean history, ordinary after a wild one
    silence = clean.bound_s + 0.1
    assert clean.lost(clean.last + silence) and not wild.lost(wild.last + silence)


def test_beats_out_of_order_are_ignored():
    s = fed([0.0, 0.1, 0.2])
    gaps = list(s.gaps)
    s.beat(0.15)
    assert list(s.gaps) == gaps and s.last == 0.2


@pytest.mark.parametrize(
    "bad",
    [
        {"interval_s": 0},
        {"min_std_s": 0},
        {"acceptable_pause_s": -1},
        {"threshold": 0},
        {"threshold": 16},
        {"window": 1},
    ],
)
def test_settings_that_cannot_work_are_refused(bad):
    with pytest.raises(ValueError):
        Suspicion(SuspicionSettings(**bad))


@pytest.mark.parametrize(
    "words,msg",
    [
        (["failover.beat_interval_s=-1"], "beat_interval_s"),
        (["failover.suspicion_threshold=20"], "suspicion_threshold"),
        (["failover.beat_min_std_s=0"], "beat_min_std_s"),
    ],
)
def test_the_launcher_refuses_beats_that_cannot_work(words, msg):
    from odmoe.launch.settings import compose

    with pytest.raises(ValueError, match=msg):
        compose(words)
    compose(["failover.beat_interval_s=0", *words[1:]])  # beats off: nothing else is checked
