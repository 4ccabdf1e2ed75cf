"""A worker's preload schedule: which predicted experts go into its device slots, in what order, and
which loads it gives back. Pure.

Contract: the worker (odmoe.worker.executor's SlotKeeper) tells the schedule what happened and
applies what it decides.
- In: a prediction and this worker's share of it (`predicted`), main asking for an expert
  (`serving`), main done with a layer (`finish`), a request over (`switch_request`), a compute that
  must load with every slot busy (`make_room`), a hedge's slot (`hedge_loaded`), a slot's load
  leaving the just-in-time slots (`left`). The slots' state is read through `SlotsState`: what each
  busy slot holds, for which (request, iteration), whether it is a cached copy.
- Out, as plain data: slot indices to evict, in order; the next preload (`Load`: an expert, its tag,
  whether it is a hedge, the hedge slot to give back for it); whether a decode layer's visit begins
  (the cache counts visits).
- Never: sockets, tensors, devices, loading or evicting (the worker does, in the order given);
  placement (the worker deals a prediction over the live workers and passes in its own share); the
  cache's admission (the worker's). It keeps, with a cache, `upcoming` and `predicted_through`,
  which the cache's eviction reads (odmoe.worker.expert_cache.expected_distance).

Rules (paper §3.1, odmoe.shadow.hedging):
- Preloads go earliest position first, (iteration, layer): the order main visits layers in. Hedges
  wait in a queue of their own and rank `HEDGE_LAG` layers later than their position (`hedge_rank`);
  a hedge loads only into a free slot, and a confident preload that finds none takes the slot of the
  latest-ranked hedge if it outranks it, never the other way round.
- A position main has asked for (served) or is past (done) is never preloaded: it would load twice.
- A second prediction for a position supersedes the first (a speculative shadow rolled back): what
  only the first asked for is dropped, queued or loaded.
- Main asking for a layer ends every earlier one (it visits layers in order and releases a layer
  once all its experts are back); a release ends that layer: preloads for it and earlier go.
- A new request (a new busy period of main's decode stream) drops everything of the old one but
  prefill slots (iteration 0): their other parts may still be on their way.
- A compute that must load with every slot busy takes a hedge's slot, else the latest-needed
  preload's, which is queued again.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Protocol

from odmoe.shadow.hedging import hedge_rank

ExpertKey = tuple[int, int]  # (layer, expert)
Position = tuple[int, int]  # (iteration, layer): the order main visits layers in
Tag = tuple[str, int]  # (request, iteration) a slot was loaded for
Queued = tuple[int, int, int]  # (iteration, layer, expert): a preload waiting for a slot


class SlotState(Protocol):
    """What the schedule reads of one device slot (odmoe.worker.expert_store.Slot is one)."""

    @property
    def index(self) -> int: ...
    @property
    def holds(self) -> ExpertKey | None: ...
    @property
    def tag(self) -> Tag | None: ...
    @property
    def cached(self) -> bool: ...


class SlotsState(Protocol):
    """What the schedule reads of a worker's slots (odmoe.worker.expert_store.DeviceSlots is one)."""

    @property
    def free(self) -> int: ...
    def held(self) -> Sequence[SlotState]: ...  # busy for some use (loading, preloaded, computing)
    def cached(self) -> Sequence[SlotState]: ...  # kept after use (worker.cache): found by any request


@dataclass(frozen=True)
class Load:
    """Preload `key` for `tag` into a free slot, after evicting slot `evict` (a hedge's) if set."""

    key: ExpertKey
    tag: Tag
    hedge: bool
    evict: int | None = None


def _key(slot: SlotState) -> ExpertKey:
    if slot.holds is None:
        raise ValueError(f"slot {slot.index} holds no expert")  # the slots shown are busy ones
    return slot.holds


def _position(slot: SlotState) -> Position:
    """When main needs what a slot holds: (iteration, layer); untagged slots first."""
    return (slot.tag[1] if slot.tag else -1, _key(slot)[0])


def _remaining(held: Sequence[SlotState], evicted: list[int]) -> list[SlotState]:
    """The busy slots once the evictions decided so far are applied."""
    return [s for s in held if s.index not in evicted]


