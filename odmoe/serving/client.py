"""Client SDK: talk to a running cluster's main node over gRPC.

    client = odmoe.Client("127.0.0.1:50051")
    result = client.generate("def fibonacci(n):", max_new_tokens=32)
    result.text, result.token_ids, result.stats
    for piece in client.stream("def f(x):", max_new_tokens=16): print(piece.text, end="")

A prompt string is tokenized by main exactly as `tokenizer(prompt)` (no chat template); a list of
ints is sent as token ids. Greedy by default; `generate` and `stream` take transformers' sampling
parameters (`do_sample=True, temperature=, top_p=, top_k=, min_p=, repetition_penalty=, seed=`)
and `stop=[...]` strings; with a seed the tokens equal `torch.manual_seed(seed);
model.generate(do_sample=True, ...)` in one process. Sampling without a seed: the client draws one,
so a resumed stream (below) continues the same draws. Errors arrive as `grpc.RpcError` with INVALID_ARGUMENT,
FAILED_PRECONDITION or UNAVAILABLE and a readable message; a prompt or stop string that is not
valid Unicode (a lone surrogate) is a ValueError naming it, before anything is sent.

Failover (main's loss): give several main addresses, the active one first and standbys after
(`Client(["10.0.0.1:50051", "10.0.0.2:50051"])`). A killed main breaks the stream at once; a
frozen one within about `keepalive_s`: the channel's keepalive pings go unanswered for their
timeout (`keepalive_s` too) and gRPC closes the connection (1.02 s with the default 1 s in suite
faults). Failing that, no reply for `keepalive_s` and then no answer to a gRPC health check within
`2 * keepalive_s` calls it lost (3.00 s). A busy main answers health checks from its gRPC
threads, so slowness alone is not a loss. The client then resumes on the next main by sending the
prompt plus the tokens it already received (`resume_ids`), and that main replays them and streams the
rest. With greedy decoding, or sampling with its seed, the whole sequence equals the single-process
reference. What a stream sees: a pause (detection, then the new main replaying the tokens it had,
one decode step each: 0.7-1.7 s in tests/test_failover.py, four streams of a tiny model ~10
tokens in, on a busy 2-core box), then its tokens go on where they stopped, none repeated or
missing. `client.failover_log` says when and why it moved on.
A stream that keeps failing without a new token after every main was tried raises `MainsLost` (a
`grpc.RpcError`, UNAVAILABLE, naming the mains and the last error).

Threads: a `Client` is safe to share, as gRPC's channels are; one per process is enough (the way an
application serving several users holds one `openai` client). Its streams share one view of which
main is in use (`odmoe/serving/main_ring.py`): the first stream to notice a loss moves the client
on, once, and every other stream of that main resumes on the same next one. After `close()`,
streams still running and later calls raise `ClientClosed` (a ValueError).

Security: a cluster with security on (the default) answers only over TLS and only calls carrying
its token: pass `credentials=` a key directory (what `odmoe-keys init` made: its tls/cert.pem and
token are read) or a `ClientCredentials`; without them every call fails UNAVAILABLE (no TLS) or
UNAUTHENTICATED (no or a wrong token). `LocalCluster.client` is given its cluster's credentials.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from odmoe.main.sampling import MAX_SEED, SamplingParams
from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.serving.main_ring import ClientClosed, MainRing, Turn
from odmoe.serving.text_check import invalid_text
from odmoe.transport.security import ClientCredentials, grpc_channel


@dataclass(frozen=True)
class Piece:
    token_id: int
    text: str
    logprob: float | None = None  # with logprobs=: this token's (float32, as transformers computes it)
    top: tuple[tuple[int, float], ...] = ()  # with logprobs=k > 0: the k most likely (token, logprob)


@dataclass
class GenerateResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the new tokens only
    stats: dict = field(default_factory=dict)
    final_logits: torch.Tensor | None = None  # [vocab] fp32 when asked for (return_logits=True)
    # with logprobs=k: each new token's log-probability and the k most likely (token, logprob)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    # with prompt_logprobs=True: every prompt token's (None for the first), and the best k there
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[tuple[tuple[int, float], ...]] | None = None


# What a lost main looks like from here: the connection dropped or its keepalive went unanswered.
FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)


class StreamBroken(RuntimeError):
    """A stream ended without its final reply, or its main stopped answering: it is lost."""


class MainsLost(StreamBroken, grpc.RpcError):
    """Every main was tried since the stream's last token and none could go on with it: the stream
    gives up. A `grpc.RpcError` with code UNAVAILABLE; its message names the mains and the last
    error (also its `__cause__`), e.g. "no live worker holds layer 1" from a main that answered."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)


_END = object()


@dataclass(frozen=True)
class _Connection:
    """One main's channel and its stubs, built together while the channel is open: grpcio 1.85
    crashes the process (SIGSEGV) building a stub on a closed channel, and another thread may
    close this one at any time (the ring moving on); calling a stub of a closed channel only
    raises ValueError."""

    channel: grpc.Channel
    inference: odmoe_pb2_grpc.InferenceStub
    health: health_pb2_grpc.HealthStub


