"""Batched decode (odmoe/main/batched_decode.py): one pass through main's layers for every decoding
request, each request's logits bit for bit those of its own batch-of-one forward pass.

The pure part (RowExact) against per-row `linear`; the whole pass through the in-process
engine (real RemoteExperts, codec and expert math) against the same requests alone, bit for bit in
the final logits, for each family it serves; the families it does not serve fall back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from odmoe.main.batched_decode import FAMILIES, RowExact
from odmoe.main.engine import DoneEvent, GenerateRequest, TokenEvent
from odmoe.main.inprocess import engine_in_process
from odmoe.main.request_queue import END, RequestQueue
from odmoe.main.sampling import SamplingParams

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def _per_row(x, weight, bias):
    return torch.cat([F.linear(x[b : b + 1], weight, bias) for b in range(x.shape[0])])


@pytest.mark.parametrize("rows", [2, 3, 8])
@pytest.mark.parametrize("shape", [(1, 64), (64,)])  # decoder rows [B, 1, H] and router rows [B, H]
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_exact_linear_equals_each_row_alone(rows, shape, bias, dtype):
    torch.manual_seed(rows)
    x = torch.randn(rows, *shape, dtype=dtype)
    weight = torch.randn(96, 64, dtype=dtype)
    b = torch.randn(96, dtype=dtype) if bias else None
    mode = RowExact()
    with mode:
        y = F.linear(x, weight, b)
        again = torch.nn.functional.linear(x, weight, bias=b)
    assert torch.equal(y, _per_row(x, weight, b))
    assert torch.equal(again, y)
    assert len(mode.verdicts) == 1  # one comparison per shape, then its verdict is reused


def test_row_exact_linear_goes_row_by_row_where_bmm_differs():
    """A shape whose bmm was found to differ is computed one request at a time (what a BLAS that
    picks another kernel for a batch would need): still each row's own bits."""
    x, weight = torch.randn(4, 1, 32), torch.randn(16, 32)
    mode = RowExact()
    mode.verdicts[(tuple(x.shape), tuple(weight.shape), x.dtype, weight.dtype, False, "cpu")] = False
    with mode:
        y = F.linear(x, weight)
    assert torch.equal(y, _per_row(x, weight, None))


