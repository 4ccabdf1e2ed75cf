"""The worker's preload schedule alone (odmoe.worker.preload_schedule): no node, no tensors, no sockets.

`Slots` stands in for DeviceSlots: busy slots as plain values, and the schedule's decisions applied
to them the way the worker node applies them (evict in the order given, load into the first free
slot, tell the schedule where a hedge went and what each load that leaves cost)."""

from dataclasses import dataclass

import pytest

from odmoe.worker.preload_schedule import Load, PreloadSchedule

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

NBYTES = 100  # what every load costs here


@dataclass
class SlotView:
    index: int
    holds: tuple[int, int] | None = None
    tag: tuple[str, int] | None = None
    cached: bool = False


class Slots:
    def __init__(self, n: int):
        self.all = [SlotView(i) for i in range(n)]

    @property
    def free(self) -> int:
        return sum(s.holds is None for s in self.all)

    def held(self) -> list[SlotView]:
        return [s for s in self.all if s.holds is not None and not s.cached]

    def cached(self) -> list[SlotView]:
        return [s for s in self.all if s.cached]

    def load(self, key, tag) -> int:
        slot = next(s for s in self.all if s.holds is None)
        slot.holds, slot.tag = key, tag
        return slot.index

    def contents(self) -> set:
        return {(s.holds, s.tag) for s in self.all if s.holds is not None}


class Worker:
    """The schedule and its slots, applied to as the worker (odmoe/worker/executor.py) does."""

    def __init__(self, slots: int = 2, stored=None, for_cache: bool = False):
        self.slots = Slots(slots)
        stored = stored if stored is not None else {(layer, e) for layer in range(4) for e in range(8)}
        self.schedule = PreloadSchedule(stored, for_cache=for_cache)

    def give_back(self, indices: list[int], used: bool = False) -> None:
        for i in indices:
            self.schedule.left(i, used, NBYTES)
            slot = self.slots.all[i]
            slot.holds, slot.tag, slot.cached = None, None, False

    def predicted(self, request, position, mine, hedged=()) -> None:
        share = (set(mine), set(hedged))
        self.give_back(self.schedule.predicted(request, position, share, self.slots))

    def preload_next(self) -> Load | None:
        load = self.schedule.next_preload(self.slots)
        if load is not None:
            if load.evict is not None:
                self.give_back([load.evict])
            index = self.slots.load(load.key, load.tag)
            if load.hedge:
                self.schedule.hedge_loaded(index)
        return load

    def preload_all(self) -> list[tuple]:
        """Every preload the schedule makes while it can: (key, iteration, hedge) in order."""
        order = []
        while self.schedule.can_preload(self.slots):
            load = self.preload_next()
            if load is not None:
                order.append((load.key, load.tag[1], load.hedge))
        return order

    def serving(self, request, position, expert) -> bool:
        evicted, visit = self.schedule.serving(request, position, expert, self.slots)
        self.give_back(evicted)
        return visit

    def finish(self, request, position) -> None:
        self.give_back(self.schedule.finish(request, position, self.slots))


def test_confident_preloads_go_by_position_and_a_hedge_ranks_one_layer_later():
    w = Worker(slots=8)
    w.predicted("r", (2, 0), [1])  # iterations ahead (a speculative shadow)
    w.predicted("r", (1, 1), [2])
    w.predicted("r", (1, 0), [3], hedged=[6, 3])  # 3 both predicted and hedged: a confident preload
    assert w.schedule.preloads[0] == (1, 0, 3) and w.schedule.hedge_queue == [(1, 0, 6)]
    # the hedge competes as (1, 1): after layer 1's confident preload (a tie goes to it), before
    # iteration 2's, whose slot would only sit waiting
    assert w.preload_all() == [((0, 3), 1, False), ((1, 2), 1, False), ((0, 6), 1, True), ((0, 1), 2, False)]
    assert w.schedule.hedge_counts == [1, 0, 0] and len(w.schedule.hedged) == 1


def test_a_hedge_loads_only_into_a_free_slot_and_never_before_a_confident_preload():
    w = Worker(slots=2)
    w.predicted("r", (1, 0), [3], hedged=[6])
    w.predicted("r", (2, 0), [1])
    assert w.preload_all() == [((0, 3), 1, False), ((0, 6), 1, True)]
    assert not w.schedule.can_preload(w.slots)  # iteration 2's preload waits: it does not evict the hedge
    assert w.schedule.preloads == [(2, 0, 1)]


