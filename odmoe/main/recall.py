"""Prediction recall exactly as the paper defines it (Eq. 2-3), decode iterations only.

recall(n) = sum over layers of |predicted ∩ activated| / sum over layers of |activated| for output
token n; overall recall = the same ratio over every decode token observed. A layer whose prediction
never arrived counts as predicting nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class RecallCounter:
    _token: dict[int, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    _layer: dict[int, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    late: int = 0  # layers whose prediction had not arrived when main needed it
    # iteration -> [wrong, predicted] over the predictions that did arrive (what alignment can fix)
    arrived: dict[int, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def add(self, iteration: int, layer: int, predicted: list[int] | None, activated: list[int]) -> None:
        if iteration < 1:
            return  # prefill uses no prediction
        if predicted is None:
            self.late += 1
        else:
            row = self.arrived[iteration]
            row[0] += len(set(predicted) - set(activated))
            row[1] += len(set(predicted))
        hits = len(set(predicted or ()) & set(activated))
        for table, key in ((self._token, iteration), (self._layer, layer)):
            table[key][0] += hits
            table[key][1] += len(set(activated))

    @staticmethod
    def _ratio(pair: list[int]) -> float:
        return pair[0] / pair[1] if pair[1] else 0.0

    def report(self) -> dict:
        hits = sum(h for h, _ in self._token.values())
        total = sum(t for _, t in self._token.values())
        return {
            "overall": hits / total if total else None,
            "per_token": {n: self._ratio(v) for n, v in sorted(self._token.items())},
            "per_layer": {layer: self._ratio(v) for layer, v in sorted(self._layer.items())},
            "activated": total,
            "late_layers": self.late,
        }
