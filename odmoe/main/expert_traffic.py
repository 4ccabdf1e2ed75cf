"""What the workers did for one request: the typed counters behind its stats.

Contract: one `ExpertTraffic` per running request (`RunContext.traffic`), written only by the
data plane's accounting observer (`odmoe.main.exchange_observers.TrafficAccounting`) and read by
`odmoe.main.run_stats` (the stats clients receive) and the engine (`wrong_predictions`, what the
alignment tuner observes). Costs several requests shared (an expert loaded once for all of them)
are split between them, so the requests' sums are the cluster's totals. Pure bookkeeping: no
sockets, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from odmoe.main.recall import RecallCounter
from odmoe.transport.messages import ExpertsResult


@dataclass
class DecodeCounters:
    """Decode iterations only: what the pipeline model needs (main's own time = decode time - wait),
    and where a layer's time goes (summed over layers, `LayerClock`): main splitting, placing and
    encoding; the round trip from the first send to the last answer, of which that worker handled
    `worker_s`; main decoding answers; main combining them."""

    wait_s: float = 0.0
    layers: int = 0
    experts: float = 0  # a share of an expert several requests used counts as that fraction
    compute_s: float = 0.0
    loads: float = 0
    load_s: float = 0.0
    prepare_s: float = 0.0
    round_trip_s: float = 0.0
    worker_s: float = 0.0
    take_s: float = 0.0
    combine_s: float = 0.0


@dataclass
class PrefillCounters:
    """The prompt's exchanges (and a prompt's scoring pass): what main waited, what the workers
    spent, and the busiest worker per layer summed (the critical path)."""

    wait_s: float = 0.0
    load_s: float = 0.0
    compute_s: float = 0.0
    critical_s: float = 0.0
    experts_per_layer: dict[int, int] = field(default_factory=dict)
    layer_busy: dict[int, float] = field(default_factory=dict)  # worker -> load+compute in this layer


@dataclass
class WorkerCounters:
    """One worker's part of a request; the request's totals are the sums over its workers."""

    experts: float = 0
    bytes_loaded: float = 0
    load_s: float = 0.0
    compute_s: float = 0.0


@dataclass
class LayerClock:
    """perf_counter stamps of one layer's exchange on main (seconds)."""

    sending: float = 0.0  # every call encoded, the first about to be handed to ZeroMQ
    answered: float = 0.0  # the last answer's frames in hand
    worker_s: float = 0.0  # how long that answer's worker handled its call (its `handled_s`)
    take_s: float = 0.0  # decoding and checking every answer

    def note(self, decode: DecodeCounters, entered: float, gathered: float, combined: float) -> None:
        decode.prepare_s += self.sending - entered
        # from the first send: a send can cost main its core at once (to the worker it woke), so
        # a stamp after the sends would count the workers' time as main's
        decode.round_trip_s += self.answered - self.sending
        decode.worker_s += self.worker_s
        decode.take_s += self.take_s
        decode.combine_s += combined - gathered


