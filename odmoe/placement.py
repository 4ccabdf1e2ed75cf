"""Which worker computes which expert: pure functions of the cluster's shape and who is alive.

Workers are numbered 0..N-1 and split into G = N / group_size round-robin groups; worker w belongs
to group w // group_size. MoE layer l belongs to group l mod G (paper §3.1), so while one group
computes layer l the next groups are already loading layers l+1, l+2, ... Here l is the layer's rank
among the model's MoE layers (`Topology.for_model`), not its index: a model with dense layers
between (Llama 4 Maverick's MoE on every other layer) would otherwise leave half the groups without
a layer when G is even. Main, the shadow and the
workers all call these functions, so they agree on placement without exchanging it; the only thing
main sends is the set of live workers (`Membership`), so that predictions are dealt the same way
on both sides after a worker is lost.

Who stores what (`replicas`): 0 (the default) = every worker stores every layer, so the cluster
serves as long as one worker lives. R >= 1 (`worker.only_own_layers=true`) = layer l is stored by
the workers of groups l mod G, l+1 mod G, ..., l+R-1 mod G: its own group first, then R-1 backups.
A layer is served by the live members of the first of those groups that has any; when none holds
it, `LayerUnavailable` names the layer.

Homes (`homes`, on when the workers cache experts: `worker.cache`): expert e of a layer always goes
to member e mod n of the layer's serving group (n live members), whether predicted, hedged or
missed. A group's workers then cache disjoint experts (each keeps only those it is home for), so
the group's cache is the sum of theirs, and a mispredicted expert can still be a cache hit. The
price: a token whose experts share a home is computed by one worker of the group, not spread.
Where the members' caches differ in size (`rooms`: each worker's `worker.cache` in experts, which
`auto` sizes from the node's memory, from its Pong, sent to every worker with the live set), homes
follow the room: where the rooms together hold every expert the group serves, each member is home
for a share in proportion to its room (a 32 GB box twice the experts of a 16 GB one, each within its
room); where they do not, each is home for max(room, L), L chosen so that the group's experts are all
dealt (water-filling), so a worker keeps all it can and the rest, read from disk on each use, is
spread evenly. Rooms count at most the experts the group serves, so members that could each keep
them all share evenly. Equal rooms (or none known) give e mod n as above.

Stragglers (`slow`): a worker main has found consistently slower than its group's others
(odmoe.main.stragglers). Without homes it is left out when a layer's decode experts are dealt over
its group; with homes it is home for fewer experts: `slow_rooms` (one per straggler, main's choice
from its measured speed) is the share it is dealt by, at most what its room gives it, and the rest
of the group's experts, cached or not, is water-filled over its other members (a straggler is never
given the uncached rest). Either way, except on probes (each of the group's layers every
`probe_every`-th iteration, the layers taking turns: its share, or its unsteered homes, again, so
its recovery can be seen) or when every live member is one. Main sends the set (and the rooms) with
the live set, and the workers deal the shadow's predictions and keep their caches by it too, so the
preloads land where main sends the rows. Main moves homes only when that pays (odmoe.main.stragglers).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, replace
from functools import lru_cache

WorkerId = int


class LayerUnavailable(RuntimeError):
    """No live worker stores this layer: the request cannot go on until one (re)joins."""


@dataclass(frozen=True)
class Topology:
    workers: int
    group_size: int
    replicas: int = 0  # 0: every worker stores every layer; R: each layer on R groups (own + R-1 next)
    homes: bool = False  # each expert to its home worker (the workers cache): see the module's doc
    # The model's MoE layers, ascending: a layer's group is its rank among them modulo the groups, so
    # models with dense layers between (Llama 4 Maverick: every other one) use every group. Empty: the
    # layer index itself (a model whose every layer from 0 on is MoE gets the same either way).
    moe_layers: tuple[int, ...] = ()
    experts: int = 0  # routed experts per MoE layer (for_model): weighted homes need the group's count
    # Each worker's cache room in experts (index = worker), once main has every Pong; () or equal rooms:
    # homes are e mod n. Only read with `homes`.
    rooms: tuple[int, ...] = ()
    # Stragglers main steers decode work away from (odmoe.main.stragglers), told with the live set: a
    # group's decode experts are dealt over its other members (with homes: each straggler is home for
    # at most its `slow_rooms` entry, aligned with `slow`), except every probe_every-th decode
    # iteration (a probe: the straggler's share again, so its recovery is seen).
    slow: tuple[int, ...] = ()
    probe_every: int = 0
    slow_rooms: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"cluster.workers must be at least 1, got {self.workers}")
        if self.group_size < 1:
            raise ValueError(f"cluster.group_size must be at least 1, got {self.group_size}")
        if self.workers % self.group_size:
            raise ValueError(
                f"cluster.workers={self.workers} is not divisible by cluster.group_size={self.group_size}"
            )
        if not 0 <= self.replicas <= self.groups:
            raise ValueError(
                f"worker.replicas={self.replicas} must lie in 1..{self.groups} (the number of groups)"
            )

    @property
    def groups(self) -> int:
        return self.workers // self.group_size

    def for_model(self, moe_layers: list[int] | tuple[int, ...], experts: int = 0) -> Topology:
        """This topology over a model's MoE layers (main, the shadow and the workers all use it)."""
        return replace(self, moe_layers=tuple(sorted(moe_layers)), experts=experts)

    def with_rooms(self, rooms: list[int] | tuple[int, ...]) -> Topology:
        """This topology with the workers' cache rooms (in experts, by worker index)."""
        rooms = tuple(max(0, int(r)) for r in rooms)
        if rooms and len(rooms) != self.workers:
            raise ValueError(f"{len(rooms)} cache rooms for {self.workers} workers")
        return replace(self, rooms=rooms)

    def with_slow(
        self, slow: Collection[WorkerId], probe_every: int, slow_rooms: Collection[int] = ()
    ) -> Topology:
        """This topology steering decode work away from the stragglers `slow` (with homes: each is
        home for at most its entry of `slow_rooms`, in the order of sorted `slow`; none given: 0)."""
        ordered = tuple(sorted(slow))
        rooms = tuple(max(0, int(r)) for r in slow_rooms) or (0,) * len(ordered)
        if len(rooms) != len(ordered):
            raise ValueError(f"{len(rooms)} straggler rooms for stragglers {list(ordered)}")
        return replace(self, slow=ordered, probe_every=probe_every, slow_rooms=rooms)

    def steered(self, members: list[WorkerId], iteration: int, layer: int = 0) -> list[WorkerId]:
        """A serving group's members less its stragglers (all of them on a probe, or when every
        member is one)."""
        if not self.slow or self.homes or self.probe(iteration, layer):
            return members
        return [w for w in members if w not in self.slow] or members

    def probe(self, iteration: int, layer: int) -> bool:
        """Whether stragglers get their share of this decode layer again (iteration 0: prefill,
        never). A group's layers take turns, one per iteration, so a probe costs at most one slow
        load an iteration: the group's j-th layer is probed when iteration + j is a multiple of
        probe_every."""
        if self.probe_every <= 0 or iteration <= 0:
            return False
        return (iteration + _rank(self, layer) // self.groups) % self.probe_every == 0

    def group_of_layer(self, layer: int) -> int:
        return _rank(self, layer) % self.groups

    def group_of_worker(self, worker: WorkerId) -> int:
        return worker // self.group_size

    def workers_of_group(self, group: int) -> list[WorkerId]:
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    # -- who stores and who serves a layer ---------------------------------------------------
    def stored_layers(self, worker: WorkerId, layers: list[int]) -> list[int]:
        group = self.group_of_worker(worker)
        return [layer for layer in layers if group in holding_groups(self, layer)]

    def holders(self, layer: int, live: Collection[WorkerId] | None = None) -> list[WorkerId]:
        """Every live worker that stores the layer, ascending."""
        return sorted(
            w
            for g in holding_groups(self, layer)
            for w in self.workers_of_group(g)
            if live is None or w in live
        )

    def live_holders(self, layer: int, live: Collection[WorkerId] | None = None) -> list[WorkerId]:
        """`holders`, or LayerUnavailable naming the layer when none is live (prefill's workers)."""
        holders = self.holders(layer, live)
        if not holders:
            self.serving_group(layer, live)  # raises, naming the layer
        return holders

    def serving_group(self, layer: int, live: Collection[WorkerId] | None = None) -> list[WorkerId]:
        """The live members of the first group holding the layer that has any (decode's workers)."""
        for group in holding_groups(self, layer):
            members = [w for w in self.workers_of_group(group) if live is None or w in live]
            if members:
                return members
        raise LayerUnavailable(
            f"no live worker holds layer {layer} (stored by workers "
            f"{self.holders(layer)}; live: {sorted(live or [])})"
        )

    # -- placements ---------------------------------------------------------------------------
    def decode_placement(
        self,
        layer: int,
        experts: list[int],
        live: Collection[WorkerId] | None = None,
        iteration: int = 0,
    ) -> dict[int, WorkerId]:
        """The layer's experts, ascending, dealt round-robin over its serving group (one each when
        k == g) less its stragglers (`steered`: `iteration` says whether it is a probe); with
        `homes`, each to its home."""
        members = self.serving_group(layer, live)
        if self.homes:
            placed = replace(self, slow=(), slow_rooms=()) if self.probe(iteration, layer) else self
            if _weighted(placed, members):
                homes = _weighted_homes(placed, tuple(members), _live_key(live))
                return {e: homes[layer, e] for e in experts}
            return {e: members[e % len(members)] for e in experts}
        # A top-1 model's decode expert thus always goes to the group's first member. Taking turns
        # over the members layer by layer was measured slower on the 2-core machine (llama4, 2
        # workers: 178 / 142 against 193 / 179 tokens/s: two processes woken per token, not one),
        # so the paper's dealing stays.
        members = self.steered(members, iteration, layer)
        return {e: members[i % len(members)] for i, e in enumerate(sorted(experts))}

    def home(self, layer: int, expert: int, live: Collection[WorkerId] | None = None) -> WorkerId | None:
        """The worker that keeps `expert` of `layer` in its cache (None: no live worker serves it)."""
        try:
            members = self.serving_group(layer, live)
        except LayerUnavailable:
            return None
        if _weighted(self, members):
            return _weighted_homes(self, tuple(members), _live_key(live))[layer, expert]
        return members[expert % len(members)]

    def prefill_placement(
        self,
        tokens_per_expert: dict[int, int],
        rule: str = "modulo",
        workers: list[WorkerId] | None = None,
    ) -> dict[int, WorkerId]:
        """Prefill hits nearly every expert: spread them over `workers` (default: all).

        "modulo": expert e on workers[e mod n]. "balanced": largest token batch first onto the worker
        with the fewest tokens so far (ties: lowest id), so no worker gets the two busiest experts.
        """
        pool = sorted(workers) if workers is not None else list(range(self.workers))
        if not pool:
            raise LayerUnavailable("no live worker to spread the prompt over")
        if rule == "modulo":
            return {e: pool[e % len(pool)] for e in tokens_per_expert}
        if rule != "balanced":
            raise ValueError(f"prefill.placement={rule!r} is not one of modulo, balanced")
        load = dict.fromkeys(pool, 0)
        placement = {}
        for e in sorted(tokens_per_expert, key=lambda e: (-tokens_per_expert[e], e)):
            worker = min(pool, key=lambda w: (load[w], w))
            placement[e] = worker
            load[worker] += tokens_per_expert[e]
        return placement

    def hedge_placement(
        self,
        layer: int,
        predicted: list[int],
        hedges: list[int],
        live: Collection[WorkerId] | None = None,
        iteration: int = 0,
    ) -> dict[int, WorkerId]:
        """Where hedged experts are preloaded: on the worker of the last predicted expert (the
        shadow lists its choice by score, so that is the k-th, the one a hedge would replace)."""
        if not hedges or not predicted:
            return {}
        if self.homes:
            placed = self.decode_placement(layer, hedges, live, iteration)
            return {h: w for h, w in placed.items() if h not in predicted}
        twin = self.decode_placement(layer, predicted, live, iteration)[predicted[-1]]
        return {h: twin for h in hedges if h not in predicted}

    def repair_placement(
        self,
        layer: int,
        predicted: list[int],
        activated: list[int],
        live: Collection[WorkerId] | None = None,
        hedges: Collection[int] = (),
        iteration: int = 0,
    ) -> dict[int, WorkerId]:
        """Where main sends the activated experts when the shadow predicted `predicted`.

        A correctly predicted expert goes to the worker that preloaded it; a hedged one to the
        worker that preloaded the hedge. A missed one goes to a worker whose preloaded expert turned
        out unused (it must evict and reload anyway), else to its own round-robin place: the output
        is the same either way, only the load is late.
        """
        if self.homes:  # everything at home: a missed expert may be cached there
            return self.decode_placement(layer, activated, live, iteration)
        preloaded = self.decode_placement(layer, predicted, live, iteration)
        hedged = self.hedge_placement(layer, predicted, list(hedges), live, iteration)
        placement = {e: preloaded[e] for e in activated if e in preloaded}
        placement.update({e: hedged[e] for e in activated if e in hedged and e not in placement})
        taken = {placement[e] for e in activated if e in hedged}
        idle = [preloaded[e] for e in sorted(preloaded) if e not in placement and preloaded[e] not in taken]
        fallback = self.decode_placement(layer, activated, live, iteration)
        for e in sorted(set(activated) - set(placement)):
            placement[e] = idle.pop(0) if idle else fallback[e]
        return placement

    def replace_lost(
        self,
        layer: int,
        lost: dict[int, WorkerId],
        live: Collection[WorkerId],
        spread: bool,
        iteration: int = 0,
    ) -> dict[int, WorkerId]:
        """New workers for experts whose calls were outstanding on workers now dead: the layer's
        serving group over the live workers (decode), or every live holder of the layer (prefill)."""
        if spread:
            return self.prefill_placement(dict.fromkeys(lost, 1), "modulo", self.live_holders(layer, live))
        return self.decode_placement(layer, list(lost), live, iteration)


def holding_groups(topology: Topology, layer: int) -> list[int]:
    """The groups that store `layer`, in the order they serve it: its own group first."""
    first = topology.group_of_layer(layer)
    return [(first + j) % topology.groups for j in range(topology.replicas or topology.groups)]


def prediction_topics(topology: Topology, worker: WorkerId) -> list[int]:
    """The groups whose layers this worker may serve (its group or one of the replicas - 1 before
    it): the prediction topics it subscribes to."""
    own, groups = topology.group_of_worker(worker), topology.groups
    return sorted({(own - j) % groups for j in range(topology.replicas or groups)})


def _rank(topology: Topology, layer: int) -> int:
    """The layer's place among the model's MoE layers (its index where none are given)."""
    i = bisect_left(topology.moe_layers, layer)  # on every decode layer's placement: no scan
    return i if i < len(topology.moe_layers) and topology.moe_layers[i] == layer else layer


def moved_homes(before: Topology, after: Topology, live: Collection[WorkerId] | None = None) -> int:
    """How many (layer, expert) of the model change home from `before` to `after`: each is uncached
    at its new home, so one reload (what moving a straggler's homes costs)."""
    return sum(
        before.home(layer, e, live) != after.home(layer, e, live)
        for layer in before.moe_layers
        for e in range(before.experts)
    )


def home_counts(topology: Topology, live: Collection[WorkerId] | None = None) -> Counter[WorkerId]:
    """How many (layer, expert) of the model each live worker is home for."""
    homes = (topology.home(layer, e, live) for layer in topology.moe_layers for e in range(topology.experts))
    return Counter(w for w in homes if w is not None)


def _live_key(live: Collection[WorkerId] | None) -> tuple[WorkerId, ...] | None:
    return None if live is None else tuple(sorted(live))


def _steers_homes(topology: Topology, members: list[WorkerId]) -> bool:
    """Whether this group's homes are dealt around stragglers: some but not all members are
    stragglers, and the model's shape is given (homes are dealt over every layer the group serves)."""
    if not (topology.homes and topology.slow and topology.experts and topology.moe_layers):
        return False
    return 0 < len([w for w in members if w in topology.slow]) < len(members)


def _weighted(topology: Topology, members: list[WorkerId]) -> bool:
    """Whether homes follow the members' rooms (known, unequal, and the model's shape given), or
    are dealt around a straggler."""
    if _steers_homes(topology, members):
        return True
    if not (topology.rooms and topology.experts and topology.moe_layers and len(members) > 1):
        return False
    return len({topology.rooms[w] for w in members}) > 1


@lru_cache(maxsize=64)
def _weighted_homes(
    topology: Topology, members: tuple[WorkerId, ...], live: tuple[WorkerId, ...] | None
) -> dict[tuple[int, int], WorkerId]:
    """Every (layer, expert) that `members` serve under `live`, dealt to a home by room (the module's
    doc): shares by `_water_fill`, then each expert in turn (layers in
    rank order, experts ascending) to the member furthest behind its share, ties to the lowest id,
    so a layer's experts interleave over the members as with e mod n."""
    keys = [
        (layer, e)
        for layer in topology.moe_layers
        if topology.serving_group(layer, live) == list(members)
        for e in range(topology.experts)
    ]
    total = len(keys)
    known = topology.rooms or (total,) * topology.workers  # no rooms told: equal
    rooms = [min(known[w], total) for w in members]
    shares = _water_fill(rooms, total)
    if _steers_homes(topology, list(members)):  # stragglers: at most their rooms' share, the rest to others
        cap = dict(zip(topology.slow, topology.slow_rooms, strict=True))
        fixed = [min(shares[m], cap[w]) if w in cap else None for m, w in enumerate(members)]
        rest = [r for r, f in zip(rooms, fixed, strict=True) if f is None]
        filled = iter(_water_fill(rest, total - sum(f for f in fixed if f is not None)))
        shares = [f if f is not None else next(filled) for f in fixed]
    given = [0] * len(members)
    homes = {}
    for i, key in enumerate(keys, start=1):
        j = max(range(len(members)), key=lambda m: (shares[m] * i / total - given[m], -m))
        given[j] += 1
        homes[key] = members[j]
    return homes


def _water_fill(rooms: list[int], total: float) -> list[float]:
    """Shares summing to `total`: where the rooms hold them all, in proportion to the rooms (each
    within its room); where they hold fewer than `total`, max(room, L) (each keeps what it can, the
    rest spread evenly)."""
    if sum(rooms) >= total and sum(rooms) > 0:
        return [total * r / sum(rooms) for r in rooms]

    def dealt(level: float) -> float:
        return sum(max(r, level) for r in rooms)

    low, high = 0.0, float(total)
    for _ in range(60):  # dealt() rises with the level: bisect it onto the total
        mid = (low + high) / 2
        low, high = (mid, high) if dealt(mid) < total else (low, mid)
    return [max(r, high) for r in rooms]
