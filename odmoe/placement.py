"""Which worker computes which expert: pure functions of the cluster's shape.

Workers are numbered 0..N-1 and split into G = N / group_size round-robin groups; worker w belongs
to group w // group_size. MoE layer l belongs to group l mod G (paper §3.1), so while one group
computes layer l the next groups are already loading layers l+1, l+2, ... Main, the shadow and the
workers all call these functions, so they agree on placement without exchanging it.
"""

from __future__ import annotations

from dataclasses import dataclass

WorkerId = int


@dataclass(frozen=True)
class Topology:
    workers: int
    group_size: int

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"cluster.workers must be at least 1, got {self.workers}")
        if self.group_size < 1:
            raise ValueError(f"cluster.group_size must be at least 1, got {self.group_size}")
        if self.workers % self.group_size:
            raise ValueError(
                f"cluster.workers={self.workers} is not divisible by cluster.group_size={self.group_size}"
            )

    @property
    def groups(self) -> int:
        return self.workers // self.group_size

    def group_of_layer(self, layer: int) -> int:
        return layer % self.groups

    def group_of_worker(self, worker: WorkerId) -> int:
        return worker // self.group_size

    def workers_of_group(self, group: int) -> list[WorkerId]:
        return list(range(group * self.group_size, (group + 1) * self.group_size))

    def layers_of_worker(self, worker: WorkerId, layers: list[int]) -> list[int]:
        group = self.group_of_worker(worker)
        return [layer for layer in layers if self.group_of_layer(layer) == group]

    def decode_placement(self, layer: int, experts: list[int]) -> dict[int, WorkerId]:
        """The layer's experts, ascending, dealt round-robin over its group (one each when k == g)."""
        members = self.workers_of_group(self.group_of_layer(layer))
        return {e: members[i % len(members)] for i, e in enumerate(sorted(experts))}

    def prefill_placement(
        self, tokens_per_expert: dict[int, int], rule: str = "modulo"
    ) -> dict[int, WorkerId]:
        """Prefill hits nearly every expert: spread them over all workers.

        "modulo": expert e on worker e mod N. "balanced": largest token batch first onto the worker
        with the fewest tokens so far (ties: lowest id), so no worker gets the two busiest experts.
        """
        if rule == "modulo":
            return {e: e % self.workers for e in tokens_per_expert}
        if rule != "balanced":
            raise ValueError(f"prefill.placement={rule!r} is not one of modulo, balanced")
        load = [0] * self.workers
        placement = {}
        for e in sorted(tokens_per_expert, key=lambda e: (-tokens_per_expert[e], e)):
            worker = min(range(self.workers), key=lambda w: (load[w], w))
            placement[e] = worker
            load[worker] += tokens_per_expert[e]
        return placement

    def repair_placement(self, layer: int, predicted: list[int], activated: list[int]) -> dict[int, WorkerId]:
        """Where main sends the activated experts when the shadow predicted `predicted`.

        A correctly predicted expert goes to the worker that preloaded it. A missed one goes to a
        worker whose preloaded expert turned out unused (it must evict and reload anyway), else to
        its own round-robin place: the output is the same either way, only the load is late.
        """
        preloaded = self.decode_placement(layer, predicted)
        placement = {e: preloaded[e] for e in activated if e in preloaded}
        idle = [preloaded[e] for e in sorted(preloaded) if e not in placement]
        fallback = self.decode_placement(layer, activated)
        for e in sorted(set(activated) - set(placement)):
            placement[e] = idle.pop(0) if idle else fallback[e]
        return placement
