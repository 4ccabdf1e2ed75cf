"""The data path's observers (odmoe/main/exchange_observers.py): they watch, never change what is computed;
the accounting splits what requests shared so the requests' sums are the totals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from odmoe.main.engine import DoneEvent, GenerateRequest, TokenEvent
from odmoe.main.exchange_observers import (
    DecodeExchange,
    ExchangeObserver,
    Observers,
    PrefillExchange,
    TrafficAccounting,
)
from odmoe.main.expert_traffic import ExpertTraffic
from odmoe.main.inprocess import engine_in_process
from odmoe.transport.messages import ExpertsResult, Prediction, Step

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def _tokens(engine) -> tuple[list[int], dict]:
    events = list(engine.generate(GenerateRequest("def fibonacci(n):", max_new_tokens=6, request_id="o")))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return [e.token_id for e in events if isinstance(e, TokenEvent)], done.stats


def test_without_any_observer_the_tokens_are_the_same(model_dirs):
    watched, _ = engine_in_process(model_dirs["mixtral"], max_running=4)
    bare, _ = engine_in_process(model_dirs["mixtral"], max_running=4)
    bare.experts.observe = Observers()  # no accounting, no timeline
    tokens, stats = _tokens(watched)
    bare_tokens, bare_stats = _tokens(bare)
    assert bare_tokens == tokens
    assert stats["decode"]["layers"] > 0 and stats["experts_loaded"] > 0
    assert bare_stats["decode"]["layers"] == 0 and bare_stats["experts_loaded"] == 0


def test_an_observer_sees_every_layer_once_in_order(model_dirs):
    class Seen(ExchangeObserver):
        def __init__(self):
            self.calls: list[tuple[str, int, int]] = []

        def layer_called(self, ctx, layer):
            self.calls.append(("called", ctx.iteration, layer))

        def prefill_done(self, exchange):
            self.calls.append(("prefill", exchange.step.iteration, exchange.step.layer))

        def decode_done(self, exchange):
            self.calls.append(("decode", exchange.step.iteration, exchange.step.layer))

    engine, _ = engine_in_process(model_dirs["mixtral"], max_running=4)
    seen = Seen()
    engine.experts.observe.add(seen)
    tokens, _ = _tokens(engine)
    done = [c for c in seen.calls if c[0] != "called"]
    called = [c[1:] for c in seen.calls if c[0] == "called"]
    assert [c[1:] for c in done] == called  # every call ends in exactly one record, in order
    assert {kind for kind, it, _ in done if it == 0} == {"prefill"}
    assert {it for kind, it, _ in done if kind == "decode"} == set(range(1, len(tokens)))


def _ctx(request: str):
    return SimpleNamespace(request=request, iteration=3, traffic=ExpertTraffic())


def test_two_requests_sharing_an_expert_each_pay_half():
    a, b = _ctx("a"), _ctx("b")
    rows = [SimpleNamespace(ctx=a, experts=[1, 2]), SimpleNamespace(ctx=b, experts=[2])]
    result = ExpertsResult(
        Step("s", 3, 0),
        0,
        [1, 2],
        load_s=[0.0, 0.4],
        compute_s=[0.1, 0.2],
        bytes_loaded=[0, 800],
        preloaded=[True, False],
        waited_s=[0.0, 0.3],
        peak_rss=1,
    )
    x = DecodeExchange(
        step=Step("s", 3, 0),
        batch=rows,
        prediction=Prediction(
            Step("s", 3, 0), [1, 3], [], [], requests=["a", "b"], request_experts=[[1], [3]]
        ),
        users={1: [(0, None)], 2: [(0, None), (1, None)]},
        calls=[SimpleNamespace(answer=(result, []))],
        entered=1.0,
        started=1.5,
        gathered=2.0,
        combined=2.5,
    )
    TrafficAccounting().decode_done(x)
    ta, tb = a.traffic, b.traffic
    assert ta.bytes_loaded + tb.bytes_loaded == 800 and tb.bytes_loaded == 400
    assert ta.decode.experts == 1.5 and tb.decode.experts == 0.5
    assert abs(ta.compute_s + tb.compute_s - 0.3) < 1e-12
    assert ta.preloaded == 1 and ta.reloads == 1 and tb.reloads == 1
    assert ta.stall_s_per_layer == {0: 0.3} == tb.stall_s_per_layer
    assert ta.decode.wait_s == 0.5 and ta.decode.layers == 1
    assert ta.timely_recall.report()["activated"] == 2 and tb.wrong_predictions(3) == (1, 1)


def test_a_prefill_layer_counts_its_busiest_worker_as_the_critical_path():
    ctx = _ctx("p")
    x = PrefillExchange(ctx=ctx, step=Step("p", 0, 2), experts=3, waited=1.0, resent={0: 1})
    for worker, load, compute in ((0, 0.2, 0.1), (1, 0.5, 0.1), (0, 0.1, 0.1)):
        x.answers.append(
            ExpertsResult(Step("p", 0, 2), worker, [0], [load], [compute], [8], [False], [0.0], 1)
        )
    TrafficAccounting().prefill_done(x)
    p = ctx.traffic.prefill
    assert abs(p.critical_s - 0.6) < 1e-12 and p.experts_per_layer == {2: 3} and p.wait_s == 1.0
    assert ctx.traffic.resent == 1 and ctx.traffic.wait_s == 1.0 and ctx.traffic.bytes_loaded == 24