class Client:
    """One client per process is enough: any number of threads may stream through it at once."""

    def __init__(
        self,
        address: str | list[str],
        timeout_s: float | None = None,
        keepalive_s: float = 1.0,
        credentials: ClientCredentials | str | Path | None = None,
    ):
        if isinstance(credentials, str | Path):
            credentials = ClientCredentials.from_key_dir(credentials)
        self.credentials = credentials
        self.metadata = credentials.metadata if credentials else None
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive_s
        self.keepalive_ms = max(int(keepalive_s * 1000), 100)
        addresses = [address] if isinstance(address, str) else list(address)
        self._ring: MainRing[_Connection] = MainRing(addresses, self._connect, lambda c: c.channel.close())

    @property
    def addresses(self) -> list[str]:
        return self._ring.addresses

    @property
    def address(self) -> str:
        """The main in use now."""
        return self._ring.addresses[self._ring.index]

    @property
    def current(self) -> int:
        """The index in `addresses` of the main in use now; moves on when it is lost."""
        return self._ring.index

    @property
    def failovers(self) -> int:
        return self._ring.failovers

    @property
    def failover_log(self) -> list[dict]:
        """{at_us, lost, to, reason} of each move to the next main, in order (one per lost main)."""
        return self._ring.log

    def replace_address(self, old: str, new: str) -> None:
        """A main came back at another address (restarted): fail over to it from now on."""
        self._ring.replace(old, new)

    def _connect(self, address: str) -> _Connection:
        options = [
            ("grpc.keepalive_time_ms", self.keepalive_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_ms),
            # gRPC 1.85 waits for a ping's answer this long (a minute by default), whatever
            # keepalive_timeout_ms says: without it a channel to a black-holed main stays up
            ("grpc.http2.ping_timeout_ms", self.keepalive_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_time_between_pings_ms", self.keepalive_ms),
        ]
        channel = grpc_channel(address, self.credentials, options)
        return _Connection(
            channel, odmoe_pb2_grpc.InferenceStub(channel), health_pb2_grpc.HealthStub(channel)
        )

    def _replies(
        self,
        prompt,
        max_new_tokens,
        return_logits=False,
        request_id="",
        stop=(),
        logprobs=None,
        prompt_logprobs=False,
        ignore_eos=False,
        **sampling,
    ):
        """The stream of replies, resumed on the next main whenever the current one is lost.

        Each attempt goes to the ring's current main (`MainRing.turn`); a loss is reported with
        the turn it was seen on, so streams of other threads that noticed the same loss first do
        not move the client on again: this one just resumes where they went."""
        if bad := invalid_text({"prompt": prompt, "stop": stop}):  # protobuf could not send it
            raise ValueError(bad.message)
        received: list[int] = []
        failures = 0  # consecutive, without a new token in between
        options = _options(stop, sampling)
        options.update(max_new_tokens=max_new_tokens, return_logits=return_logits, request_id=request_id)
        options.update(prompt_logprobs=prompt_logprobs, ignore_eos=ignore_eos)
        options.update({"prompt": prompt} if isinstance(prompt, str) else {"token_ids": list(prompt)})
        if logprobs is not None:
            options["logprobs"] = logprobs
        while True:
            turn = self._ring.turn()
            request = odmoe_pb2.GenerateRequest(resume_ids=received, **options)
            before = len(received)
            try:
                yield from self._attempt(turn, request, received, options)
                return
            except (grpc.RpcError, StreamBroken) as exc:
                code = exc.code() if isinstance(exc, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
                if code not in FAILOVER_CODES:
                    raise
                failures = 1 if len(received) > before else failures + 1
                self._lost(turn, exc, failures)

    def _attempt(self, turn: Turn, request, received: list[int], options: dict):
        """One try on `turn`'s main: its replies up to the final one (tokens also into `received`);
        raises StreamBroken (or the call's error) where the stream ends before."""
        call = None
        try:
            try:
                call = turn.connection.inference.Generate(
                    request, timeout=self.timeout_s, metadata=self.metadata
                )
            except ValueError:  # its channel was closed since our turn: moved on, or close()
                raise StreamBroken(f"main {turn.address}'s channel was closed") from None
            for reply in self._watched(call, turn):
                kind = reply.WhichOneof("kind")
                if kind == "token":
                    received.append(reply.token.token_id)
                if kind == "prompt":
                    options["prompt_logprobs"] = False  # a main resuming need not score it again
                yield reply
                if kind == "done":
                    return
            raise StreamBroken(f"main {turn.address} ended the stream without its final reply")
        finally:
            if call is not None:
                call.cancel()  # no-op once done; when the caller stops reading, main stops too

    def _lost(self, turn: Turn, error: Exception, failures: int) -> None:
        """`turn`'s main lost the stream: on to the next, unless closed or `failures` are too many."""
        if self._ring.closed:
            raise ClientClosed("this odmoe.Client was closed while the stream ran") from error
        self._ring.lost(turn, str(error))
        if self._ring.gives_up(failures):
            raise MainsLost(
                f"no main could go on with the stream ({', '.join(self._ring.addresses)}):"
                f" {failures} attempts in a row failed without a new token, the last with"
                f" {_describe(error)}"
            ) from error

    def _watched(self, call, turn: Turn) -> Iterator:
        """`call`'s replies; while none comes for keepalive_s, main must pass a health check."""
        replies: queue.Queue = queue.Queue()

        def pump() -> None:
            try:
                for reply in call:
                    replies.put(reply)
                replies.put(_END)
            except grpc.RpcError as exc:
                replies.put(exc)

        threading.Thread(target=pump, name="odmoe-client-stream", daemon=True).start()
        while True:
            try:
                item = replies.get(timeout=self.keepalive_s)
            except queue.Empty:
                try:
                    turn.connection.health.Check(
                        health_pb2.HealthCheckRequest(), timeout=2 * self.keepalive_s, metadata=self.metadata
                    )
                except grpc.RpcError as exc:
                    raise StreamBroken(f"main {turn.address} stopped answering ({exc.code().name})") from None
                except ValueError:  # its channel was closed: the client, or another stream moved on
                    raise StreamBroken(f"main {turn.address}'s channel was closed") from None
                continue
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def stream(
        self, prompt: str | list[int], max_new_tokens: int = 32, stop=(), logprobs=None, **sampling
    ) -> Iterator[Piece]:
        for reply in self._replies(prompt, max_new_tokens, stop=stop, logprobs=logprobs, **sampling):
            if reply.WhichOneof("kind") == "token":
                yield _piece(reply.token)

    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int = 32,
        return_logits: bool = False,
        request_id: str = "",
        stop: list[str] | tuple[str, ...] = (),
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        ignore_eos: bool = False,
        **sampling,
    ) -> GenerateResult:
        """`sampling`: do_sample, temperature, top_p, top_k, min_p, repetition_penalty, seed.
        `logprobs=k` (0..20): each new token's log-probability and the k most likely;
        `prompt_logprobs=True`: the prompt tokens' too (`max_new_tokens=0`: only those)."""
        result = GenerateResult()
        replies = self._replies(
            prompt,
            max_new_tokens,
            return_logits,
            request_id,
            stop,
            logprobs,
            prompt_logprobs,
            ignore_eos,
            **sampling,
        )
        for reply in replies:
            kind = reply.WhichOneof("kind")
            if kind == "token":
                piece = _piece(reply.token)
                result.token_ids.append(piece.token_id)
                result.text += piece.text
                if piece.logprob is not None:
                    result.logprobs.append(piece.logprob)
                    result.top_logprobs.append(piece.top)
            elif kind == "prompt":
                tokens = reply.prompt.tokens
                result.prompt_logprobs = [t.logprob if t.HasField("logprob") else None for t in tokens]
                result.prompt_top_logprobs = [_top(t.top) for t in tokens]
            else:
                result.stats = json.loads(reply.done.stats_json)
                if reply.done.final_logits:
                    result.final_logits = torch.frombuffer(
                        bytearray(reply.done.final_logits), dtype=torch.float32
                    )
        return result

    def info(self) -> dict:
        stub = self._ring.turn().connection.inference
        reply = stub.Info(odmoe_pb2.InfoRequest(), timeout=self.timeout_s, metadata=self.metadata)
        return {
            "model_path": reply.model_path,
            "family": reply.family,
            "workers": reply.workers,
            "group_size": reply.group_size,
            **json.loads(reply.info_json),
        }

    def close(self) -> None:
        """Closes every channel: streams still running end with `ClientClosed`, as later calls do."""
        self._ring.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _describe(error: Exception) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "details"):
        return f"{error.code().name}: {error.details()}"
    return str(error)


def _top(top) -> tuple[tuple[int, float], ...]:
    return tuple((t.token_id, t.logprob) for t in top)


def _piece(token) -> Piece:
    logprob = token.logprob if token.HasField("logprob") else None
    return Piece(token.token_id, token.text, logprob, _top(token.top))


def _options(stop, sampling: dict) -> dict:
    """The request's sampling and stop fields (a seed is drawn here when sampling without one)."""
    params = SamplingParams(**sampling)  # an unknown keyword fails here, before anything is sent
    params.validate()
    if params.do_sample and params.seed is None:
        params = replace(params, seed=secrets.randbelow(MAX_SEED))
    fields = {k: v for k, v in asdict(params).items() if v is not None}
    stops = [stop] if isinstance(stop, str) else list(stop)
    return {"sampling": odmoe_pb2.Sampling(**fields), "stop": stops}
