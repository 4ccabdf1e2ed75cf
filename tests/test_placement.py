import pytest

from odmoe.placement import Topology, holding_groups, prediction_topics


def test_groups_and_layers_round_robin():
    topo = Topology(workers=4, group_size=2)
    assert topo.groups == 2
    assert [topo.group_of_layer(layer) for layer in range(5)] == [0, 1, 0, 1, 0]
    assert topo.workers_of_group(1) == [2, 3]


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


# -- placement over live workers (failover) -----------------------------------------------------
from odmoe.placement import LayerUnavailable  # noqa: E402

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_a_lost_group_member_leaves_the_layer_to_the_others():
    topo = Topology(workers=4, group_size=2)
    assert topo.decode_placement(layer=1, experts=[7, 2], live={0, 1, 3}) == {2: 3, 7: 3}
    # every worker stores every layer by default: a whole lost group falls to the next group
    assert topo.decode_placement(layer=1, experts=[7, 2], live={0, 1}) == {2: 0, 7: 1}
    assert topo.serving_group(1, live={1}) == [1]


def test_only_own_layers_with_one_replica_cannot_survive_a_lost_group():
    topo = Topology(workers=4, group_size=2, replicas=1)
    assert topo.stored_layers(2, [0, 1, 2, 3]) == [1, 3]
    assert topo.decode_placement(layer=1, experts=[7, 2], live={0, 1, 2}) == {2: 2, 7: 2}
    with pytest.raises(LayerUnavailable, match="layer 1"):
        topo.decode_placement(layer=1, experts=[7, 2], live={0, 1})


def test_two_replicas_survive_a_lost_group():
    topo = Topology(workers=6, group_size=2, replicas=2)  # groups 0, 1, 2
    assert holding_groups(topo, 1) == [1, 2]
    assert topo.stored_layers(4, [0, 1, 2, 3]) == [1, 2]  # worker 4 is group 2: layers 1 (backup) and 2
    assert topo.decode_placement(layer=1, experts=[3, 5], live={0, 1, 4, 5}) == {3: 4, 5: 5}
    assert prediction_topics(topo, 4) == [1, 2]
    with pytest.raises(LayerUnavailable):
        topo.decode_placement(layer=1, experts=[3], live={0, 1})
    with pytest.raises(ValueError, match="replicas"):
        Topology(workers=4, group_size=2, replicas=3)


def test_prefill_and_repair_use_only_live_workers():
    topo = Topology(workers=4, group_size=2)
    assert topo.prefill_placement(dict.fromkeys(range(5), 1), workers=topo.holders(0, {0, 2, 3})) == {
        0: 0,
        1: 2,
        2: 3,
        3: 0,
        4: 2,
    }
    # predicted experts were dealt over the live members only, so hits stay hits
    assert topo.repair_placement(1, predicted=[3, 5], activated=[3, 6], live={2}) == {3: 2, 6: 2}


def test_calls_of_a_lost_worker_are_replaced_over_live_holders():
    topo = Topology(workers=4, group_size=2)
    # decode: the layer's serving group; prefill (spread): every live holder
    assert topo.replace_lost(1, {2: 3, 7: 3}, live={0, 1, 2}, spread=False) == {2: 2, 7: 2}
    assert topo.replace_lost(1, {2: 3, 7: 3}, live={0, 1, 2}, spread=True) == {2: 2, 7: 1}
    with pytest.raises(LayerUnavailable):
        Topology(4, 2, replicas=1).replace_lost(1, {2: 3}, live={0, 1}, spread=False)


def test_only_unanswered_calls_of_lost_workers_are_resent():
    from odmoe.main.exchange_records import BatchCall
    from odmoe.main.worker_calls import owed_experts

    answer = (None, [])
    calls = [
        BatchCall(0, [1]),
        BatchCall(1, [2], answers={0: answer}),  # answered before its worker was lost
        BatchCall(1, [3], expected=2, answers={0: answer}),  # half answered: re-sent whole
        BatchCall(2, [4, 6]),  # a decode call: both its experts
        BatchCall(-1, [5]),  # abandoned already (re-sent elsewhere)
    ]
    assert owed_experts(calls, lost={1}) == {3: 1}
    assert owed_experts(calls, lost={0, 2}) == {1: 0, 4: 2, 6: 2}
    calls.append(BatchCall(3, [1], answers={0: answer}, again=True))  # a late call's re-send answered
    assert owed_experts(calls, lost={0, 2}) == {4: 2, 6: 2}