def test_a_first_input_that_happens_to_agree_proves_no_shape_exact():
    """A router-gate shape ([2, 48] x [1, 48]: alone, a dot product) whose first input gave bmm the
    one-row bits (zeros always do), yet other inputs do not: the verdict is taken on random inputs
    of the shape too, so every later call is still each row's own."""
    x, weight = torch.randn(2, 48), torch.randn(1, 48)
    mode = RowExact()
    mode.rows = 2
    with mode:
        F.linear(torch.zeros_like(x), weight)  # the first call: both ways give zeros
        for seed in range(20):
            x = torch.randn(2, 48, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(F.linear(x, weight), _per_row(x, weight, None)), seed


def test_two_request_passes_stay_each_requests_own(tmp_path):
    """Two requests decoding together (a pass of 2 rows), on the shapes where a 2-row gate's first
    call agreed by chance: each request's final logits still equal its alone run."""
    from odmoe.tools.model_factory import ModelSpec, make_model

    spec = dict(family="qwen2_moe", hidden=48, heads=4, kv_heads=2, experts=12, top_k=4)
    path = make_model(ModelSpec(vocab=1024, max_positions=256, **spec), tmp_path / "qwen2_moe")
    engine, _ = engine_in_process(str(path), max_running=2)
    got = serve_with_logits(engine, _requests())
    for request in _requests():
        tokens, final = _alone(engine, request)
        assert got[request.request_id][0] == tokens
        assert torch.equal(got[request.request_id][1], final), request.request_id


def test_other_ops_and_one_row_pass_through():
    x, weight = torch.randn(1, 1, 32), torch.randn(16, 32)
    mode = RowExact()
    with mode:
        assert torch.equal(F.linear(x, weight), torch.nn.functional.linear(x, weight))
        assert torch.equal(torch.softmax(x, -1), x.softmax(-1))
    assert mode.verdicts == {}  # one row: transformers' own call, nothing compared


PROMPTS = [
    "def fibonacci(n):",
    "x = [",
    "import os\n\nclass Config:\n    ",
    "for i in range(10):\n    print(",
]
SEEDED = SamplingParams(do_sample=True, temperature=0.8, seed=7)


def _requests(tokens: int = 9) -> list[GenerateRequest]:
    """Greedy and seeded (alternating), prompts and lengths differing: requests join the pass as
    their prefills end and leave it as they finish."""
    return [
        GenerateRequest(
            p,
            max_new_tokens=tokens - i,
            request_id=f"r{i}",
            sampling=SEEDED if i % 2 else SamplingParams(),
            return_logits=True,
        )
        for i, p in enumerate(PROMPTS)
    ]


def _alone(engine, request: GenerateRequest) -> tuple[list[int], torch.Tensor]:
    tokens, final = [], None
    for event in engine.generate(request):
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        elif isinstance(event, DoneEvent):
            final = event.final_logits
    return tokens, final


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_gives_each_request_its_alone_bits(model_dirs, family, dtype):
    path = model_dirs[family]
    engine, _ = engine_in_process(path, dtype, max_running=4)
    assert engine.batched is not None
    passes = []
    step = engine.batched.step
    engine.batched.step = lambda inputs, *rest: passes.append(len(inputs)) or step(inputs, *rest)
    got = serve_with_logits(engine, _requests())
    assert max(passes) == 4 and min(passes) >= 2  # every request was in a batched pass
    for request in _requests():
        tokens, final = _alone(engine, request)  # one request alone: transformers' own forward
        assert got[request.request_id][0] == tokens
        assert torch.equal(got[request.request_id][1], final)


def serve_with_logits(engine, requests) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Every request submitted at once: its tokens and final logits (return_logits)."""
    queue = RequestQueue(64, 1e9)
    tickets = {r.request_id: queue.submit(r) for r in requests}

    def stopped() -> bool:
        return all(t.events.queue and t.events.queue[-1] is END for t in tickets.values())

    engine.serve(queue, stopped)
    out = {}
    for rid, ticket in tickets.items():
        events = list(ticket.events.queue)
        done = events[-2]
        assert isinstance(done, DoneEvent), events
        out[rid] = ([e.token_id for e in events if isinstance(e, TokenEvent)], done.final_logits)
    return out


def test_batched_and_per_request_decode_agree_on_every_bit(model_dirs):
    """`server.decode=per_request` (transformers' forward per request) and the default batched pass
    give the same tokens and final logits for the same requests decoding together."""
    path = model_dirs["mixtral"]
    batched, _ = engine_in_process(path, max_running=4)
    apart, _ = engine_in_process(path, max_running=4, batched_decode=False)
    assert batched.batched is not None and apart.batched is None
    a, b = serve_with_logits(batched, _requests(12)), serve_with_logits(apart, _requests(12))
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][0] == b[rid][0]
        assert torch.equal(a[rid][1], b[rid][1])


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss", "llama4_text"])
def test_families_it_does_not_replay_decode_per_request(model_dirs, family):
    engine, _ = engine_in_process(model_dirs[family], max_running=4)
    assert engine.batched is None


def test_server_decode_is_validated():
    from odmoe.config import OdmoeConfig
    from odmoe.validation import validate

    cfg = OdmoeConfig()
    assert cfg.server.decode == "batched"
    validate(cfg)
    cfg.server.decode = "fast"
    with pytest.raises(ValueError, match="server.decode must be batched or per_request"):
        validate(cfg)


def test_a_sliding_window_mask_is_each_requests_own(model_dirs, tmp_path):
    """Mixtral with a sliding window shorter than the prompts: each request's mask is built as its
    own forward pass builds it (the window cuts its oldest positions), bit for bit."""
    import json
    import shutil

    path = tmp_path / "mixtral-sliding"
    shutil.copytree(model_dirs["mixtral"], path)
    config = json.loads((path / "config.json").read_text())
    config["sliding_window"] = 5
    (path / "config.json").write_text(json.dumps(config))
    engine, _ = engine_in_process(str(path), max_running=4)
    assert engine.batched is not None and engine.main.model.config.sliding_window == 5
    got = serve_with_logits(engine, _requests())
    for request in _requests():
        tokens, final = _alone(engine, request)
        assert got[request.request_id][0] == tokens
        assert torch.equal(got[request.request_id][1], final)


def test_a_release_naming_the_cache_otherwise_decodes_per_request(model_dirs, monkeypatch):
    """The pass hands transformers' layers the K/V cache as `cache`; a release calling it something
    else would take the batch's cache as an unknown keyword and attend without it."""
    from odmoe.main import batched_decode

    engine, _ = engine_in_process(model_dirs["mixtral"], max_running=4)
    assert batched_decode.BatchedDecode.supports(engine.main)

    def old_mask(config, inputs_embeds, attention_mask, past_key_values, position_ids): ...

    monkeypatch.setattr(batched_decode, "create_causal_mask", old_mask)
    assert not batched_decode.BatchedDecode.supports(engine.main)


@pytest.mark.parametrize(
    "spec",
    [
        # top-4 of 12 (the router's top-k sum over k > 2; a short row of expert scores), head_dim 12
        dict(family="qwen3_moe", hidden=48, heads=4, kv_heads=2, experts=12, top_k=4),
        dict(family="mixtral", hidden=48, heads=4, kv_heads=2, experts=12, top_k=4),
        dict(family="qwen2_moe", hidden=48, heads=4, kv_heads=2, experts=12, top_k=4),
        dict(family="glm4_moe", hidden=64, heads=4, kv_heads=2, experts=16, top_k=4, intermediate=32),
    ],
    ids=lambda spec: f"{spec['family']}-top{spec['top_k']}of{spec['experts']}",
)
def test_rows_in_loop_tails_and_top_k_sums_stay_each_requests_own(spec, tmp_path):
    """Shapes where a request's row alone is a SIMD loop's tail and among others its body, and
    router sums over more than two values: each request's final logits still equal its alone run."""
    from odmoe.tools.model_factory import ModelSpec, make_model

    path = make_model(ModelSpec(vocab=1024, max_positions=256, **spec), tmp_path / spec["family"])
    engine, _ = engine_in_process(str(path), max_running=4)
    assert engine.batched is not None
    got = serve_with_logits(engine, _requests())
    for request in _requests():
        tokens, final = _alone(engine, request)
        assert got[request.request_id][0] == tokens
        assert torch.equal(got[request.request_id][1], final)


def test_reductions_run_per_request_only_over_a_requests_own_dims():
    """The mode reduces each request's rows alone when the call reduces over other dims than the
    first (wherever `dim` sits in its signature); a reduction over the first dim or everything is
    left whole (it would mix requests, so a pass never computes one)."""
    x = torch.randn(3, 4, 5)
    mode = RowExact()
    mode.rows = 3
    calls = []
    per_row = mode._per_row

    def counting(func, args, kwargs, unary=False):
        out = per_row(func, args, kwargs, unary)
        calls.append(func)
        return out

    mode._per_row = counting
    cases = {
        "sum last": lambda: x.sum(-1),
        "topk k=2 default dim": lambda: torch.topk(x, 2).values,
        "topk positional dim 1": lambda: torch.topk(x, 2, 1).indices,
        "topk positional dim 0": lambda: torch.topk(x, 2, 0).values,
        "norm p=2 over dim 0": lambda: torch.norm(x, 2, 0),
        "softmax dim 2": lambda: torch.softmax(x, 2),
        "normalize default dim 1": lambda: F.normalize(x),
        "sum all": lambda: x.sum(),
        "sigmoid": lambda: x.sigmoid(),
    }
    for name, call in cases.items():
        with mode:
            got = call()
        want = call()
        assert got.shape == want.shape and torch.allclose(got, want), name
    assert len(calls) == len(cases)
