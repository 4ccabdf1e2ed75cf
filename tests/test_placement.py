import pytest

from odmoe.placement import Topology


def test_groups_and_layers_round_robin():
    topo = Topology(workers=4, group_size=2)
    assert topo.groups == 2
    assert [topo.group_of_layer(layer) for layer in range(5)] == [0, 1, 0, 1, 0]
    assert topo.workers_of_group(1) == [2, 3]
    assert topo.layers_of_worker(3, [0, 1, 2, 3]) == [1, 3]


def test_decode_placement_one_expert_per_group_member():
    topo = Topology(workers=4, group_size=2)
    assert topo.decode_placement(layer=1, experts=[7, 2]) == {2: 2, 7: 3}
    # more experts than members: dealt round-robin, deterministic
    assert topo.decode_placement(layer=0, experts=[5, 1, 3]) == {1: 0, 3: 1, 5: 0}


def test_prefill_spreads_over_all_workers():
    assert Topology(workers=3, group_size=1).prefill_placement([0, 1, 2, 3, 4]) == {
        0: 0,
        1: 1,
        2: 2,
        3: 0,
        4: 1,
    }


@pytest.mark.parametrize(
    "workers,group_size,msg", [(3, 2, "divisible"), (0, 1, "at least 1"), (2, 0, "at least 1")]
)
def test_bad_topologies(workers, group_size, msg):
    with pytest.raises(ValueError, match=msg):
        Topology(workers, group_size)


def test_repair_placement_keeps_hits_and_reuses_wrongly_loaded_workers():
    topo = Topology(workers=4, group_size=2)
    # layer 1 -> group 1 (workers 2, 3); predicted [3, 5] -> 3 on w2, 5 on w3
    assert topo.repair_placement(1, predicted=[3, 5], activated=[3, 5]) == {3: 2, 5: 3}
    assert topo.repair_placement(1, predicted=[3, 5], activated=[5, 6]) == {5: 3, 6: 2}
    assert topo.repair_placement(1, predicted=[], activated=[0, 6]) == {0: 2, 6: 3}
