"""The per-layer data plane's fast paths (issue 13.4): the hand-written header encoding is the same
wire format asdict wrote, decoding checks exactly what it did, and main sends no message per layer
that nothing needs. Timings are the `dataplane` suite's, never asserted here."""

import warnings
from dataclasses import asdict

import msgpack
import pytest
import torch
import zmq

from odmoe.main.exchange_records import ForwardPass, forward_pass
from odmoe.main.membership import Membership
from odmoe.main.remote_experts import RemoteExperts
from odmoe.models.checkpoint import Checkpoint
from odmoe.placement import Topology
from odmoe.transport.codec import CodecError, decode, encode
from odmoe.transport.messages import (
    _ALL,
    Align,
    ComputeExperts,
    ExpertsResult,
    LiveWorkers,
    Pong,
    Prediction,
    Release,
    Step,
    from_frames,
    to_frames,
)

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

STEP = Step("r-1", 3, 2)
SAMPLES = [
    ComputeExperts.single(STEP, 6, "bmm", 2, part=1, parts=3, per_part=True, positions=[[0, 3]]),
    ComputeExperts(STEP, [1, 6], [[1], [1, 1]], "grouped_mm", [2, 8], release=True),
    ExpertsResult(
        STEP, 1, [1, 6], [0.5, 0.0], [0.25, 0.5], [7, 0], [False, True], [0.125, 0.0], 9, hedges=[1, 0, 2]
    ),
    ExpertsResult(STEP, 1, [6], [0.5], [0.25], [7], [True], [0.125], 8, part=2),
    Pong(1, [0, 2], 10, 11, [8.0, 0.1], 12),
    Release(STEP),
    Prediction(STEP, [1, 4], [1, 4, 5], [0.5, 0.25, 0.125]),
    Prediction(STEP, [1, 4, 2], [1, 4, 5], [0.5, 0.25, 0.125], [5], ["r-1", "r-2"], [[1, 4], [2, 4]]),
    Align("r-1", 4, 9, True, 1.5),
    LiveWorkers([0, 1], "tcp://127.0.0.1:5"),
]


def test_samples_cover_every_kind_with_steps():
    assert {type(m) for m in SAMPLES} >= {cls for cls in _ALL if "step" in cls.__dataclass_fields__}


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.kind)
def test_header_is_the_wire_format_asdict_wrote(message):
    """Peers of an older build decode what this one sends, and the other way round."""
    tensors = [torch.ones(1, 2)] if message.kind == "compute_experts" else []
    meta = [["float32", [1, 2]]] if tensors else []
    frames = to_frames(message, tensors)
    assert msgpack.unpackb(frames[0]) == {**asdict(message), "_tensors": meta}
    assert from_frames([msgpack.packb({**asdict(message), "_tensors": meta}), *frames[1:]])[0] == message


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.kind)
def test_every_kind_round_trips_through_received_frames(message):
    tensors = [torch.ones(2, 3)] if message.kind == "compute_experts" else []
    frames = [zmq.Frame(bytes(f)) for f in to_frames(message, tensors)]  # as recv_multipart(copy=False)
    back, got = from_frames(frames)
    assert back == message and type(back.step if hasattr(back, "step") else back) is not dict
    assert [t.tolist() for t in got] == [t.tolist() for t in tensors]


def _compute_header(**changes) -> bytes:
    h = {**asdict(ComputeExperts.single(STEP, 6, "eager", 1)), "_tensors": [["float32", [1, 2]]]}
    h.update(changes)
    return msgpack.packb(h)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"experts": [True]}, "bool"),
        ({"experts": [1.5]}, "float, not int"),
        ({"segments": [1]}, "not a list"),
        ({"kernel": 3}, "int, not str"),
        ({"per_part": 1}, "int, not bool"),
        ({"step": {"request": "r", "iteration": 1}}, "not a step"),
        ({"step": {"request": "r", "iteration": 1, "layer": 2, "x": 0}}, "not a step"),
        ({"step": {"request": "r", "iteration": 1, "lay": 2}}, "not a step"),
        ({"step": ["r", 1, 2]}, "not a step"),
        ({"step": {"request": b"r", "iteration": 1, "layer": 2}}, "step.request"),
        ({"step": {"request": "r", "iteration": False, "layer": 2}}, "bool"),
    ],
)
def test_field_checks_refuse_what_they_refused_before(changes, match):
    with pytest.raises(CodecError, match=match):
        from_frames([_compute_header(**changes), b"\0" * 8])


