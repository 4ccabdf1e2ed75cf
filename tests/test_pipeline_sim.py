import pytest

from odmoe.tools.pipeline_sim import PipelineParams, simulate

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

# A shadow far ahead: every prediction is in before its group could use it.
BASE = dict(layers=32, groups=4, t_main_s=1e-3, t_compute_s=2e-3, t_net_s=0.5e-3, shadow_offset_s=-1.0)


def test_no_stall_when_the_load_fits_eq1_window():
    p = PipelineParams(**BASE, t_load_s=0.0)
    window = p.eq1_window_s()
    assert window == pytest.approx(3 * (1e-3 + 3e-3) + 1e-3)
    one_slot = dict(BASE, slots=1)  # Eq. 1 is the window of a worker that loads only after evicting
    fits = simulate(PipelineParams(**one_slot, t_load_s=0.95 * window))
    assert fits.stall_s_per_token == pytest.approx(0.0, abs=1e-9)
    too_slow = simulate(PipelineParams(**one_slot, t_load_s=1.2 * window))
    assert too_slow.stall_s_per_token > 0
    assert too_slow.tokens_per_s < fits.tokens_per_s
    # a second slot overlaps loading with computing: the same load no longer stalls
    two_slots = simulate(PipelineParams(**BASE, t_load_s=1.2 * window))
    assert two_slots.stall_s_per_token == pytest.approx(0.0, abs=1e-9)


def test_without_stalls_a_token_costs_the_layers_critical_path():
    r = simulate(PipelineParams(**BASE, t_load_s=0.0, t_head_s=2e-3))
    assert r.seconds_per_token == pytest.approx(32 * (1e-3 + 2e-3 + 2 * 0.5e-3) + 2e-3)


def test_misses_and_fewer_groups_cost_speed():
    load = dict(BASE, t_load_s=8e-3)
    perfect = simulate(PipelineParams(**load, recall=1.0))
    half = simulate(PipelineParams(**load, recall=0.5))
    none = simulate(PipelineParams(**load, recall=0.0))
    assert perfect.tokens_per_s > half.tokens_per_s > none.tokens_per_s
    one_group = simulate(PipelineParams(**dict(load, groups=1), recall=1.0))
    assert one_group.tokens_per_s < perfect.tokens_per_s


def test_late_predictions_stall_even_at_full_recall():
    load = dict(BASE, t_load_s=8e-3)
    early = simulate(PipelineParams(**load))
    late = simulate(PipelineParams(**dict(load, shadow_offset_s=2e-3, t_shadow_layer_s=5e-3)))
    assert late.stall_s_per_token > early.stall_s_per_token


def test_a_cache_hit_costs_no_load():
    slow = dict(BASE, t_load_s=30e-3)  # far beyond the window: every load stalls
    loads_free = simulate(PipelineParams(**dict(slow, t_load_s=0.0)))
    everything_cached = simulate(PipelineParams(**slow, cache_hit=1.0))
    assert everything_cached.seconds_per_token == pytest.approx(loads_free.seconds_per_token)
    speeds = [simulate(PipelineParams(**slow, cache_hit=h)).tokens_per_s for h in (0.0, 0.35, 0.7, 1.0)]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(speeds, speeds[1:], strict=False))
    assert speeds[0] < 0.6 * speeds[-1]
