"""The decode loop with in-process workers (odmoe/main/inprocess.py: the real engine, RemoteExperts, codec
and expert math, no sockets) against transformers: fast, so the batching logic is checked over many
schedules here, and through real clusters in tests/test_batching.py."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from odmoe.main.engine import DoneEvent, GenerateRequest, TokenEvent
from odmoe.main.inprocess import engine_in_process
from odmoe.main.request_queue import END, RequestQueue
from odmoe.main.sampling import SamplingParams

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\nclass Config:\n    ",
    "x = [",
    "for i in range(10):\n    print(",
]
SAMPLINGS = [SamplingParams(), SamplingParams(do_sample=True, temperature=0.8, seed=5)]


@functools.cache
def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@functools.cache
def reference(path: str, prompt: str, new_tokens: int, sampling: int) -> tuple[int, ...]:
    model, tok = _hf(path)
    params = SAMPLINGS[sampling]
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    if params.do_sample:
        torch.manual_seed(params.seed)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, **params.generate_kwargs()
    )
    return tuple(out[0, ids.shape[1] :].tolist())


@functools.cache
def _engine(path: str, chunk_tokens: int, stagger: bool = True):
    engine, _ = engine_in_process(path, max_running=4, chunk_tokens=chunk_tokens, stagger=stagger)
    return engine


def serve(
    engine,
    arrivals: dict[int, list[GenerateRequest]],
    queue: RequestQueue | None = None,
    tickets=None,
    during: list[tuple[int, GenerateRequest]] = (),
) -> dict[str, list[int]]:
    """Run the engine until every request is over; `arrivals`: loop turn -> requests submitted then
    (`queue`, `tickets`: where a test submits more, and keeps their tickets, as it likes);
    `during`: (turn, request) submitted at the first decode exchange of two or more requests from
    that loop turn on, i.e. during a pass (at the boundary of turn + 3 at the latest)."""
    queue = queue or RequestQueue(64, 1e9)
    tickets, turn = ({} if tickets is None else tickets), [0]
    pending = sorted(during, key=lambda d: d[0])

    def submit_pending(latest: int) -> None:
        for item in [d for d in pending if d[0] <= latest]:
            pending.remove(item)
            tickets[item[1].request_id] = queue.submit(item[1])

    def between() -> None:
        for request in arrivals.get(turn[0], []):
            tickets[request.request_id] = queue.submit(request)
        submit_pending(turn[0] - 3)
        turn[0] += 1

    exchange = engine.experts.exchange_decode

    def exchange_decode(layer, batch):
        if len(batch) > 1:
            submit_pending(turn[0])
        return exchange(layer, batch)

    def stopped() -> bool:
        done = all(t.events.queue and t.events.queue[-1] is END for t in tickets.values())
        return turn[0] > max(arrivals, default=0) and not pending and done

    engine.experts.exchange_decode = exchange_decode
    try:
        engine.serve(queue, stopped, between)
    finally:
        engine.experts.exchange_decode = exchange
    out = {}
    for rid, ticket in tickets.items():
        events = list(ticket.events.queue)
        assert not [e for e in events if isinstance(e, Exception)], events
        assert isinstance(events[-2], DoneEvent)
        out[rid] = [e.token_id for e in events if isinstance(e, TokenEvent)]
    return out


def check_batched_equal_alone(path: str, prompts: list[str], dtype=torch.float32) -> None:
    """Greedy and seeded requests (alternating) decoding together in process, each equal to
    transformers alone; `dtype`: what main computes in, as transformers loads the checkpoint."""
    engine, _ = engine_in_process(path, dtype, max_running=4)
    requests = [
        GenerateRequest(p, max_new_tokens=10, request_id=f"r{i}", sampling=SAMPLINGS[i % 2])
        for i, p in enumerate(prompts)
    ]
    want = {f"r{i}": list(reference(path, p, 10, i % 2)) for i, p in enumerate(prompts)}
    assert serve(engine, {0: requests}) == want


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    schedule=st.lists(
        st.tuples(
            st.integers(0, 6),  # the loop turn it arrives at: joins mid-stream
            st.integers(0, len(PROMPTS) - 1),
            st.integers(1, 12),  # lengths differ: requests leave mid-stream
            st.integers(0, len(SAMPLINGS) - 1),
            st.booleans(),  # arrives during a decode pass rather than at a loop turn
        ),
        min_size=1,
        max_size=6,  # beyond max_running=4: some wait for a place
    ),
    chunk_tokens=st.sampled_from([0, 3]),
    stagger=st.booleans(),
)
def test_any_schedule_gives_every_request_its_alone_tokens(model_dirs, schedule, chunk_tokens, stagger):
    path = model_dirs["qwen2_moe"]
    arrivals: dict[int, list[GenerateRequest]] = {}
    during: list[tuple[int, GenerateRequest]] = []
    wanted = {}
    for i, (turn, prompt, n, sampling, mid_pass) in enumerate(schedule):
        rid = f"r{i}"
        request = GenerateRequest(
            PROMPTS[prompt], max_new_tokens=n, sampling=SAMPLINGS[sampling], request_id=rid
        )
        if mid_pass:
            during.append((turn, request))
        else:
            arrivals.setdefault(turn, []).append(request)
        wanted[rid] = list(reference(path, PROMPTS[prompt], n, sampling))
    assert serve(_engine(path, chunk_tokens, stagger), arrivals, during=during) == wanted


class _Ticks:
    """An engine observer that keeps (running, decoding) of every tick."""

    def __init__(self):
        self.seen: list[tuple[int, int]] = []

    def tick(self, running: int, decoding: int) -> None:
        self.seen.append((running, decoding))

    def token(self, ticket) -> None: ...
    def finished(self, ticket, stats: dict) -> None: ...
    def ended(self, ticket, how: str) -> None: ...


@pytest.mark.parametrize("stagger", [True, False])
def test_prompts_arriving_together_prefill_a_tick_each(model_dirs, stagger):
    """Staggered (the default), 3 prompts arriving at once start decoding in 3 successive ticks (one
    prompt's prefill per tick, the streams running wait for one), and so finish in 3 different ticks;
    not staggered, all 3 prefill in the first tick. Tokens are each request's alone either way."""
    path = model_dirs["mixtral"]
    engine, _ = engine_in_process(path, max_running=4, stagger=stagger)
    engine.observer = ticks = _Ticks()
    requests = [GenerateRequest(p, max_new_tokens=6, request_id=f"r{i}") for i, p in enumerate(PROMPTS[:3])]
    got = serve(engine, {0: requests})
    assert got == {f"r{i}": list(reference(path, p, 6, 0)) for i, p in enumerate(PROMPTS[:3])}
    decoding = [d for _, d in ticks.seen]
    assert decoding[:4] == ([0, 1, 2, 3] if stagger else [0, 3, 3, 3])
    assert decoding[-3:] == ([3, 2, 1] if stagger else [3, 3, 3])


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "deepseek_v3"])
def test_requests_batched_from_the_start_equal_alone(model_dirs, family):
    path = model_dirs[family]
    engine, workers = engine_in_process(path, max_running=4)
    requests = [GenerateRequest(p, max_new_tokens=10, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    got = serve(engine, {0: requests})
    assert got == {f"r{i}": list(reference(path, p, 10, 0)) for i, p in enumerate(PROMPTS)}


def test_one_message_per_worker_and_decode_layer_whatever_the_batch(model_dirs):
    """4 requests decoding together send as many decode messages as 1 does: one per worker and layer
    (top-2 on a group of 2: both workers, every layer). Prefilled in one tick (`stagger=False`), the
    four decode in the same ticks from their first token on."""
    path = model_dirs["mixtral"]
    counts = []
    for batch in (1, 4):
        engine, workers = engine_in_process(path, max_running=4, workers=2, group_size=2, stagger=False)
        requests = [GenerateRequest(PROMPTS[0], max_new_tokens=9, request_id=f"r{i}") for i in range(batch)]
        serve(engine, {0: requests})
        counts.append(workers.decode_messages)
    assert counts[0] == counts[1] == 8 * 4 * 2  # 8 decode iterations x 4 layers x 2 workers


def test_n_choices_share_the_prefill_and_each_equals_its_seed(model_dirs):
    path = model_dirs["mixtral"]
    engine, workers = engine_in_process(path, max_running=4)
    requests = [
        GenerateRequest(
            PROMPTS[1],
            max_new_tokens=8,
            sampling=SamplingParams(do_sample=True, temperature=0.8, seed=5 + i),
            request_id=f"c{i}",
            prefill_group="g",
        )
        for i in range(3)
    ]
    got = serve(engine, {0: requests})
    for i in range(3):
        model, tok = _hf(path)
        ids = tok(PROMPTS[1], return_tensors="pt")["input_ids"]
        torch.manual_seed(5 + i)
        want = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.8, max_new_tokens=8
        )
        assert got[f"c{i}"] == want[0, ids.shape[1] :].tolist()
    prefill = workers.messages - workers.decode_messages
    alone, alone_workers = engine_in_process(path, max_running=4)
    serve(alone, {0: requests[:1]})
    assert prefill == alone_workers.messages - alone_workers.decode_messages  # one prefill, not three


def test_main_spans_reach_the_trace_file_when_a_request_is_done(model_dirs, tmp_path):
    """A regression: the batching engine never flushed main's tracer, so the timeline suite had no
    main lane (and drew no figure)."""
    from odmoe.tools.trace import Tracer

    engine, _ = engine_in_process(model_dirs["mixtral"], max_running=4)
    engine.experts.tracer = Tracer("main", str(tmp_path))
    events = list(engine.generate(GenerateRequest(PROMPTS[0], max_new_tokens=4, request_id="t")))
    assert isinstance(events[-1], DoneEvent)
    spans = [json.loads(line) for line in (tmp_path / "main.jsonl").read_text().splitlines()]
    decode = {e["args"]["iteration"] for e in spans if e["ph"] == "X" and e["args"].get("iteration", 0) >= 1}
    assert decode == {1, 2, 3}


@pytest.mark.parametrize("stagger", [True, False])
def test_a_prompt_arriving_mid_pass_prefills_at_the_next_layer(model_dirs, stagger):
    """A request submitted while the batched decode pass is at its first MoE layer is prefilled
    between two layers of that pass (staggered, the default), not after the pass and at the next
    tick; its tokens, and the others', are each one's alone tokens either way."""
    path = model_dirs["mixtral"]
    engine, _ = engine_in_process(path, max_running=4, stagger=stagger)
    late = GenerateRequest(PROMPTS[3], max_new_tokens=5, request_id="late", sampling=SAMPLINGS[1])
    first = [GenerateRequest(p, max_new_tokens=6, request_id=f"r{i}") for i, p in enumerate(PROMPTS[:2])]
    got = serve(engine, {0: first}, during=[(0, late)])
    want = {f"r{i}": list(reference(path, p, 6, 0)) for i, p in enumerate(PROMPTS[:2])}
    want["late"] = list(reference(path, PROMPTS[3], 5, 1))
    assert got == want
    assert engine.prefilled_in_pass == (1 if stagger else 0)


def test_every_decode_iteration_runs_in_the_tick_the_shadow_was_told(model_dirs):
    """The shadow names a request's predictions by main's tick: decode iteration n runs at tick
    `first_tick + n - 1`, told at admission. That holds for prompts admitted during a pass too:
    one that prefills there at once, and a scored or chunked one, which waits for the next tick."""
    path = model_dirs["mixtral"]
    engine, _ = engine_in_process(path, max_running=4, chunk_tokens=3)
    seen: list[tuple[str, int, int, int]] = []  # request, iteration, tick it ran in, its first_tick
    accept = engine._accept

    def accept_and_note(ticket, run, logits):
        seen.append((run.request_id, run.iteration, engine.tick, run.schedule.admission.first_tick))
        return accept(ticket, run, logits)

    engine._accept = accept_and_note
    first = [GenerateRequest(PROMPTS[i], max_new_tokens=24, request_id=f"r{i}") for i in (0, 2)]
    during = [  # each comes while r0 and r2 decode in a pass and no other prompt prefills
        (4, GenerateRequest(PROMPTS[2], max_new_tokens=5, request_id="scored", prompt_logprobs=True)),
        (10, GenerateRequest(PROMPTS[1], max_new_tokens=5, request_id="chunked")),
        (18, GenerateRequest(PROMPTS[2], max_new_tokens=5, request_id="plain")),  # <= 3 tokens: whole
    ]
    got = serve(engine, {0: first}, during=during)
    assert got["plain"] == got["scored"] == list(reference(path, PROMPTS[2], 5, 0))
    assert got["chunked"] == list(reference(path, PROMPTS[1], 5, 0))
    assert engine.prefilled_in_pass == 1  # the plain one
    decodes = [(rid, n, tick, first_tick) for rid, n, tick, first_tick in seen if n >= 1]
    assert {rid for rid, *_ in decodes} == {"r0", "r2", "scored", "chunked", "plain"}
    assert [(rid, n, tick) for rid, n, tick, f in decodes if tick != f + n - 1] == []