def test_an_int_for_a_float_field_becomes_a_float_and_lists_are_checked_per_item():
    h = {**asdict(Prediction(STEP, [1], [1, 2], [0.5, 0.5])), "probs": [1, 0.5], "_tensors": []}
    back, _ = from_frames([msgpack.packb(h)])
    assert back.probs == [1.0, 0.5] and type(back.probs[0]) is float
    h["experts"] = [1, "2"]
    with pytest.raises(CodecError, match="str, not int"):
        from_frames([msgpack.packb(h)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_received_frames_decode_without_a_warning_and_bit_exact(dtype):
    t = (torch.randn(3, 5) * 100).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for frames in (encode({}, [t]), [zmq.Frame(bytes(f)) for f in encode({}, [t])]):
            _, (back,) = decode(frames)
            assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_encoding_does_not_copy_a_contiguous_row_and_copies_a_view():
    t = torch.arange(8, dtype=torch.float32).view(2, 4)
    frames = encode({}, [t])
    t[0, 0] = 42.0  # the frame is the tensor's memory: zero-copy until ZeroMQ takes it
    assert torch.frombuffer(bytearray(frames[1]), dtype=torch.float32)[0] == 42.0
    _, (back,) = decode(encode({}, [t.t()]))
    assert torch.equal(back, t.t())
    with torch.enable_grad():
        g = torch.ones(2, 2, requires_grad=True)
        _, (back,) = decode(encode({}, [g]))
    assert torch.equal(back, torch.ones(2, 2))


# -- main's messages per layer -----------------------------------------------------------------------
class _Workers(Membership):
    """Membership without sockets: each ComputeExperts is answered at once with its rows doubled.
    `lose`: the worker reported lost at the first wait, its answers never arriving."""

    def __init__(self, topology: Topology, lose: int | None = None):
        self.topology, self.pongs, self.events = topology, {}, []
        self.links = {w: None for w in range(topology.workers)}
        self.sent: list[tuple[int, str]] = []
        self.messages: list[tuple[int, object]] = []
        self.inbox: list[tuple[int, list]] = []
        self.lose = lose

    def send(self, worker, frames, copy=True):
        message, tensors = from_frames(frames)
        self.sent.append((worker, message.kind))
        self.messages.append((worker, message))
        if isinstance(message, ComputeExperts) and worker != self.lose:
            n = len(message.experts)
            result = ExpertsResult(
                message.step, worker, message.experts, [0.0] * n, [0.0] * n, [0] * n, [True] * n, [0.0] * n, 0
            )
            self.inbox.append((worker, to_frames(result, [t * 2 for t in tensors])))
        return True

    def wait(self, timeout_ms):
        received, self.inbox = self.inbox, []
        if self.lose is not None and self.lose in self.links:
            del self.links[self.lose]
            return received, [self.lose]
        return received, []


class _Shadow:
    pub_address = ""

    def prediction(self, step):
        return None


def _decode_layer(shadow, experts=(1, 3), topology=None, lose=None):
    members = _Workers(topology or Topology(workers=2, group_size=2), lose)
    remote = RemoteExperts(members, num_experts=4, kernel="eager", shadow=shadow)
    ctx = remote.context("r")
    ctx.begin(1)
    hidden = torch.randn(1, 8)
    weights = torch.tensor([[0.75, 0.25][: len(experts)]])
    with forward_pass(ForwardPass((ctx,), "r", 1)):  # a decode call outside any lockstep: at once
        out = remote(0, hidden, torch.tensor([list(experts)]), weights)
    want = sum(hidden * 2 * w for w in weights[0].tolist())
    assert torch.equal(out, want)
    return members


def _calls(members) -> list[tuple[int, tuple[int, ...], bool]]:
    return [(w, tuple(m.experts), m.release) for w, m in members.messages if isinstance(m, ComputeExperts)]


def test_without_a_shadow_a_decode_layer_sends_only_its_expert_calls():
    """Nothing is ever preloaded without a shadow, so a Release would only wake the workers."""
    members = _decode_layer(None)
    assert sorted(kind for _, kind in members.sent) == ["compute_experts", "compute_experts"]
    assert not any(release for *_, release in _calls(members))


def test_with_a_shadow_each_workers_call_releases_the_layer_and_no_release_is_sent():
    """Both workers of the group got a call: it says the layer is over for them (a Release message
    per worker would wake each once more per layer)."""
    members = _decode_layer(_Shadow())
    assert sorted(_calls(members)) == [(0, (1,), True), (1, (3,), True)]
    assert [kind for _, kind in members.sent] == ["compute_experts", "compute_experts"]


def test_a_worker_of_the_group_that_got_no_call_gets_a_release():
    members = _decode_layer(_Shadow(), experts=(3,))
    assert _calls(members) == [(0, (3,), True)]
    assert members.sent[-1] == (1, "release")


def test_a_workers_experts_of_a_layer_go_in_one_message_which_releases():
    """One message per worker and layer, whatever it computes: one wake-up, one answer."""
    members = _decode_layer(_Shadow(), topology=Topology(workers=1, group_size=1))
    assert _calls(members) == [(0, (1, 3), True)]
    assert "release" not in [kind for _, kind in members.sent]


def test_a_re_sent_call_does_not_release_and_its_new_worker_gets_a_release():
    members = _decode_layer(_Shadow(), experts=(3,), lose=0)
    assert _calls(members) == [(0, (3,), True), (1, (3,), False)]
    assert members.sent[-1] == (1, "release")


# -- main's split of a decode step -------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["eager", "grouped_mm"])
def test_a_decode_steps_split_is_the_general_one(kernel, monkeypatch):
    """The one-token shortcut gives the very rows (and order) the kernels' own tensor ops give."""
    from odmoe.models import expert_math

    g = torch.Generator().manual_seed(0)
    cases = [torch.randperm(16, generator=g)[:k].view(1, k) for k in (1, 2, 4, 8) for _ in range(10)]
    cases.append(torch.tensor([[3, 3]]))  # not distinct (no router does this): the general path
    fast = [expert_math.split_by_expert(c, 16, kernel) for c in cases]
    monkeypatch.setattr(expert_math, "_SLOTS", [])  # the shortcut off
    for c, got in zip(cases, fast, strict=True):
        want = expert_math.split_by_expert(c, 16, kernel)
        assert [r.expert for r in got] == [r.expert for r in want]
        for a, b in zip(got, want, strict=True):
            assert a.token_idx.tolist() == b.token_idx.tolist() and a.slot_idx.tolist() == b.slot_idx.tolist()
            assert a.token_idx.dtype == b.token_idx.dtype == torch.long


# -- the expert math of a decode step ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_a_one_expert_grouped_call_is_transformers_own(dtype, rows):
    """The direct grouped_mm call gives the bits transformers' `_grouped_linear` gives, also for rows
    that start off a 16-byte boundary (as received frames may)."""
    from transformers.integrations.moe import _grouped_linear

    from odmoe.models.expert_math import expert_forward

    g = torch.Generator().manual_seed(rows)
    gate_up, down = torch.randn(64, 16, generator=g).to(dtype), torch.randn(16, 32, generator=g).to(dtype)
    x = torch.randn(rows * 16 + 1, generator=g).to(dtype)[1:].view(rows, 16)  # storage offset: 1 element
    offs = torch.tensor([rows], dtype=torch.int32)
    gate, up = _grouped_linear(x, gate_up.unsqueeze(0), offs).chunk(2, dim=-1)
    want = _grouped_linear(torch.nn.functional.silu(gate) * up, down.unsqueeze(0), offs)
    got = expert_forward(x, gate_up, down, "silu", "grouped_mm")
    assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("kernel", ["eager", "grouped_mm"])
@pytest.mark.parametrize(
    "hidden_dtype, weight_dtype", [(torch.float32,) * 2, (torch.bfloat16, torch.float32)]
)
def test_a_decode_steps_combine_is_the_general_one(kernel, hidden_dtype, weight_dtype, monkeypatch):
    """One token, k distinct experts: the short combine gives the general path's bits, signed zeros,
    infinities and NaNs included."""
    from odmoe.models import expert_math

    g = torch.Generator().manual_seed(1)
    cases = []
    for k in (1, 2, 4, 8):
        for _ in range(5):
            index = torch.randperm(16, generator=g)[:k].view(1, k)
            weights = torch.rand(1, k, generator=g).to(weight_dtype)
            ys = torch.randn(k, 1, 12, generator=g)
            ys[:, :, :4] = torch.tensor([-0.0, 0.0, float("inf"), float("nan")])
            cases.append((index, weights, ys.to(hidden_dtype)))
    hidden = torch.zeros(1, 12, dtype=hidden_dtype)

    def combined():
        out = []
        for index, weights, ys in cases:
            groups = expert_math.split_by_expert(index, 16, kernel)
            parts = [(rows, ys[int(rows.slot_idx[0])]) for rows in groups]
            out.append(expert_math.combine(hidden, parts, weights, kernel))
        return out

    fast = combined()
    monkeypatch.setattr(expert_math, "_one_row_per_slot", lambda *_: None)  # the general path
    for got, want in zip(fast, combined(), strict=True):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_the_suites_floor_fans_calls_out_to_busy_echoes():
    """The dataplane suite's floor: real echo processes that stay busy before answering, every call
    answered (the round trip cannot be shorter than one echo's busy time)."""
    from odmoe_bench.config import DataplaneSuite
    from odmoe_bench.suites.dataplane import measure_fanout

    suite = DataplaneSuite(fanout_rounds=30, warmup_rounds=5, fanout_gap_us=50.0)
    out = measure_fanout(suite, torch.zeros(1, 8), echoes=2, calls=3, spin_us=2000.0, pinning=None)
    assert out["echoes"] == 2 and out["calls"] == 3
    assert out["median"] >= 2 * 2000.0  # echo 0 gets calls 0 and 2: two busy spells in turn


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_the_suites_floor_with_real_compute_has_its_echoes_compute_the_models_experts(model_dirs):
    """The floor with real compute: echo processes that compute the checkpoint's experts on the row
    with the workers' own expert_forward, and answer with the output; their compute time comes back."""
    from odmoe_bench.config import DataplaneSuite
    from odmoe_bench.suites.dataplane import EchoExperts, measure_fanout

    ckpt = Checkpoint(model_dirs["mixtral"])
    suite = DataplaneSuite(fanout_rounds=20, warmup_rounds=2, fanout_gap_us=10.0)
    experts = EchoExperts(model_dirs["mixtral"], ckpt.moe_layers[0], "eager")
    row = torch.ones(1, ckpt.config.hidden_size)
    out = measure_fanout(suite, row, echoes=2, calls=2, spin_us=0.0, pinning=None, expert=experts)
    assert out["expert"]["kernel"] == "eager" and out["spin_us"] == 0.0
    assert out["compute_us"] > 0 and out["median"] >= out["compute_us"]


def test_the_echo_answers_with_the_workers_expert_output(model_dirs):
    from odmoe.models.expert_math import expert_forward
    from odmoe_bench.wire_echo import Expert

    class Frame:  # a received ZeroMQ frame's interface: .buffer
        def __init__(self, t):
            self.buffer = memoryview(t.numpy()).cast("B")

    ckpt = Checkpoint(model_dirs["mixtral"])
    layer = ckpt.moe_layers[0]
    expert = Expert(model_dirs["mixtral"], layer, "grouped_mm")
    x = torch.randn(1, ckpt.config.hidden_size)
    for e in (0, 1):  # the experts in turn
        w = ckpt.expert(layer, e)
        want = expert_forward(x, w.gate_up, w.down, ckpt.config.hidden_act, "grouped_mm")
        assert torch.equal(expert(Frame(x)), want)
    assert expert.calls == 2 and len(expert.compute_s) == 2


def test_dataplane_verdict_sets_each_overhead_against_its_raw_round_trip():
    from odmoe_bench.suites.dataplane import goal

    wire = {"raw_plain": {"median": 100.0}, "raw_curve": {"median": 125.0}}
    layers = {
        "overhead_us_per_layer": {"security_on": 500.0, "security_off": 400.0},
        "call_overhead_us_per_layer": {"security_on": 250.0, "security_off": 300.0},
    }
    verdict = goal(
        {
            "wire_us": wire,
            "layers": layers,
            "fanout_us": {"floor_us_per_layer": 50.0},
            "fanout_computing_us": {"floor_us_per_layer": 150.0},
        }
    )
    assert verdict["security_on"] == 4.0 and verdict["security_off"] == 4.0
    assert verdict["call_security_on"] == 2.0 and verdict["call_security_off"] == 3.0
    assert verdict["floor_security_off"] == 0.5 and verdict["floor_computing_security_off"] == 1.5
