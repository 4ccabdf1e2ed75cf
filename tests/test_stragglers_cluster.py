"""A straggler on a real cluster: its loads steered to its group's other worker, tokens unchanged,
and work given back once it is fast again (failover.steer_stragglers, odmoe.main.stragglers); one
slow on its network link (a relay holding its traffic) judged so by main's round trips."""

from __future__ import annotations

import pytest

from odmoe import LocalCluster
from odmoe.launch.local_cluster import NodePlacement
from odmoe.tools.link_relay import Relay
from tests.test_cluster_fidelity import PROMPTS, reference

pytestmark = pytest.mark.integration
NEW_TOKENS = 40


def _link(latency_ms: float) -> list[str]:
    return ["lab=on", f"emulation.link.latency_ms={latency_ms:g}"]


def _experts(done: dict, worker: str) -> int:
    """Experts the worker computed for the request (none: every call of its a late re-send overtook,
    odmoe.main.late_calls, so it is not in the stats' per_worker)."""
    return done.get(worker, {}).get("experts", 0)


def slow_worker3(name: str) -> NodePlacement:
    """worker3's loads 20x slower than the others' (their link: _link(2))."""
    return NodePlacement(words=_link(40) if name == "worker3" else [])


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_a_slow_worker_is_steered_around_and_given_work_again_once_fast(model_dirs, reap_children):
    """worker3's expert loads take 40 ms, its peer's 2 ms: once 8 of its answers show it (the tiny
    model's 2 layers: one of group 1's per iteration), group 1's decode experts go to worker2 but
    every 4th iteration (a probe), tokens equal to the reference. Then worker3 is restarted on a
    link as fast as the others': its probes show it, and it is given its share again."""
    path = model_dirs["mixtral"]
    want, _ = reference(path, PROMPTS[0], new_tokens=NEW_TOKENS)
    words = ["worker.cache=0", "failover.straggler_after=8", "failover.straggler_probe_every=4", *_link(2)]

    with LocalCluster(path, workers=4, group_size=2, overrides=words, place=slow_worker3) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        assert got.token_ids == want
        stats, done = got.stats["stragglers"], got.stats["per_worker"]
        assert stats["slow"] == [3], stats
        # worker2 took nearly all of group 1's experts: its own, and worker3's after the first 8
        # iterations but on probes (~1 in 4)
        assert _experts(done, "worker3") < 0.5 * done["worker2"]["experts"], done
        times = stats["seconds_per_expert"]  # it is the slow one (its answers, or how long main
        assert times["worker3"] > 3 * times["worker2"], stats  # waited before a late re-send won)

        cluster.place = lambda name: NodePlacement()  # every worker on the 2 ms link now
        cluster.restart("worker3")
        again = cluster.client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        assert again.token_ids == want
        stats, done = again.stats["stragglers"], again.stats["per_worker"]
        # still a straggler when the request began; two fine probes (iterations 4 and 8) and it is back
        assert stats["slow"] == [] and stats["changes"] == 2, stats
        assert done["worker3"]["experts"] > 0.6 * done["worker2"]["experts"], done


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_a_slow_workers_homes_move_to_its_peer_with_caches_and_come_back_once_fast(model_dirs, reap_children):
    """Worker caches on (homes): each worker keeps 2 of the 8 experts of its group's 2 layers it is
    home for. worker3's loads take 40 ms, its peer's 2 ms: once 8 of its loaded answers show it,
    main weighs moving its homes (the reloads against its measured extra seconds a token over the
    horizon), moves them to worker2 (the workers told, so preloads and caches agree), and the
    tokens equal the reference. Restarted on a fast link, its probes show it and its homes come back."""
    path = model_dirs["mixtral"]
    want, _ = reference(path, PROMPTS[0], new_tokens=NEW_TOKENS)
    words = [
        "worker.cache=192KiB",  # 2 experts of 96 KiB
        "failover.straggler_after=8",
        "failover.straggler_probe_every=4",
        *_link(2),
    ]

    with LocalCluster(path, workers=4, group_size=2, overrides=words, place=slow_worker3) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        assert got.token_ids == want
        stats, done = got.stats["stragglers"], got.stats["per_worker"]
        assert stats["slow"] == [3], stats
        moves = [m for m in stats["home_moves"] if m["worker"] == 3]
        assert moves and moves[0]["moved"] and moves[0]["reloads"] > 0, stats
        assert moves[0]["saving_s"] > moves[0]["move_s"] > 0, stats
        assert moves[0]["room"] == 0, stats  # 20x slower: a twentieth of a room of 2
        assert _experts(done, "worker3") < 0.5 * done["worker2"]["experts"], done

        cluster.place = lambda name: NodePlacement()  # every worker on the 2 ms link now
        cluster.restart("worker3")
        again = cluster.client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
        assert again.token_ids == want
        stats, done = again.stats["stragglers"], again.stats["per_worker"]
        assert stats["slow"] == [], stats  # its probes were fine: its homes are back
        assert done["worker3"]["experts"] > 0.3 * done["worker2"]["experts"], done


@pytest.mark.extended  # a multi-process test beyond the default run's time budget: CI runs it
def test_a_worker_on_a_slow_network_link_is_a_straggler_and_judged_afresh_once_back(
    model_dirs, reap_children
):
    """worker3's loads are as fast as its peer's, but main reaches it through a relay holding each
    chunk 20 ms (a Wi-Fi box): main's round trips less the worker's own time show it, and group 1's
    decode experts go to worker2. No probes (straggler_probe_every=1000): when worker3 is restarted
    (it announces itself, so main reaches it directly) only its loss and return clear its verdict,
    and it is given its share again at once. Tokens equal the reference throughout."""
    path = model_dirs["mixtral"]
    want, _ = reference(path, PROMPTS[0], new_tokens=NEW_TOKENS)
    words = ["worker.cache=0", "failover.straggler_after=8", "failover.straggler_probe_every=1000", *_link(2)]
    relays: list[Relay] = []

    def through(name: str, address: str) -> str:
        if name != "worker3":
            return address
        relay = Relay(address)
        relay.set(delay_s=0.02)
        relays.append(relay)
        return relay.address

    try:
        with LocalCluster(path, workers=4, group_size=2, overrides=words, through=through) as cluster:
            got = cluster.client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
            assert got.token_ids == want
            stats, done = got.stats["stragglers"], got.stats["per_worker"]
            assert stats["slow"] == [3], stats
            assert _experts(done, "worker3") < 0.5 * done["worker2"]["experts"], done
            # its loads were as quick as its peer's: the wire made it the straggler
            if "worker3" in done:  # answers late re-sends overtook are not its work
                assert done["worker3"]["load_s"] / done["worker3"]["experts"] < 0.01, done

            cluster.restart("worker3")
            again = cluster.client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
            assert again.token_ids == want
            stats, done = again.stats["stragglers"], again.stats["per_worker"]
            assert stats["slow"] == [], stats
            assert done["worker3"]["experts"] > 0.6 * done["worker2"]["experts"], done
    finally:
        for relay in relays:
            relay.close()
