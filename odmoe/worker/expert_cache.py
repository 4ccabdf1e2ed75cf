"""A worker's expert cache: how many experts stay on its device after use, and which one leaves.

Contract (pure: numbers and positions in, decisions out; the worker owns the buffers):
- `cache_capacity(spec, ...)`: `worker.cache` as a number of experts, the worker's room: "0"
  (cacheless, the paper's), a size ("6GiB", "512MiB", bytes), "all" (every expert this worker
  stores; it keeps only those it is home for, so with every worker caching its own the cluster holds
  each expert once), or "auto" (free device memory less a margin, at most "all"). Main deals homes by
  the workers' rooms (odmoe.placement). The just-in-time slots (`worker.slots`) come on top, so the
  cache never blocks a load: a cached expert not in use is dropped at once when a buffer is needed.
- `CacheBook`: which experts are cached, how often each expert was used per visit of its layer, and
  `victim(...)`: the expert to drop when one more is to be kept than there is room for, the
  newcomer included (it may be the one left out).
  - policy "prediction": the expert expected to be needed farthest ahead (`expected_distance`): a
    pending prediction of the shadow says exactly when; otherwise its layer's next visit that no
    prediction has covered yet (one already predicted without it does not count), plus, for each
    further visit it is expected to skip, one round of the layers (its rate of use per visit so
    far, Laplace-smoothed, starting from `odmoe-profile`'s rate when the model has a profile:
    `prior`, worth PRIOR_VISITS visits); ties go to the least recently used;
  - policy "lru": the least recently used (the ablation baseline: the same budget without the
    shadow's knowledge).
Positions are (iteration, layer): the order main visits decode layers in. A cache changes where an
expert's bytes come from, never what is computed: tokens are the same with any capacity or policy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from odmoe.tools.memory import parse_bytes

CACHE_POLICIES = ("prediction", "lru")
AUTO_MARGIN_FRACTION = 0.1  # "auto" leaves this share of the free memory, and at least AUTO_MARGIN_BYTES
AUTO_MARGIN_BYTES = 1 << 30

ExpertKey = tuple[int, int]  # (layer, expert)
Position = tuple[int, int]  # (iteration, layer)
FAR = (1 << 62, 0)  # an expert nothing will use (not this worker's to serve)
# A profile's use rate counts as this many visits already seen: enough to order experts before a
# worker has seen any, few enough that what this cluster's own traffic shows takes over soon.
PRIOR_VISITS = 16


def cache_capacity(
    spec: str | int, expert_bytes: int, home_experts: int, free_bytes: Callable[[], int]
) -> int:
    """`worker.cache` in experts (see the module's contract); `home_experts` bounds it (a worker
    passes every expert it stores: what it may become home for)."""
    text = str(spec).strip().lower()
    if text in ("", "0", "none", "off"):
        return 0
    if text == "all":
        return home_experts
    if text == "auto":
        free = free_bytes()
        room = free - max(int(free * AUTO_MARGIN_FRACTION), AUTO_MARGIN_BYTES)
        return max(0, min(home_experts, room // expert_bytes))
    try:
        size = parse_bytes(text)
    except ValueError:
        raise ValueError(f'worker.cache={spec!r} is not 0, a size like "6GiB", "all" or "auto"') from None
    return min(home_experts, size // expert_bytes)


def check_cache_spec(spec: str | int) -> None:
    """Raise ValueError unless `spec` is a valid `worker.cache` (what `cache_capacity` would accept)."""
    cache_capacity(spec, 1, 1, lambda: 0)


def next_use(
    key: ExpertKey,
    done: Position,
    upcoming: Mapping[ExpertKey, Position],
    predicted_through: Mapping[int, int],
    serves: bool = True,
) -> tuple[Position, bool]:
    """When `key` may be needed next, as far as this worker knows once main is past `done` (the layer
    it is computing counts as done), and whether that is a prediction (True) or only the first
    visit of its layer no prediction has covered yet (False)."""
    if not serves:
        return FAR, True
    if key in upcoming and upcoming[key] > done:
        return upcoming[key], True
    layer = key[0]
    iteration = done[0] if layer > done[1] else done[0] + 1
    covered = predicted_through.get(layer)
    if covered is not None and covered >= iteration:
        iteration = covered + 1  # that visit was predicted without this expert
    return (iteration, layer), False


def expected_distance(
    key: ExpertKey,
    done: Position,
    upcoming: Mapping[ExpertKey, Position],
    predicted_through: Mapping[int, int],
    layer_rank: Mapping[int, int],
    use_rate: float,
    serves: bool = True,
) -> float:
    """Layers main visits before it needs `key` (expected): `next_use`'s position, plus a round of
    every layer for each visit it is expected to skip when that position is not a prediction."""
    position, certain = next_use(key, done, upcoming, predicted_through, serves)
    if position == FAR:
        return float("inf")
    rounds = len(layer_rank)

    def index(p: Position) -> int:
        return p[0] * rounds + layer_rank.get(p[1], 0)

    distance = float(index(position) - index(done))
    if not certain:
        distance += (1.0 / max(use_rate, 1e-6) - 1.0) * rounds
    return distance


@dataclass
class CacheBook:
    capacity: int
    policy: str = "prediction"
    cached: dict[ExpertKey, int] = field(default_factory=dict)  # cached expert -> its last use (clock)
    uses: dict[ExpertKey, int] = field(default_factory=dict)  # decode uses of every expert served
    visits: dict[int, int] = field(default_factory=dict)  # layer -> decode visits this worker served
    clock: int = 0  # counts uses: recency without wall-clock time
    hits: int = 0
    misses: int = 0
    bytes_saved: int = 0
    evictions: dict[int, int] = field(default_factory=dict)  # layer -> experts dropped from the cache
    version: int = 0  # changes whenever what is cached changes
    # (layer, expert) -> uses per visit of its layer measured offline (odmoe-profile), if any
    prior: Mapping[ExpertKey, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in CACHE_POLICIES:
            raise ValueError(f"worker.cache_policy={self.policy!r} is not one of {', '.join(CACHE_POLICIES)}")
        if self.capacity < 0:
            raise ValueError(f"a cache of {self.capacity} experts")

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def visit(self, layer: int) -> None:
        """Main asked this worker for a decode layer it had not asked for in this iteration."""
        self.visits[layer] = self.visits.get(layer, 0) + 1

    def use_rate(self, key: ExpertKey) -> float:
        """How often `key` was used per visit of its layer (Laplace: 1/2 before anything is known;
        with a profile, its rate as PRIOR_VISITS visits seen)."""
        uses: float = self.uses.get(key, 0) + 1
        visits: float = self.visits.get(key[0], 0) + 2
        if key in self.prior:
            uses, visits = uses + PRIOR_VISITS * self.prior[key], visits + PRIOR_VISITS
        return uses / visits

    def used(self, key: ExpertKey, hit: bool, nbytes: int = 0, decode: bool = True) -> None:
        """`key` was computed: from the cache (`hit`, saving `nbytes` of loading) or loaded for it."""
        self.clock += 1
        if key in self.cached:
            self.cached[key] = self.clock
        if decode:
            self.uses[key] = self.uses.get(key, 0) + 1
        self.hits += hit
        self.misses += not hit
        self.bytes_saved += nbytes if hit else 0

    def admit(self, key: ExpertKey) -> None:
        self.cached[key] = self.clock
        self.version += 1

    def victim(self, candidates: list[ExpertKey], distance_of: Callable[[ExpertKey], float]) -> ExpertKey:
        """Which of `candidates` (cached experts not in use, and perhaps a newcomer) to drop."""
        if not candidates:
            raise ValueError("no candidate to evict")

        def recency(key: ExpertKey) -> int:
            return self.cached.get(key, self.clock + 1)

        if self.policy == "lru":
            return min(candidates, key=lambda k: (recency(k), k))
        return max(candidates, key=lambda k: (distance_of(k), -recency(k), k))

    def drop(self, key: ExpertKey) -> None:
        if self.cached.pop(key, None) is not None:
            self.version += 1
            self.evictions[key[0]] = self.evictions.get(key[0], 0) + 1

    def report(self, home: int = 0, home_cached: int = 0) -> list[int]:
        """What a worker sends main with each answer: [capacity, cached, hits, misses, bytes saved,
        evictions] cumulative since it started, then [experts it is home for now, of them cached],
        then (layer, evictions) pairs."""
        per_layer = [n for layer, count in sorted(self.evictions.items()) for n in (layer, count)]
        return [
            min(self.capacity, home) if home else self.capacity,  # what it can keep of its homes
            len(self.cached),
            self.hits,
            self.misses,
            self.bytes_saved,
            sum(self.evictions.values()),
            home,
            home_cached,
            *per_layer,
        ]


def complete(reports: Mapping[int, list[int]], live: list[int]) -> bool:
    """Whether every live worker's latest report says its cache holds every expert it is home for
    (then predictions would load nothing)."""
    rows = [r for w in live if (r := reports.get(w)) is not None and len(r) >= 8]
    if not live or len(rows) < len(live):  # a live worker without a (full) report
        return False
    return sum(r[6] for r in rows) > 0 and all(r[7] >= r[6] for r in rows)
