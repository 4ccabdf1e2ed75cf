"""Data-plane messages between main, workers (and later the shadow), as frozen dataclasses.

Every message names its `(request, iteration, layer)` so that predictions, retries after a worker
is replaced, and timelines can all be matched to the decode step they belong to. `to_frames` /
`from_frames` go through codec; the message kind travels in the header.

Every received frame is untrusted: `from_frames` checks each field's type against the dataclass
(and how many tensors the kind carries) and raises only `CodecError`, so a node drops a bad frame
and stays up. Unknown extra keys are ignored (a newer peer may add fields).
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from odmoe.transport.codec import CodecError, decode, encode


@dataclass(frozen=True)
class Step:
    request: str
    iteration: int  # 0 = prefill, n = the n-th decode iteration
    layer: int


@dataclass(frozen=True)
class ComputeExperts:
    """main -> worker: compute `experts` of `step.layer` on their rows (tensor i: expert `experts[i]`'s
    rows [n, H], its requests' segments one after another, `segments[i]` their row counts). The one
    compute message, for prefill and decode alike:
    - decode, `(stream, tick, layer)` (`odmoe.main.engine`): every running request's rows of the
      experts main placed on this worker. The worker loads each expert once and computes each
      segment on its own, in the shape it has when its request runs alone (a matmul's result for a
      row may depend on the rows around it), so every request gets the bits it would get alone.
    - prefill, `(request, 0, layer)`: one expert per message, one segment (the prompt's rows of that
      expert), sent as soon as it is split so transfer and compute overlap across experts; a long
      segment may come in `parts` mini-batches (one message each, the same expert)."""

    step: Step
    experts: list[int]
    segments: list[list[int]]
    kernel: str
    # [rows, experts] of each request's reference grouped_mm call (T*k, E; T = 1 in decode): a CUDA
    # worker mirrors that call's shape so the kernel picks the reference's tiles
    # (odmoe.models.expert_math); [] = none
    grouped_shape: list[int] = field(default_factory=list)
    # decode: main asks this worker nothing more in this layer, so once it has answered it drops what
    # it preloaded for the layer, as a Release would, without a message (and a wake-up) of its own
    release: bool = False
    # Prefill mini-batches (one expert): this message's rows are part `part` of `parts`. The worker
    # computes once all parts are in (bit-exact: a matmul's rows depend on how many rows it sees)
    # unless `per_part` opts out, when it answers each part.
    part: int = 0
    parts: int = 1
    per_part: bool = False
    # kernel "bmm" (Llama 4), prefill: per expert, its rows' token positions among the reference
    # bmm's grouped_shape[0] rows, where the worker computes them (odmoe.models.expert_math); [] =
    # the rows are all of them
    positions: list[list[int]] = field(default_factory=list)
    kind: str = "compute_experts"

    @staticmethod
    def single(step: Step, expert: int, kernel: str, rows: int, **fields) -> ComputeExperts:
        """One expert's `rows` rows in one segment (a prefill's call, or one of its mini-batches)."""
        return ComputeExperts(step, [expert], [[rows]], kernel, **fields)


def joined_parts(parts: dict[int, tuple[torch.Tensor, list[int]]]) -> tuple[torch.Tensor, list[int]]:
    """One expert's prefill mini-batches, part index -> (rows [n, H], their positions), as the whole
    batch: the rows concatenated in part order, and their positions."""
    ordered = [parts[i] for i in range(len(parts))]
    return torch.cat([rows for rows, _ in ordered]), [p for _, positions in ordered for p in positions]


def positions_problem(kernel: str, grouped_shape: list[int], positions: list[int], rows: int) -> str:
    """What is wrong with one expert's row `positions` for its `rows` rows, or "": the bmm kernel
    and its [rows, experts], one distinct position per row, each within the reference's rows."""
    shape = grouped_shape
    if kernel != "bmm" or len(shape) != 2:
        return f"row positions need the bmm kernel and [rows, experts]: {kernel!r:.20} {shape!r:.30}"
    if len(positions) != rows or len(set(positions)) != rows:
        return f"{len(positions)} row positions for {rows} rows"
    if not all(type(p) is int and 0 <= p < shape[0] for p in positions):
        return f"row positions outside the reference's {shape[0]} rows"
    return ""