class PreloadSchedule:
    """One worker's preload queues and what it knows of main's progress (see the module's contract)."""

    def __init__(self, stored: Container[ExpertKey], for_cache: bool = False):
        self.stored = stored  # the experts this worker holds: it preloads no other
        self.for_cache = for_cache  # keep `upcoming`/`predicted_through` (worker.cache's eviction)
        self.request = ""  # the request predictions and preloads belong to
        self.done: Position = (-1, -1)  # the last (iteration, layer) main has finished with us
        self.at: Position = (-1, -1)  # the decode layer main last asked this worker for
        self.preloads: list[Queued] = []  # heap
        self.hedge_queue: list[Queued] = []  # heap; low priority: only into a slot nobody needs
        self.hedged: set[int] = set()  # slots (by index) holding a hedge
        self.hedge_counts = [0, 0, 0]  # this request's hedge loads, hedges used, bytes hedges loaded
        self.served: set[Queued] = set()  # (iteration, layer, expert) main already asked for
        # with a cache: the first pending predicted position of each of this worker's experts, and per
        # layer the last iteration a prediction covered (odmoe.worker.expert_cache.next_use)
        self.upcoming: dict[ExpertKey, Position] = {}
        self.predicted_through: dict[int, int] = {}

    @property
    def past(self) -> Position:
        """What main is past: the layer being computed is past for what it computed."""
        return max(self.done, self.at)

    def hedges_of(self, request: str) -> list[int]:
        """`hedge_counts` for a result of `request` ([] for another request's)."""
        return list(self.hedge_counts) if request == self.request else []

    # -- what happened --------------------------------------------------------------------------
    def predicted(
        self,
        request: str,
        position: Position,
        share: tuple[set[int], set[int]] | None,
        slots: SlotsState,
    ) -> list[int]:
        """Queue this worker's share of a layer's predicted experts and hedges, `share` = (predicted,
        hedged; None when no live worker holds the layer), unless main got there first. A prediction
        for a position already predicted supersedes the earlier one. Returns the slots to evict."""
        evicted = self._switch(request, slots.held())
        iteration, layer = position
        if position <= self.done or share is None:
            return evicted  # main is already past this layer: too late to help
        mine, hedged = share[0], share[1] - share[0]
        keep = mine | hedged
        evicted += self._supersede(iteration, layer, keep, _remaining(slots.held(), evicted))
        if self.for_cache:
            through = self.predicted_through.get(layer, -1)
            self.predicted_through[layer] = max(through, iteration)
            for e in keep:
                if self.upcoming.get((layer, e), position) >= position:
                    self.upcoming[(layer, e)] = position
        there = [*_remaining(slots.held(), evicted), *slots.cached()]
        for queue, experts in ((self.preloads, mine), (self.hedge_queue, hedged)):
            for expert in sorted(experts):
                queued, key = (iteration, layer, expert), (layer, expert)
                if key not in self.stored or queued in self.served or queued in queue:
                    continue
                if not _loaded(there, key, (self.request, iteration)):
                    heapq.heappush(queue, queued)
        return evicted

    def serving(
        self, request: str, position: Position, expert: int, slots: SlotsState
    ) -> tuple[list[int], bool]:
        """main asks for `expert` at `position`: every earlier layer is over (main visits layers in
        order, and releases a layer only once all its experts are back), and this expert needs no
        preload: a prediction for it that is still queued, or that arrives late, would load it twice.
        Returns the slots to evict and whether this begins a visit of the layer."""
        evicted = self.finish(request, (position[0], position[1] - 1), slots)
        visit = self.at != position
        self.at = position
        queued = (position[0], position[1], expert)
        self.served.add(queued)
        for queue in (self.preloads, self.hedge_queue):
            if queued in queue:
                queue.remove(queued)
                heapq.heapify(queue)
        return evicted, visit

    def finish(self, request: str, position: Position, slots: SlotsState) -> list[int]:
        """main is done with this layer: drop preloads for it and anything earlier. Returns the slots
        to evict."""
        held = slots.held()
        evicted = self._switch(request, held)
        self.done = max(self.done, position)
        for slot in _remaining(held, evicted):
            if slot.tag is None or (slot.tag[0] == self.request and _position(slot) <= self.done):
                evicted.append(slot.index)
        self.preloads = [p for p in self.preloads if (p[0], p[1]) > self.done]
        heapq.heapify(self.preloads)
        self.hedge_queue = [p for p in self.hedge_queue if (p[0], p[1]) > self.done]
        heapq.heapify(self.hedge_queue)
        self.served = {p for p in self.served if (p[0], p[1]) > self.done}
        self.upcoming = {k: p for k, p in self.upcoming.items() if p > self.done}
        return evicted

    def switch_request(self, request: str, slots: SlotsState) -> list[int]:
        """Main's decode stream changed (a new busy period; "" when a request ended): nothing
        preloaded for the old one is wanted. A prefill call's slot (iteration 0) is left to its own
        compute: its other parts may still be on their way. Returns the slots to evict."""
        return self._switch(request, slots.held())

    def hedge_loaded(self, index: int) -> None:
        """The worker put a hedge (`Load.hedge`) into slot `index`."""
        self.hedged.add(index)
        self.hedge_counts[0] += 1

    def left(self, index: int, used: bool, nbytes: int) -> None:
        """Slot `index`'s load left the just-in-time slots (evicted, or kept as cached): for a hedge,
        whether it was used and the bytes it loaded are counted."""
        if index in self.hedged:
            self.hedged.discard(index)
            self.hedge_counts[1] += used
            self.hedge_counts[2] += nbytes

    # -- what to do -----------------------------------------------------------------------------
    def can_preload(self, slots: SlotsState) -> bool:
        """Whether `next_preload` has something to load now."""
        if slots.free:
            return bool(self.preloads or self.hedge_queue)
        latest = self._latest_hedge(slots.held())  # a confident preload needed sooner may take its slot
        if not self.preloads or latest is None:
            return False
        return self.preloads[0][:2] < hedge_rank(_position(latest))

    def next_preload(self, slots: SlotsState) -> Load | None:
        """Whatever main needs first: confident preloads by position, hedges ranked `HEDGE_LAG` layers
        later than their own (they outrank confident preloads further ahead, whose slots would sit
        idle). With no free slot, the confident preload takes the slot of the latest-ranked hedge.
        Dequeues one preload; None when it is no longer wanted (too late, or there already)."""
        hedge = bool(slots.free and self.hedge_queue) and (
            not self.preloads or hedge_rank(self.hedge_queue[0][:2]) < self.preloads[0][:2]
        )  # no free slot: can_preload found a confident preload that outranks a held hedge
        iteration, layer, expert = heapq.heappop(self.hedge_queue if hedge else self.preloads)
        key, tag = (layer, expert), (self.request, iteration)
        if (iteration, layer) <= self.done or _loaded([*slots.held(), *slots.cached()], key, tag):
            return None  # too late, or there already (cached since it was queued)
        if slots.free:
            return Load(key, tag, hedge)
        latest = self._latest_hedge(slots.held())
        if latest is None:
            raise RuntimeError("no free slot and no hedge to give back: ask can_preload first")
        return Load(key, tag, hedge, evict=latest.index)

    def make_room(self, slots: SlotsState) -> int | None:
        """A compute must load and every slot is busy: the slot to evict, a hedge first, else the
        latest-needed preload (queued again); None when a slot is free."""
        if slots.free:
            return None
        held = slots.held()
        hedges = [s for s in held if s.index in self.hedged]
        if hedges:
            return max(hedges, key=_position).index
        latest = max(held, key=_position)
        if latest.tag is not None:
            heapq.heappush(self.preloads, (latest.tag[1], *_key(latest)))
        return latest.index

    # -- helpers --------------------------------------------------------------------------------
    def _switch(self, request: str, held: Sequence[SlotState]) -> list[int]:
        if request == self.request:
            return []
        self.request, self.done, self.preloads, self.served = request, (-1, -1), [], set()
        self.hedge_queue, self.hedge_counts = [], [0, 0, 0]
        self.upcoming, self.predicted_through, self.at = {}, {}, (-1, -1)
        return [s.index for s in held if s.tag is None or s.tag[1] >= 1]

    def _supersede(self, iteration: int, layer: int, keep: set[int], held: Sequence[SlotState]) -> list[int]:
        """Forget queued or loaded preloads of (iteration, layer) that are not in `keep`; returns the
        slots to evict."""
        for name in ("preloads", "hedge_queue"):
            queue = getattr(self, name)
            kept = [p for p in queue if (p[0], p[1]) != (iteration, layer) or p[2] in keep]
            if len(kept) != len(queue):
                heapq.heapify(kept)
                setattr(self, name, kept)
        for key, position in list(self.upcoming.items()):
            if position == (iteration, layer) and key[1] not in keep:
                del self.upcoming[key]
        return [
            s.index
            for s in held
            if s.tag == (self.request, iteration) and _key(s)[0] == layer and _key(s)[1] not in keep
        ]

    def _latest_hedge(self, held: Sequence[SlotState]) -> SlotState | None:
        hedges = [s for s in held if s.index in self.hedged]
        return max(hedges, key=lambda s: hedge_rank(_position(s))) if hedges else None


def _loaded(slots: Sequence[SlotState], key: ExpertKey, tag: Tag) -> bool:
    """Whether `key` is in a slot loaded for `tag`, or cached (what DeviceSlots.find looks for)."""
    return any(s.holds == key and (s.cached or s.tag == tag) for s in slots)