def test_a_confident_preload_needed_sooner_takes_the_latest_hedge_s_slot():
    w = Worker(slots=2)
    w.predicted("r", (1, 2), [3], hedged=[6])
    w.preload_all()
    assert w.slots.contents() == {((2, 3), ("r", 1)), ((2, 6), ("r", 1))}
    w.predicted("r", (1, 0), [1])  # a rolled-back shadow, say: needed before the hedge's layer
    assert w.schedule.can_preload(w.slots)
    hedge_slot = next(iter(w.schedule.hedged))
    load = w.schedule.next_preload(w.slots)
    assert load == Load((0, 1), ("r", 1), hedge=False, evict=hedge_slot)
    w.give_back([load.evict])
    w.slots.load(load.key, load.tag)
    assert w.slots.contents() == {((2, 3), ("r", 1)), ((0, 1), ("r", 1))}
    assert w.schedule.hedge_counts == [1, 0, NBYTES]  # loaded, unused, its bytes counted


def test_a_hedge_ranked_before_a_confident_preload_keeps_its_slot():
    w = Worker(slots=2)
    w.predicted("r", (1, 0), [3], hedged=[6])  # the hedge ranks as (1, 1)
    w.preload_all()
    w.predicted("r", (1, 1), [2])  # a tie with the hedge's rank: it waits
    assert not w.schedule.can_preload(w.slots)


def test_a_later_prediction_for_the_same_step_drops_what_only_the_earlier_asked_for():
    w = Worker(slots=2, for_cache=True)
    w.predicted("r", (1, 0), [3, 5], hedged=[7])
    w.preload_next()  # expert 3 loading
    w.predicted("r", (1, 2), [0])
    w.predicted("r", (1, 0), [4, 5])  # a speculative shadow rolled back and predicted again
    assert sorted(w.schedule.preloads) == [(1, 0, 4), (1, 0, 5), (1, 2, 0)]
    assert w.schedule.hedge_queue == []  # 7 was only the old prediction's hedge
    assert w.slots.contents() == set()  # 3 was loaded for it: evicted
    assert w.schedule.upcoming == {(0, 4): (1, 0), (0, 5): (1, 0), (2, 0): (1, 2)}
    assert w.schedule.predicted_through == {0: 1, 2: 1}


def test_finishing_a_layer_drops_it_and_every_earlier_position():
    w = Worker(slots=2, for_cache=True)
    w.predicted("r", (1, 0), [3])
    w.predicted("r", (1, 2), [4], hedged=[6])
    w.predicted("r", (2, 0), [1])
    w.preload_all()  # (1, 0) 3 and (1, 2) 4 loaded
    w.finish("r", (1, 0))
    assert w.schedule.done == (1, 0)
    assert w.slots.contents() == {((2, 4), ("r", 1))}
    assert sorted(w.schedule.preloads) == [(2, 0, 1)] and w.schedule.hedge_queue == [(1, 2, 6)]
    assert set(w.schedule.upcoming) == {(2, 4), (2, 6), (0, 1)}
    w.finish("r", (1, 2))
    assert w.slots.contents() == set() and w.schedule.hedge_queue == []
    w.finish("r", (1, 1))  # done only moves forward
    assert w.schedule.done == (1, 2)
    w.predicted("r", (1, 2), [5])  # too late to help
    assert w.schedule.preloads == [(2, 0, 1)]


def test_asking_for_a_layer_ends_every_earlier_one_and_begins_a_visit_once():
    w = Worker(slots=2)
    w.predicted("r", (1, 0), [3, 5])
    w.predicted("r", (2, 0), [1, 2])
    assert w.serving("r", (1, 2), 6)  # main is at iteration 1, layer 2: layer 0 of iteration 1 is over
    assert not w.serving("r", (1, 2), 7)  # the same visit
    assert sorted(w.schedule.preloads) == [(2, 0, 1), (2, 0, 2)]
    assert w.schedule.done == (1, 1) and w.schedule.at == (1, 2) and w.schedule.past == (1, 2)


def test_a_served_position_is_never_queued_again():
    w = Worker(slots=2)
    w.predicted("r", (1, 0), [3, 5])
    w.serving("r", (1, 0), 3)  # main got there before the loader: it loads 3 on demand
    assert w.schedule.preloads == [(1, 0, 5)]  # the queued preload would load it a second time
    w.predicted("r", (1, 0), [3, 5])  # the same prediction, arriving late
    assert w.schedule.preloads == [(1, 0, 5)]