@dataclass(frozen=True)
class ExpertsResult:
    """worker -> main: the answer to one ComputeExperts (tensor i: expert `experts[i]`'s unweighted
    outputs, segment by segment as sent), with each expert's costs."""

    step: Step
    worker: int
    experts: list[int]
    load_s: list[float]
    compute_s: list[float]
    bytes_loaded: list[int]
    preloaded: list[bool]  # the shadow's prediction had loaded it before main asked
    waited_s: list[float]  # how long the call waited for the expert's load (0: it was ready)
    peak_rss: int
    error: str = ""
    # hedged prefetch, this request so far on this worker: [hedge loads, hedges used, bytes hedges loaded]
    hedges: list[int] = field(default_factory=list)
    device_peak_bytes: int = 0  # CUDA's max_memory_allocated in this worker process (0 off CUDA)
    # the worker's time from the call's frames in hand to this result: decoding, checks, waiting for
    # loads, computing (not encoding this, nor sending it): main's round trip less this is the wire's
    handled_s: float = 0.0
    # worker.cache, per expert: the bytes its load would have moved, when the worker's cache had it (0:
    # it was loaded for this call or preloaded for it); and the worker's cache so far
    # (odmoe.worker.expert_cache.CacheBook.report: capacity, cached, hits, misses, bytes saved, evictions,
    # experts it is home for, of them cached, then (layer, evictions) pairs)
    cached: list[int] = field(default_factory=list)
    cache: list[int] = field(default_factory=list)
    part: int = 0  # with per_part mini-batches: which part this answers
    kind: str = "experts_result"


@dataclass(frozen=True)
class Ping:
    shadow_pub: str = ""  # where the shadow publishes predictions; a worker subscribes on first ping
    kind: str = "ping"


@dataclass(frozen=True)
class Release:
    """main -> worker: layer `step.layer` needs nothing from you; drop what you preloaded for it.
    Sent after a decode layer to each worker of its group that no call with `release` set reached."""

    step: Step
    kind: str = "release"


@dataclass(frozen=True)
class Prediction:
    """shadow -> workers of the layer's group and main: the experts the shadow's router chose.

    `candidates`/`probs` are the top-(k+1) router probabilities. `hedges`: experts the shadow also
    asks to preload at low priority, because they nearly tie with a predicted one
    (`odmoe.shadow.hedging`). A later prediction for the same step (after a speculative shadow rolled
    back) supersedes this one.

    With several requests running, `step` is (stream, tick, layer), `experts` the union of every
    running request's choice for that layer (what the workers preload: each once), and
    `requests[i]` chose `request_experts[i]` (main counts recall per request). `candidates`/`probs`
    are then the first request's. One request alone: `requests` is [] and `experts` its own choice.
    """

    step: Step
    experts: list[int]
    candidates: list[int]
    probs: list[float]
    hedges: list[int] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    request_experts: list[list[int]] = field(default_factory=list)
    kind: str = "prediction"


@dataclass(frozen=True)
class ShadowIteration:
    """shadow -> main: the shadow started decode iteration `iteration`.

    `late_departure_s`: how long after main it started (aligned iterations; 0 otherwise): the
    paper's late departure. `alignment_wait_s`: how long it sat idle for main's alignment (it was
    ahead). Both clocks are wall clocks: exact on one machine, as good as their sync on a LAN."""

    request: str
    iteration: int
    late_departure_s: float
    alignment_wait_s: float = 0.0
    previous_forward_s: float = 0.0  # how long its forward pass of iteration-1 took
    ahead: int = 0  # speculative: iterations ahead of the newest one main had reported
    rollbacks: int = 0  # speculative: rollbacks so far in this request
    device_peak_bytes: int = 0  # CUDA's max_memory_allocated in the shadow process (0 off CUDA)
    kind: str = "shadow_iteration"


@dataclass(frozen=True)
class ShadowEnded:
    """shadow -> main: main's EndRequest for `request` reached the shadow, which works on it no more.
    Every prediction it published for the request came before this on the same connection, so main
    stops waiting for late ones here (they will never come) instead of at its deadline."""

    request: str
    kind: str = "shadow_ended"


@dataclass(frozen=True)
class BeginRequest:
    """main -> shadow: a new request; the shadow prefills its own copy from these tokens. Its decode
    iteration n runs in main's batch `stream` at tick `first_tick + n - 1` (one request alone: the
    stream is its own id and iteration n is tick n), which names its predictions."""

    request: str
    prompt_ids: list[int]
    max_new_tokens: int
    stream: str = ""  # "" = the request's own id
    first_tick: int = 1
    kind: str = "begin"


@dataclass(frozen=True)
class Align:
    """main -> shadow, before decode iteration `iteration`: main's input token for it (or -1), and
    when `kv` is set, tensors 0/1 = main's K and V rows computed in iteration-1, [layers, heads, rows, D]."""

    request: str
    iteration: int
    token: int = -1
    kv: bool = False
    sent_at_us: float = 0.0  # main's wall clock when it sent this (it starts iteration `iteration` then)
    next_align: int = 0  # the next iteration main will align (0: none): where a waiting shadow waits
    kind: str = "align"


@dataclass(frozen=True)
class EndRequest:
    request: str
    kind: str = "end"


