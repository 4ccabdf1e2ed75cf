"""Main's steering of decode work around stragglers: the straggler watch fed, its verdicts acted on.

Contract: `StragglerSteering(watch, members, probe_every, move_horizon).judge(step, calls, overtaken,
gathered)` after every decode layer's exchange (RemoteExperts.exchange_decode): each answered
expert's seconds go to the `StragglerWatch` (odmoe.main.stragglers, the pure judgement); when its
set of stragglers changes, `members.steer` tells every worker and placement follows (cacheless: the
group's other members take a straggler's decode experts but on its probes; with homes: its homes
move to its peers where `home_move` says that pays within `move_horizon` tokens, weighed again every
window, and come back once it recovers). Membership's lost / rejoined events make a worker judged
afresh. Sends nothing itself but through `members.steer`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from odmoe.main.exchange_records import BatchCall
from odmoe.main.membership import Membership
from odmoe.main.stragglers import StragglerWatch, home_move, lost_hits, straggler_room
from odmoe.placement import home_counts, moved_homes
from odmoe.transport.messages import Step

log = logging.getLogger("odmoe.main")


class StragglerSteering:
    def __init__(self, watch: StragglerWatch, members: Membership, probe_every: int, move_horizon: int):
        self.watch, self.members = watch, members
        self.probe_every = probe_every  # a straggler still gets its share every this-many-th iteration
        # with homes: tokens a straggler's home move must pay for itself within (0: homes never move)
        self.move_horizon = move_horizon
        self._iterations, self._last_step = 0, ("", -1)  # decode iterations main has run (their rate)
        self._weigh_at = 0  # with homes: the iteration count at which unmoved stragglers are weighed again
        self._events_seen = 0  # Membership.events already read

    def judge(
        self, step: Step, calls: list[BatchCall], overtaken: Sequence[BatchCall] = (), gathered: float = 0.0
    ) -> None:
        """Each answered expert's seconds to the watch: its load + compute as the worker reported
        them, plus its share of its call's wire time (main's round trip less the worker's own time),
        so a worker on a slow *network* link is judged as one on a slow load link (with homes only
        the answers that loaded: a cache hit has no load to judge). A worker lost or taken back since
        the last judgement is judged afresh. A changed set of stragglers is told to every worker at
        once (Membership.steer), so the next predictions are dealt by it. A call a late re-send
        overtook counts as slow as it had been when the layer ended (`gathered`): at least that slow,
        and without it a straggler whose every call is overtaken would never be judged."""
        watch = self.watch
        if (step.request, step.iteration) != self._last_step:
            self._iterations, self._last_step = self._iterations + 1, (step.request, step.iteration)
        homes, peers = self.members.topology.homes, self.members.serving(step.layer)
        changed = self._forget_changed_members(watch)
        for call in calls:
            assert call.answer is not None
            result = call.answer[0]
            wire_s = call.wire_s / max(len(call.experts), 1)
            for load_s, compute_s in zip(result.load_s, result.compute_s, strict=True):
                if homes and load_s <= 0:
                    watch.hit(call.worker, self._iterations)  # nothing to judge; a move may lose it
                    continue
                changed |= watch.observe(call.worker, load_s + compute_s + wire_s, peers, self._iterations)
        for call in overtaken:
            seconds = (gathered - call.sent_at) / max(len(call.experts), 1)
            for _ in call.experts:
                changed |= watch.observe(call.worker, seconds, peers, self._iterations)
        if not homes:
            if changed:
                self.members.steer(watch.slow, self.probe_every)
        elif changed or (watch.slow - set(self.members.topology.slow) and self._iterations >= self._weigh_at):
            self._steer_homes()

    def _forget_changed_members(self, watch: StragglerWatch) -> bool:
        """Membership's events since the last call: a worker lost or taken back starts with no
        verdict (a restarted process, or a link that healed, is not the one that was slow). True
        when the set of stragglers changed."""
        events = getattr(self.members, "events", [])  # the in-process engine's members have none
        changed = False
        for event in events[self._events_seen :]:
            if event.event in ("lost", "rejoined"):
                changed |= watch.forget(event.worker)
        self._events_seen = len(events)
        return changed

    def _steer_homes(self) -> None:
        """With homes: each new straggler's homes move to its peers where that pays (odmoe.main.
        stragglers.home_move, both figures kept in the stats and logged); a recovered one's come back."""
        watch, topology, live = self.watch, self.members.topology, self.members.live
        kept = dict(zip(topology.slow, topology.slow_rooms, strict=True))  # moved now
        target = {w: r for w, r in kept.items() if w in watch.slow}  # the recovered go back
        rooms = self.members.rooms()
        for worker in sorted(watch.slow - kept.keys()):
            peers = self._serving_group_of(worker)
            time_s, reference = watch.time(worker), watch.reference(worker, peers)
            if not rooms or time_s is None or reference is None:
                continue
            room = straggler_room(rooms[worker], time_s, reference)
            trial = {**target, worker: room}
            after = topology.with_slow(trial, self.probe_every, [trial[w] for w in sorted(trial)])
            homes_now = home_counts(topology, live)
            spare = sum(max(0, rooms[p] - homes_now[p]) for p in peers if p != worker)
            lost = lost_hits(min(rooms[worker], homes_now[worker]), room, spare)
            move = home_move(
                worker,
                moved_homes(topology, after, live),
                reference,
                watch.extra_per_token(worker, peers),
                self.move_horizon,
                room,
                watch.hits_per_token(worker) * lost * reference,
            )
            watch.moves.append(move.report(move.worth))
            log.warning(
                "straggler worker %d: moving its homes costs %d reloads (%.3f s), saves %.4f s a token "
                "less %.4f s of hits lost (%.3f s over %d tokens): %s",
                worker,
                move.reloads,
                move.move_s,
                move.extra_s_per_token,
                move.added_s_per_token,
                move.saving_s,
                move.horizon,
                f"moved, it keeps a room of {room}" if move.worth else "not moved",
            )
            if move.worth:
                target[worker] = room
        self._weigh_at = self._iterations + watch.window
        if target != kept:
            self.members.steer(frozenset(target), self.probe_every, [target[w] for w in sorted(target)])

    def _serving_group_of(self, worker: int) -> list[int]:
        """The live members of the worker's group."""
        group = self.members.topology.workers_of_group(self.members.topology.group_of_worker(worker))
        return [w for w in group if w in self.members.live]