def test_groups_take_a_model_s_moe_layers_by_rank():
    """Llama 4 Maverick: MoE on every other layer. By index, 2 groups would get layers 1, 3, 5, 7 all
    in group 1; by rank among the MoE layers they alternate."""
    topo = Topology(workers=4, group_size=2).for_model([7, 1, 5, 3])
    assert topo.moe_layers == (1, 3, 5, 7)
    assert [topo.group_of_layer(layer) for layer in (1, 3, 5, 7)] == [0, 1, 0, 1]
    assert topo.stored_layers(0, [1, 3, 5, 7]) == [1, 3, 5, 7]  # replicas=0: every worker stores all
    own = Topology(workers=4, group_size=2, replicas=1).for_model([1, 3, 5, 7])
    assert own.stored_layers(0, [1, 3, 5, 7]) == [1, 5] and own.stored_layers(2, [1, 3, 5, 7]) == [3, 7]
    # a model whose every layer from 0 on is MoE: rank = index, the same groups as before
    every = Topology(workers=4, group_size=2).for_model([0, 1, 2, 3])
    assert [every.group_of_layer(layer) for layer in range(4)] == [0, 1, 0, 1]


@pytest.mark.integration
@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_interleaved_moe_layers_use_every_group(model_dirs, reap_children):
    """llama4_text (MoE on layers 1 and 3) over 2 groups that store only their own layers: each group
    gets one MoE layer (by index both were group 1's, and group 0's workers could not start)."""
    from odmoe import LocalCluster
    from tests.test_cluster_fidelity import PROMPTS, reference

    path = model_dirs["llama4_text"]
    words = ["worker.only_own_layers=true", "worker.replicas=1"]
    with LocalCluster(path, workers=4, group_size=2, overrides=words) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=12)
    want, _ = reference(path, PROMPTS[0], new_tokens=12)
    assert got.token_ids == want
    assert set(got.stats["per_worker"]) == {"worker0", "worker1", "worker2", "worker3"}


def test_homes_follow_the_cache_rooms():
    """Homes by room (worker.cache): a member with room to spare takes what a smaller peer cannot
    keep; the rest is spread evenly; equal rooms keep e mod n; a lost member's homes go to the rest."""
    base = Topology(workers=4, group_size=2, homes=True).for_model([0, 1, 2, 3], experts=8)
    group0 = [(layer, e) for layer in (0, 2) for e in range(8)]  # 16 experts served by workers 0 and 1

    def count(topo, live=None):
        homes = [topo.home(layer, e, live) for layer, e in group0]
        return [homes.count(w) for w in (0, 1)]

    assert count(base.with_rooms([12, 2, 8, 8])) == [12, 4]  # 2 kept by worker 1, 2 more dealt to it
    assert count(base.with_rooms([16, 1, 0, 0])) == [15, 1]  # room for all: all but worker 1's one
    assert count(base.with_rooms([3, 0, 0, 0])) == [8, 8]  # little room anywhere: even
    # room for all in the group: in proportion to the room (twice the memory, twice the experts)
    assert count(base.with_rooms([16, 8, 0, 0])) == [11, 5]
    assert count(base.with_rooms([40, 16, 0, 0])) == [8, 8]  # each room holds all 16: counted as 16
    even = base.with_rooms([5, 5, 1, 7])  # equal rooms in group 0: e mod n, as without rooms
    assert all(even.home(layer, e) == base.home(layer, e) == e % 2 for layer, e in group0)
    roomy = base.with_rooms([12, 2, 8, 8])
    for layer in (0, 2):  # a layer's experts still interleave over both members
        assert {roomy.home(layer, e) for e in range(8)} == {0, 1}
        assert roomy.decode_placement(layer, list(range(8))) == {e: roomy.home(layer, e) for e in range(8)}
    assert count(roomy, live=[0, 2, 3]) == [16, 0]
    with pytest.raises(ValueError, match="3 cache rooms for 4 workers"):
        base.with_rooms([1, 2, 3])