@dataclass(frozen=True)
class Pong:
    worker: int
    layers: list[int]
    store_bytes: int
    peak_rss: int
    link: list[float] = field(default_factory=list)  # [Gbit/s, ms] of an emulated load link; [] when off
    device_bytes: int = 0  # what its experts take on the compute device (slots, or all when resident)
    where: str = ""  # where it runs, as its launcher names it (cluster.where); shown in main's Info
    device_peak_bytes: int = 0  # CUDA's max_memory_allocated in this worker process (0 off CUDA)
    cache_room: int = 0  # experts its worker.cache may keep (homes follow it: odmoe.placement)
    memory: int = 0  # what the worker's process may use (odmoe.node_memory), bytes
    memory_source: str = ""  # where that figure came from (node.memory, a cgroup limit, MemAvailable)
    # its home experts must all fit its room (worker.store=memory with room from its memory): main
    # refuses to start when the workers' rooms together cannot hold them (odmoe.memory_plan)
    strict_share: bool = False
    kind: str = "pong"


@dataclass(frozen=True)
class LiveWorkers:
    """main -> every live worker (the wire kind "membership"): the workers main now counts as
    live, and where the shadow publishes. Workers deal predictions over these (the same rule main
    places by), so after a worker is lost or rejoins the preloads land where main will send the
    rows. (Not odmoe.main.membership.Membership, main's bookkeeping that sends it.)"""

    live: list[int]
    shadow_pub: str = ""
    rooms: list[int] = field(default_factory=list)  # every worker's cache room, by index ([]: none known)
    # the stragglers main steers decode work away from, and its probe period (odmoe.placement's `slow`)
    slow: list[int] = field(default_factory=list)
    probe_every: int = 0
    slow_rooms: list[int] = field(default_factory=list)  # with homes: the room each of `slow` is dealt by
    kind: str = "membership"


Message = (
    ComputeExperts
    | ExpertsResult
    | Ping
    | Pong
    | Release
    | Prediction
    | ShadowIteration
    | ShadowEnded
    | BeginRequest
    | Align
    | EndRequest
    | LiveWorkers
)
_ALL = typing.get_args(Message)
_KINDS = {cls.kind: cls for cls in _ALL}
# How many tensors a message carries is checked by its receiver, who knows what they mean (a
# ComputeExperts one per expert: the worker; an Align 0 or 2: the shadow; a result: main).


def to_frames(message: Message, tensors: list[torch.Tensor] = ()) -> list:
    # Field by field rather than dataclasses.asdict (which deep-copies every value): on the per-layer
    # path this is a third of a message's encoding cost. A Step travels as a map, as asdict wrote it.
    header = {}
    for name in _names(type(message)):
        value = getattr(message, name)
        if type(value) is Step:
            value = {"request": value.request, "iteration": value.iteration, "layer": value.layer}
        header[name] = value
    return encode(header, tensors)


def from_frames(frames: list) -> tuple[Message, list[torch.Tensor]]:
    header, tensors = decode(frames)
    kind = header.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise CodecError(f"unknown message kind {kind!r:.40}")
    values = {}
    for name, check, where in _checkers(cls):
        if name in header:
            values[name] = check(header[name], where)
    try:
        return cls(**values), tensors
    except TypeError as exc:  # a required field is missing
        raise CodecError(f"{cls.kind}: {exc}") from exc


@functools.cache
def _names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


@functools.cache
def _checkers(cls) -> tuple[tuple[str, Callable, str], ...]:
    """Per field of `cls`: (name, a function `(value, where) -> value as the field's type` that raises
    CodecError, where), built once from the type hints so decoding does no typing introspection."""
    return tuple(
        (name, _checker(hint), f"{cls.kind}.{name}") for name, hint in typing.get_type_hints(cls).items()
    )


def _fail(where: str, value, expected: str):
    raise CodecError(f"{where} is {type(value).__name__}, not {expected}")


def _checker(hint) -> Callable:
    """msgpack gives ints, floats, str, bools, lists, dicts: check one against the field's type."""
    if hint is Step:
        return _step
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        check_item = _checker(item)

        def check_list(value, where):
            if type(value) is not list:
                raise CodecError(f"{where} is not a list")
            return [check_item(v, where) for v in value]

        return check_list
    if hint is float:

        def check_float(value, where):
            if type(value) is float:
                return value
            if type(value) is int:  # msgpack writes 0.0 as a float, but a peer may send an int
                return float(value)
            return value if isinstance(value, float) else _fail(where, value, "float")

        return check_float
    if hint is int:

        def check_int(value, where):
            if type(value) is int:
                return value
            if isinstance(value, bool):
                raise CodecError(f"{where} is a bool, not an int")
            return value if isinstance(value, int) else _fail(where, value, "int")

        return check_int

    def check_other(value, where):
        return value if isinstance(value, hint) else _fail(where, value, hint.__name__)

    return check_other


_check_str, _check_int = _checker(str), _checker(int)


def _step(value, where: str) -> Step:
    if type(value) is not dict or value.keys() != {"request", "iteration", "layer"}:
        raise CodecError(f"{where} is not a step")
    return Step(
        _check_str(value["request"], f"{where}.request"),
        _check_int(value["iteration"], f"{where}.iteration"),
        _check_int(value["layer"], f"{where}.layer"),
    )