@dataclass
class ExpertTraffic:
    """What the workers did for one request (summed over layers and iterations)."""

    wait_s: float = 0.0  # main blocked on workers (transfer + load + compute as seen by main)
    worker_peak_rss: dict[int, int] = field(default_factory=dict)
    worker_device_peak: dict[int, int] = field(default_factory=dict)  # CUDA max_memory_allocated
    preloaded: int = 0  # decode experts the shadow's prediction had already loaded
    reloads: int = 0  # decode experts loaded only after main asked (misses)
    # decode: per layer, summed over iterations, the longest any worker made main wait for a load
    stall_s_per_layer: dict[int, float] = field(default_factory=dict)
    # Predictions as they stood when main needed them (late = missing): what the workers could use.
    timely_recall: RecallCounter = field(default_factory=RecallCounter)
    activated: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (iteration, layer) -> experts
    resent: int = 0  # calls re-sent to another worker after theirs was lost
    # lossy miss policy: layer -> missed experts computed by a resident stand-in (0 everywhere: exact)
    substitutions_per_layer: dict[int, int] = field(default_factory=dict)
    # every substitution as (iteration, layer, missing expert, expert computed in its place)
    substituted: list[tuple[int, int, int, int]] = field(default_factory=list)
    per_worker: dict[int, WorkerCounters] = field(default_factory=dict)
    # hedged prefetch (odmoe.shadow.hedging): worker -> its latest [hedge loads, hedges used, bytes
    # hedges loaded]
    hedging: dict[int, list[int]] = field(default_factory=dict)
    hedge_hits: int = 0  # activated experts the shadow had hedged (not predicted) and that arrived in time
    # worker.cache: experts computed from a worker's cache (no load), the bytes those loads would have
    # moved, and each worker's cache as of its latest answer (CacheBook.report)
    cache_hits: float = 0
    cache_bytes_saved: float = 0
    cache_hits_per_layer: dict[int, float] = field(default_factory=dict)
    cache: dict[int, list[int]] = field(default_factory=dict)
    decode: DecodeCounters = field(default_factory=DecodeCounters)
    prefill: PrefillCounters = field(default_factory=PrefillCounters)

    @property
    def experts_loaded(self) -> float:
        return sum(w.experts for w in self.per_worker.values())

    @property
    def bytes_loaded(self) -> float:
        return sum(w.bytes_loaded for w in self.per_worker.values())

    @property
    def load_s(self) -> float:
        return sum(w.load_s for w in self.per_worker.values())

    @property
    def compute_s(self) -> float:
        return sum(w.compute_s for w in self.per_worker.values())

    def wrong_predictions(self, iteration: int) -> tuple[int, int]:
        """(wrong, predicted) experts of the predictions main had in time in that decode iteration."""
        wrong, predicted = self.timely_recall.arrived.get(iteration, (0, 0))
        return wrong, predicted

    # -- what the accounting observer records ------------------------------------------------
    def note_prediction(self, iteration: int, layer: int, predicted, experts: list[int], hedged) -> None:
        """Timely recall, as the paper counts it, at this layer; `hedged`: what the shadow hedged
        beyond its prediction (an activated one that arrived in time is a hedge hit)."""
        self.timely_recall.add(iteration, layer, predicted, experts)
        self.activated[(iteration, layer)] = experts
        if hedged and predicted is not None:
            self.hedge_hits += len(set(hedged) & set(experts))

    def note_substitutions(self, iteration: int, layer: int, chosen: dict[int, int]) -> None:
        """A lossy policy computed `chosen` (missing expert -> the resident one) at this layer."""
        self.substitutions_per_layer[layer] = self.substitutions_per_layer.get(layer, 0) + len(chosen)
        self.substituted += [(iteration, layer, e, p) for e, p in sorted(chosen.items())]

    def note_prefill_layer(self, layer: int, waited: float, experts: int) -> None:
        p = self.prefill
        self.wait_s += waited
        p.wait_s += waited
        p.critical_s += max(p.layer_busy.values(), default=0.0)  # the busiest worker bounds the layer
        p.experts_per_layer[layer] = experts
        p.layer_busy = {}

    def note_decode_layer(self, layer: int, waited: float, stall: float) -> None:
        self.wait_s += waited
        self.decode.wait_s += waited
        self.decode.layers += 1
        self.stall_s_per_layer[layer] = self.stall_s_per_layer.get(layer, 0.0) + stall

    def add(self, result: ExpertsResult) -> None:
        """One prefill answer (a prompt's scoring pass counts as prefill): its experts' costs, a
        mini-batch's load counted with its first part."""
        for i in range(len(result.experts)):
            load_s, compute_s, nbytes = result.load_s[i], result.compute_s[i], result.bytes_loaded[i]
            if result.step.iteration <= 0:
                self.prefill.load_s += load_s
                self.prefill.compute_s += compute_s
                busy = self.prefill.layer_busy
                busy[result.worker] = busy.get(result.worker, 0.0) + load_s + compute_s
            else:
                self._add_decode(load_s, compute_s, nbytes)
            self._add_expert(result.worker, result.part == 0, nbytes, load_s, compute_s)
            if result.cached and result.cached[i] and result.part == 0:
                self._cache_hit(result.step.layer, 1, result.cached[i])
        self._add_worker(result)

    def add_share(self, result: ExpertsResult, i: int, share: int, of: int) -> None:
        """This request's `share` of `of` segments of expert `result.experts[i]` (a decode answer):
        what loading and computing it cost, split by segments so the requests' sums are the totals."""
        part = share / of if of > 1 else share  # an int when nothing is shared: a lone request's stats
        load_s, compute_s = result.load_s[i] * part, result.compute_s[i] * part
        nbytes = result.bytes_loaded[i] * part
        self._add_decode(load_s, compute_s, nbytes, part)
        self._add_worker(result)
        self._add_expert(result.worker, part, nbytes, load_s, compute_s)
        if result.cached and result.cached[i]:
            self._cache_hit(result.step.layer, part, result.cached[i] * part)
        self.preloaded += result.preloaded[i]
        self.reloads += not result.preloaded[i]
        if len(result.hedges) == 3:
            self.hedging[result.worker] = result.hedges

    def _cache_hit(self, layer: int, count: float, saved: float) -> None:
        self.cache_hits += count
        self.cache_bytes_saved += saved
        self.cache_hits_per_layer[layer] = self.cache_hits_per_layer.get(layer, 0) + count

    def _add_decode(self, load_s: float, compute_s: float, nbytes: float, count: float = 1) -> None:
        d = self.decode
        d.experts += count
        d.compute_s += compute_s
        d.loads += count if nbytes > 0 else 0
        d.load_s += load_s

    def _add_worker(self, result: ExpertsResult) -> None:
        """The answering worker's peak memory so far, and its cache as of this answer."""
        w = result.worker
        self.worker_peak_rss[w] = max(self.worker_peak_rss.get(w, 0), result.peak_rss)
        self.worker_device_peak[w] = max(self.worker_device_peak.get(w, 0), result.device_peak_bytes)
        if result.cache:
            self.cache[w] = result.cache

    def _add_expert(self, worker: int, count: float, nbytes: float, load_s: float, compute_s: float) -> None:
        w = self.per_worker.setdefault(worker, WorkerCounters())
        w.experts += count
        w.bytes_loaded += nbytes
        w.load_s += load_s
        w.compute_s += compute_s
