"""What one exchange between main and its workers is made of, as the data path and its observers
(odmoe.main.exchange_observers) both name it: a running request's context, one request's rows of a
decode layer, one batched call to a worker, and the forward pass a layer's call belongs to
(`ForwardPass`, passed down to the experts call by `forward_pass`). Plain records: this module
imports neither side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from odmoe.lossy.miss_policy import TokenBudget
from odmoe.main.expert_traffic import ExpertTraffic
from odmoe.models.expert_math import ExpertRows
from odmoe.transport.messages import ExpertsResult


@dataclass
class RunContext:
    """One running request as the data plane sees it: its name, the iteration its forward pass is
    computing (0: prefill), and what its exchanges cost it."""

    request: str
    iteration: int = 0
    traffic: ExpertTraffic = field(default_factory=ExpertTraffic)
    budget: TokenBudget | None = None  # lossy miss policy: substitutions left to this token

    def begin(self, iteration: int) -> None:
        self.iteration = iteration
        if self.budget is not None:
            self.budget.reset()


@dataclass(frozen=True)
class ForwardPass:
    """Whose forward pass calls the experts: its request (`runs[0]`), or in the batched decode pass
    one request per row (`rows`: row b of every call is `runs[b]`'s), and the decode tick the pass
    belongs to, which names its exchanges `(stream, tick, layer)`."""

    runs: tuple[RunContext, ...]
    stream: str = ""
    tick: int = 0
    rows: bool = False


# The pass running on this thread, or in this lockstep task: greenlets keep a context each, so every
# request's forward pass sees its own even while several are parked at the same layer.
_PASS: ContextVar[ForwardPass | None] = ContextVar("odmoe_forward_pass", default=None)


@contextlib.contextmanager
def forward_pass(running: ForwardPass | None) -> Iterator[None]:
    """The experts calls made inside this block belong to `running` (the engine wraps each forward
    pass it runs; transformers' model classes between it and the experts call pass nothing down).
    None: to none (work done between the layers of another pass)."""
    token = _PASS.set(running)
    try:
        yield
    finally:
        _PASS.reset(token)


def current_pass() -> ForwardPass:
    """The forward pass an experts call belongs to (RuntimeError outside `forward_pass`)."""
    running = _PASS.get()
    if running is None:
        raise RuntimeError("the experts were called outside a forward pass (exchange_records.forward_pass)")
    return running


@dataclass
class DecodeRows:
    """One request's share of a decode layer: its token's row, its router's choice, its groups."""

    ctx: RunContext
    layer: int
    hidden: torch.Tensor  # [1, H]
    top_k_index: torch.Tensor  # [1, k]
    top_k_weights: torch.Tensor  # [1, k]
    groups: list[ExpertRows]  # the experts it routes to, ascending
    stand_in: dict[int, int]  # lossy only: missing expert -> the resident one computed instead

    @property
    def experts(self) -> list[int]:
        return [rows.expert for rows in self.groups]

    def computed(self, expert: int) -> int:
        return self.stand_in.get(expert, expert)


@dataclass
class BatchCall:
    """One call to a worker: a decode layer's experts placed on it (one ComputeExperts), or one
    expert of a prefill (in mini-batch messages), and its answers."""

    worker: int
    experts: list[int]
    releases: bool = False  # it says the layer is over for its worker (re-sent calls never do)
    expected: int = 1  # answers to wait for: a prefill's mini-batches computed one by one, else 1
    answers: dict[int, tuple[ExpertsResult, list[torch.Tensor]]] = field(default_factory=dict)  # by part
    sent_at: float = 0.0  # main's perf_counter when the call left
    # main's round trip less the worker's own time (ExpertsResult.handled_s): the wire's both ways
    wire_s: float = 0.0
    answered_at: float = 0.0  # main's perf_counter when its (last) answer was in hand
    again: bool = False  # a late call's experts sent again to another worker (odmoe.main.late_calls)

    @property
    def done(self) -> bool:
        return len(self.answers) == self.expected

    @property
    def answer(self) -> tuple[ExpertsResult, list[torch.Tensor]] | None:
        """The (first part's) answer, once every part is in."""
        return self.answers[0] if self.done else None

    def outputs(self) -> list[torch.Tensor]:
        """Each expert's output rows, its parts joined in order (a done call's)."""
        if self.expected == 1:
            return self.answers[0][1]
        return [
            torch.cat([self.answers[p][1][i] for p in range(self.expected)]) for i in range(len(self.experts))
        ]
