"""One `odmoe.Client` shared by many streams while mains are lost: the ring that decides which main
is in use (odmoe/serving/main_ring.py), and the client over fake mains (no process, no network).

The fake transport stands in for gRPC: a channel per address, a Generate call that streams the
prompt's reference tokens from `resume_ids` on and breaks (UNAVAILABLE) once its main is killed, or
(CANCELLED) once its channel is closed, as a real channel's calls do. The real-process test is
tests/test_failover.py's.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import odmoe.serving.client as client_module
from odmoe.rpc import odmoe_pb2
from odmoe.serving.client import Client, MainsLost
from odmoe.serving.main_ring import ClientClosed, MainRing

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


# -- the ring ------------------------------------------------------------------------------------
class Conn:
    def __init__(self, address: str):
        self.address, self.closed = address, False

    def close(self) -> None:
        assert not self.closed, "a connection closed twice"
        self.closed = True


def ring_of(n: int) -> MainRing[Conn]:
    return MainRing([f"m{i}" for i in range(n)], Conn, Conn.close)


def test_a_loss_seen_by_many_streams_moves_the_ring_once():
    ring = ring_of(2)
    turns = [ring.turn() for _ in range(4)]  # four streams on main 0
    moved = [ring.lost(t, "reset") for t in turns]
    assert moved == [True, False, False, False] and ring.failovers == 1
    assert turns[0].connection.closed and ring.turn().address == "m1"
    assert ring.log[0]["lost"] == "m0" and ring.log[0]["to"] == "m1"


def test_a_stale_turn_does_not_move_the_ring_back_to_a_lost_main():
    """With two mains, index 0 is current again after two losses: a turn from the first must not
    count as a third (why the ring keeps an epoch, not the index alone)."""
    ring = ring_of(2)
    old = ring.turn()
    ring.lost(old, "first")
    ring.lost(ring.turn(), "second")
    assert ring.index == 0 and not ring.lost(old, "late") and ring.failovers == 2


def test_replacing_the_current_address_retries_there_without_a_failover():
    ring = ring_of(2)
    before = ring.turn()
    ring.replace("m0", "m0-restarted")
    assert before.connection.closed and not ring.lost(before, "its channel was closed")
    assert ring.turn().address == "m0-restarted" and ring.failovers == 0


def test_a_closed_ring_hands_out_nothing():
    ring = ring_of(2)
    turn = ring.turn()
    ring.close()
    assert turn.connection.closed and not ring.lost(turn, "closed")
    with pytest.raises(ClientClosed):
        ring.turn()


@settings(max_examples=200, deadline=None)
@given(mains=st.integers(1, 4), data=st.data())
def test_interleaved_callers_keep_the_ring_consistent(mains, data):
    """Callers take turns and report losses in any order, some on turns long stale: the ring moves
    exactly when the reported turn is current, only the current main's connection is open, and no
    caller is ever handed a closed one."""
    ring = ring_of(mains)
    held: list = []  # the turns callers hold now
    moves = 0
    for _ in range(data.draw(st.integers(1, 40))):
        if not held or data.draw(st.booleans()):
            turn = ring.turn()
            assert not turn.connection.closed and turn.index == moves % mains and turn.epoch == moves
            held.append(turn)
        else:
            turn = held.pop(data.draw(st.integers(0, len(held) - 1)))
            current = turn.epoch == ring.epoch
            assert ring.lost(turn, "lost") == current
            moves += current
            assert turn.connection.closed or not current
        assert ring.failovers == moves and ring.index == moves % mains
        open_ = {t.connection for t in held if not t.connection.closed}
        assert len(open_) <= 1 and all(c.address == f"m{ring.index}" for c in open_)


# -- the client over fake mains ------------------------------------------------------------------
class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def reference(prompt: str, n: int) -> list[int]:
    return [(len(prompt) * 31 + i * 7) % 1000 for i in range(n)]


class World:
    """Fake mains by address: alive or killed; `delay_s` between tokens (0: as fast as asked)."""

    def __init__(self, addresses: list[str], delay_s: float = 0.0):
        self.alive = dict.fromkeys(addresses, True)
        self.delay_s = delay_s
        self.calls = 0
        self.channels: list[FakeChannel] = []

    def channel(self, address: str, credentials, options) -> FakeChannel:
        channel = FakeChannel(self, address)
        self.channels.append(channel)
        return channel


class FakeChannel:
    def __init__(self, world: World, address: str):
        self.world, self.address, self.closed = world, address, False
        self.stubs = 0  # built on it

    def close(self) -> None:
        self.closed = True


def _stub_of(channel: FakeChannel) -> None:
    # grpcio 1.85 crashes the process (SIGSEGV) building a stub on a closed channel
    assert not channel.closed, "a stub was built on a closed channel"
    channel.stubs += 1


class FakeStub:
    def __init__(self, channel: FakeChannel):
        _stub_of(channel)
        self.channel = channel

    def Generate(self, request, timeout=None, metadata=None):
        if self.channel.closed:
            raise ValueError("Cannot invoke RPC on closed channel!")  # what grpc raises
        self.channel.world.calls += 1
        return FakeCall(self.channel, request)


class FakeHealth:
    def __init__(self, channel: FakeChannel):
        _stub_of(channel)
        self.channel = channel

    def Check(self, request, timeout=None, metadata=None):
        if self.channel.closed:
            raise ValueError("Cannot invoke RPC on closed channel!")
        if not self.channel.world.alive[self.channel.address]:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect")


class FakeCall:
    def __init__(self, channel: FakeChannel, request):
        self.channel, self.request = channel, request
        self.tokens = reference(request.prompt, request.max_new_tokens)
        self.at = len(request.resume_ids)
        assert list(request.resume_ids) == self.tokens[: self.at], "resumed with other tokens"
        self.done = False

    def __iter__(self):
        return self

    def __next__(self):
        world = self.channel.world
        if world.delay_s:
            time.sleep(world.delay_s)
        if self.channel.closed:
            raise FakeRpcError(grpc.StatusCode.CANCELLED, "Channel closed!")
        if not world.alive[self.channel.address]:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        if self.done:
            raise StopIteration
        if self.at < len(self.tokens):
            self.at += 1
            piece = odmoe_pb2.TokenPiece(token_id=self.tokens[self.at - 1], text="x")
            return odmoe_pb2.GenerateReply(token=piece)
        self.done = True
        return odmoe_pb2.GenerateReply(done=odmoe_pb2.Done(stats_json="{}"))

    def cancel(self) -> None:
        pass


def fake_client(monkeypatch, n: int, delay_s: float = 0.0, synchronous: bool = False):
    """A Client over `n` fake mains, and their world. `synchronous`: no pump thread, so one step
    of a stream is exactly one next() on it (hypothesis then decides every interleaving)."""
    addresses = [f"main{i}:1" for i in range(n)]
    world = World(addresses, delay_s)
    monkeypatch.setattr(client_module, "grpc_channel", world.channel)
    monkeypatch.setattr(client_module.odmoe_pb2_grpc, "InferenceStub", FakeStub)
    monkeypatch.setattr(client_module.health_pb2_grpc, "HealthStub", FakeHealth)
    if synchronous:
        monkeypatch.setattr(Client, "_watched", lambda self, call, *_: iter(call))
    return Client(addresses, keepalive_s=5.0), world


@pytest.fixture
def fake_mains(monkeypatch):
    return lambda *args, **kwargs: fake_client(monkeypatch, *args, **kwargs)


PROMPTS = ["a", "bb", "ccc", "dddd", "eeeee"]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_streams_interleaved_through_main_losses_each_end_with_their_tokens(data):
    """Any number of streams on one client, read in any interleaving, while mains are killed at any
    point: with one main left alive every stream ends with its reference tokens and the client
    leaves each dead main once and never a live one; with every main dead every unfinished stream
    raises MainsLost (UNAVAILABLE), never anything else."""
    mains, streams = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 5))
    all_die = data.draw(st.booleans())
    new_tokens = data.draw(st.integers(1, 10))
    with pytest.MonkeyPatch.context() as monkeypatch:
        client, world = fake_client(monkeypatch, mains, synchronous=True)
        gens = {i: client.stream(PROMPTS[i], max_new_tokens=new_tokens) for i in range(streams)}
        got: dict[int, list[int]] = {i: [] for i in range(streams)}
        failed: dict[int, Exception] = {}
        kills = mains if all_die else mains - 1
        order = data.draw(st.permutations(range(mains))) if all_die else None
        while gens:
            if kills and data.draw(st.integers(0, 3)) == 0:
                # the main in use now (a killed main's standby next), or any when all die
                victim = f"main{order[mains - kills]}:1" if order else client.address
                if world.alive[victim]:
                    world.alive[victim] = False
                    kills -= 1
            i = data.draw(st.sampled_from(sorted(gens)))
            try:
                got[i].append(next(gens[i]).token_id)
            except StopIteration:
                del gens[i]
            except Exception as exc:
                failed[i] = exc
                del gens[i]
        lost = [entry["lost"] for entry in client.failover_log]
        assert all(not world.alive[a] for a in lost), f"a live main was left: {client.failover_log}"
        if not all_die:
            assert failed == {} and len(lost) == len(set(lost))
            assert all(got[i] == reference(PROMPTS[i], new_tokens) for i in got)
        for exc in failed.values():
            assert isinstance(exc, MainsLost) and exc.code() == grpc.StatusCode.UNAVAILABLE, repr(exc)
            assert all(a in str(exc) for a in client.addresses)


def test_many_threads_on_one_client_fail_over_once_when_main_is_lost(fake_mains):
    """Eight threads stream and four generate through one client (its real pump threads); the main
    dies under them: one failover, every answer exact. Before the ring, the others met KeyError or
    left main1 too."""
    client, world = fake_mains(2, delay_s=0.002)
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    past_eight = threading.Barrier(9)  # the streams and this thread

    def prompt(i: int) -> str:
        return PROMPTS[i % 5] * (i + 1)

    def run(i: int) -> None:
        tokens = []
        try:
            if i >= 8:
                tokens = client.generate(prompt(i), max_new_tokens=80).token_ids
            for piece in client.stream(prompt(i), max_new_tokens=80) if i < 8 else ():
                tokens.append(piece.token_id)
                if len(tokens) == 8:
                    past_eight.wait(timeout=10)
        except BaseException as exc:
            errors.append(exc)
        results[i] = tokens

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    past_eight.wait(timeout=10)
    world.alive["main0:1"] = False
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert all(results[i] == reference(prompt(i), 80) for i in range(12))
    assert client.failovers == 1 and client.address == "main1:1"
    # its two stubs built with each channel, while it was open: never by a stream afterwards
    assert [c.stubs for c in world.channels] == [2, 2]


def test_every_main_lost_ends_every_thread_with_the_same_error(fake_mains):
    client, world = fake_mains(2, delay_s=0.002)
    errors: list[BaseException] = []
    started = threading.Barrier(5)

    def run(i: int) -> None:
        try:
            for n, _ in enumerate(client.stream(PROMPTS[i], max_new_tokens=200)):
                if n == 2:
                    started.wait(timeout=10)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(timeout=10)
    world.alive["main0:1"] = world.alive["main1:1"] = False
    for t in threads:
        t.join(timeout=30)
    assert len(errors) == 4 and all(isinstance(e, MainsLost) for e in errors), errors
    assert {e.code() for e in errors} == {grpc.StatusCode.UNAVAILABLE}
    assert all("main0:1, main1:1" in str(e) for e in errors)


def test_a_channel_closed_by_another_stream_before_the_call_is_a_retry_not_an_error(fake_mains):
    """Between a stream's turn and its Generate call another thread moved the client on and closed
    that channel: grpc raises ValueError there, and the stream retries on the new main."""
    client, world = fake_mains(2, synchronous=True)
    real = FakeStub.Generate

    def moved_on_meanwhile(self, request, timeout=None, metadata=None):
        if not client.failovers:
            client._ring.lost(client._ring.turn(), "another stream saw main0 go")
        return real(self, request, timeout, metadata)

    FakeStub.Generate = moved_on_meanwhile  # type: ignore[method-assign]
    try:
        tokens = [p.token_id for p in client.stream("abc", max_new_tokens=6)]
    finally:
        FakeStub.Generate = real  # type: ignore[method-assign]
    assert tokens == reference("abc", 6) and client.failovers == 1


def test_closing_the_client_ends_its_streams_with_client_closed(fake_mains):
    client, _ = fake_mains(2, synchronous=True)
    stream = client.stream("abc", max_new_tokens=6)
    next(stream)
    client.close()
    with pytest.raises(ClientClosed):
        next(stream)
    assert client.failovers == 0
    with pytest.raises(ClientClosed):
        client.generate("abc", max_new_tokens=2)