def test_what_is_loaded_cached_or_not_stored_is_not_queued():
    w = Worker(slots=3, stored={(0, 3), (0, 5), (0, 6)})
    w.give_back(w.schedule.switch_request("r", w.slots))  # main's decode stream is "r"'s
    w.slots.all[0].holds, w.slots.all[0].tag = (0, 3), ("r", 1)  # loaded for this request's (1, 0)
    w.slots.all[1].holds, w.slots.all[1].cached = (0, 5), True  # cached: any request finds it
    w.predicted("r", (1, 0), [3, 5, 6, 7])  # 7: not this worker's to load
    assert w.schedule.preloads == [(1, 0, 6)]
    w.slots.all[2].holds, w.slots.all[2].cached = (0, 6), True  # cached since it was queued
    assert w.schedule.can_preload(w.slots) is False  # no free slot, no hedge to take
    w.slots.all[0].holds, w.slots.all[0].tag = None, None
    assert w.preload_next() is None and w.schedule.preloads == []


def test_a_new_request_resets_the_schedule_but_keeps_prefill_slots():
    w = Worker(slots=3, for_cache=True)
    w.predicted("a", (1, 0), [3], hedged=[6])
    w.preload_all()  # 3 and the hedge 6 for "a"
    w.serving("a", (1, 0), 3)
    w.slots.load((2, 1), ("b", 0))  # main prefills "b" (a prefill call is no decode stream's)
    w.predicted("b", (1, 2), [4])
    s = w.schedule
    assert s.request == "b" and s.done == (-1, -1) and s.at == (-1, -1)
    assert s.preloads == [(1, 2, 4)] and s.served == set() and s.upcoming == {(2, 4): (1, 2)}
    assert w.slots.contents() == {((2, 1), ("b", 0))}  # its other parts may still be on their way
    assert s.hedge_counts == [0, 0, NBYTES]  # the new request's counts (the old hedge's bytes land here)
    assert s.hedges_of("b") == [0, 0, NBYTES] and s.hedges_of("a") == []
    w.give_back(s.switch_request("", w.slots))  # the request ended: nothing is wanted
    assert s.request == "" and s.preloads == [] and w.slots.contents() == {((2, 1), ("b", 0))}


def test_a_layer_no_live_worker_holds_only_switches_the_request():
    w = Worker(slots=2)
    w.predicted("a", (1, 0), [3])
    w.give_back(w.schedule.predicted("b", (1, 0), None, w.slots))
    assert w.schedule.request == "b" and w.schedule.preloads == []


def test_making_room_gives_back_a_hedge_first_else_the_latest_needed_preload_requeued():
    w = Worker(slots=3)
    assert w.schedule.make_room(w.slots) is None  # a slot is free
    w.predicted("r", (1, 0), [3], hedged=[6])
    w.predicted("r", (1, 2), [4])
    w.preload_all()  # 3, 4, the hedge 6
    hedge = next(iter(w.schedule.hedged))
    assert w.schedule.make_room(w.slots) == hedge
    w.give_back([hedge])
    assert w.schedule.hedge_counts == [1, 0, NBYTES]
    w.slots.load((1, 1), ("r", 1))  # a compute's load
    latest = next(s.index for s in w.slots.all if s.holds == (2, 4))
    assert w.schedule.make_room(w.slots) == latest  # (1, 2) is needed last
    assert w.schedule.preloads == [(1, 2, 4)]  # loaded again when a slot frees


def test_making_room_with_nothing_to_give_back_fails():
    # ResidentExperts: no free slot and none held; the compute reports the error
    with pytest.raises(ValueError):
        PreloadSchedule(set()).make_room(Slots(0))


def test_a_used_hedge_is_counted_used():
    w = Worker(slots=2)
    w.predicted("r", (1, 0), [3], hedged=[6])
    w.preload_all()
    hedge = next(iter(w.schedule.hedged))
    w.give_back([hedge], used=True)  # main asked for it, and it was computed
    assert w.schedule.hedge_counts == [1, 1, NBYTES] and not w.schedule.hedged
    w.schedule.left(hedge, True, NBYTES)  # a slot that holds no hedge is not counted
    assert w.schedule.hedge_counts == [1, 1, NBYTES]
