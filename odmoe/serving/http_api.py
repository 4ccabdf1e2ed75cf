"""The OpenAI-compatible HTTP front door of main (FastAPI + uvicorn, SSE streaming).

Contract: `make_app(backend)` serves
- `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the tokenizer's chat template),
- `GET /health` (200 when main can serve a request now, else 503 with the reason),
- `GET /metrics` (Prometheus text, `odmoe/serving/metrics.py`).
`backend` is main (`nodes/main.py`): `submit(GenerateRequest, timeout_s) -> Ticket` (raises
InvalidRequest / QueueFull at once), `health()`, `tokenizer`, `model_name`, `context_length`, `metrics`.

Semantics, as OpenAI's API and vLLM define them: `temperature` 0 is greedy, otherwise the request
samples (OpenAI's default temperature is 1) with transformers' processors (`odmoe/main/sampling.py`);
parameters left out take the checkpoint's generation config, then transformers' defaults, so a
request equals `generate(do_sample=True, <the same parameters>)` with `torch.manual_seed(seed)`.
`n` > 1 choices run as requests of their own, batched with everything else (`odmoe/main/engine.py`),
sharing the prompt's prefill; choice i samples with seed `seed + i` (with no seed given, one is
drawn for the request and each choice's is in `odmoe.choices[i].seed`), so it equals a single
`generate()` with that seed. Every parameter we do not implement is refused with 400 when set to
anything but its neutral value (`logprobs`, `echo`, penalties, tools ...) — never silently ignored;
unknown fields too. A body that is not UTF-8, or holds a string that is not valid Unicode (a lone
surrogate escape such as `"\\ud800"`), is refused with 400 naming the field, on every route.
Errors have OpenAI's body: `{"error": {"message", "type", "param", "code"}}`. A stream is `data:
{chunk}` events, a usage chunk when `stream_options.include_usage`, then `data: [DONE]`; an error
after the stream began is sent as one `data: {"error": ...}` event. A client that disconnects (stream
or not) cancels its request; the engine stops it within one decode iteration.

A client whose link went silent (a black hole: no FIN, no RST; a laptop that slept) is found by
TCP itself, which HTTP/1.1 leaves no other way to ask (an SSE client sends nothing back, unlike
gRPC's pings): every connection is accepted with `TCP_USER_TIMEOUT` = `ping_timeout_s` (bytes
sent and not acknowledged for that long abort the connection, where Linux would otherwise
retransmit for ~15 minutes) and TCP keepalive probes after `ping_s` of quiet, and a stream sends
an SSE comment every `ping_s`, so there is always something to go unacknowledged, even while the
request waits in the queue. The aborted connection is a disconnect as above: the request is
cancelled within about `ping_s + ping_timeout_s` (main passes server.client_ping_s and
server.client_ping_timeout_s, the gRPC door's bounds).

With security on (`make_app(backend, secrets)`), the server is HTTPS with the cluster's certificate
and every path but `/health` needs `Authorization: Bearer <token>` (what OpenAI clients send as
their api_key): anything else is answered 401 before any work is done. `/metrics` is protected too
(it tells request counts and timings); `/health` says only "ok" or why not, for load balancers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from sse_starlette.sse import EventSourceResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from odmoe.main.engine import DoneEvent, GenerateRequest, InvalidRequest, PromptEvent, TokenEvent
from odmoe.main.request_queue import END, QueueClosed, QueueFull
from odmoe.main.sampling import MAX_SEED
from odmoe.serving.error_status import message_of, status_of
from odmoe.serving.http_bodies import (
    MAX_N,
    ApiError,
    ChatBody,
    ChatMessage,
    CompletionBody,
    DetokenizeBody,
    StreamOptions,
    TokenizeBody,
    _Common,
)
from odmoe.serving.openai_logprobs import Scored, TokenTexts, chat_content, completion_logprobs
from odmoe.serving.text_check import invalid_text, invalid_utf8
from odmoe.transport.security import ServerSecrets

log = logging.getLogger("odmoe.http")
POLL_S = 0.1  # how often a waiting handler looks whether its client is still there
MAX_PROMPTS = 1024  # prompts in one completions request


class TextCheckedRoute(APIRoute):
    """Every route's body is checked before FastAPI parses it: bytes that are not UTF-8, or a
    string anywhere in the JSON that is not valid Unicode (a lone surrogate, which a `\\ud800`
    escape carries and the tokenizer refuses with a TypeError), answer 400 naming the field
    (odmoe/serving/text_check.py). One check where requests enter covers every route that takes text."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            _check_text(await request.body())  # kept: the handler reads the same bytes
            return await handler(request)

        return checked


def _check_text(raw: bytes) -> None:
    if not raw:
        return
    if bad := invalid_utf8(raw):
        raise ApiError(400, bad.message)
    try:
        value = json.loads(raw)
    except ValueError:
        return  # not JSON: FastAPI answers that itself
    if bad := invalid_text(value):
        raise ApiError(400, bad.message, bad.field)


# -- the app -------------------------------------------------------------------------------------
class _BearerToken:
    """Every path but /health needs the cluster's token. Plain ASGI, not `@app.middleware("http")`
    (Starlette's BaseHTTPMiddleware): behind that, an endpoint's `request.is_disconnected()` never
    saw its client go, so a request not streamed ran on to its end for a client long gone."""

    def __init__(self, app, secrets: ServerSecrets):
        self.app, self.secrets = app, secrets

    async def __call__(self, scope, receive, send) -> None:
        # /health stays open (load balancers, readiness probes): it says "ok" or why not, no more.
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        header = Headers(scope=scope).get("authorization")
        if self.secrets.authorized(header):
            return await self.app(scope, receive, send)
        why = "wrong API key" if header else "no API key"
        message = f"{why}: send 'Authorization: Bearer <the cluster token>'"
        body = ApiError(401, message, kind="authentication_error").body()
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def make_app(backend, secrets: ServerSecrets | None = None, ping_s: float = 15.0) -> FastAPI:
    """The door: its errors as OpenAI's, the cluster's token checked (where `secrets`), its routes.
    `ping_s`: an SSE comment this often on every stream (sse-starlette's default is 15 s)."""
    app = FastAPI(title="odmoe", summary="OpenAI-compatible API of an odmoe cluster", docs_url=None)
    app.router.route_class = TextCheckedRoute  # before any route is added
    if secrets is not None:
        app.add_middleware(_BearerToken, secrets=secrets)
    _error_answers(app)
    _info_routes(app, backend)
    _tokenizer_routes(app, backend)
    _generation_routes(app, backend, ping_s)
    return app


def _error_answers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error shape: ours, the bodies' validation, Starlette's own."""

    @app.exception_handler(ApiError)
    async def _api_error(_, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        loc = exc.errors()[0].get("loc", ())
        where = str(loc[1]) if len(loc) > 1 else None  # the body's field (a union adds its branch)
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:])}: {e['msg']}" for e in exc.errors()
        )
        return JSONResponse(ApiError(400, detail, where).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), kind=kind).body(), exc.status_code)


def _info_routes(app: FastAPI, backend) -> None:
    """/health (503 with the reason when main cannot serve), /metrics, the model list."""

    @app.get("/health")
    async def health():
        if why := backend.health():
            return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(backend.metrics.page(), media_type=backend.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(backend)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        _check_model(backend, name)
        return _model_card(backend)


def _tokenizer_routes(app: FastAPI, backend) -> None:
    """vLLM's tokenizer endpoints (evaluation harnesses tokenize through the server with them)."""

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = backend.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": backend.context_length or None,
        }

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        ids = backend.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        return {"tokens": list(ids), "count": len(ids), "max_model_len": backend.context_length or None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        vocab = backend.tokenizer_vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"token ids must lie in [0, {vocab})", "tokens")
        return {"prompt": backend.tokenizer.decode(body.tokens)}


def _generation_routes(app: FastAPI, backend, ping_s: float) -> None:
    """/v1/completions and /v1/chat/completions: the body's parameters checked, its requests made
    (n choices, each prompt), answered whole or streamed."""

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        body.refuse_unsupported()
        if body.best_of not in (None, 1) or body.suffix:
            raise ApiError(400, "best_of and suffix are not supported", "best_of")
        _check_model(backend, body.model)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
        if max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens=0 needs echo=true (it scores the prompt)", "max_tokens")
        if max_tokens == 0 and body.stream:
            raise ApiError(400, "max_tokens=0 (scoring a prompt) cannot be streamed", "stream")
        prompts = _completion_prompts(body.prompt)
        reqs = [r for prompt, ids in prompts for r in _requests(body, max_tokens, prompt, ids)]
        return await _answer(backend, request, body, reqs, chat=False, ping_s=ping_s)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        body.refuse_unsupported()
        if body.tools or body.tool_choice not in (None, "none"):
            raise ApiError(400, "tools are not supported", "tools")
        if body.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "only response_format {'type': 'text'} is supported", "response_format")
        _check_model(backend, body.model)
        ids = _chat_ids(backend.tokenizer, body.messages)
        limit = body.max_completion_tokens or body.max_tokens
        if limit is None:  # the rest of the context, as OpenAI does when it is not set
            limit = max(backend.context_length - len(ids), 1) if backend.context_length else 256
        reqs = _requests(body, limit, token_ids=tuple(ids))
        return await _answer(backend, request, body, reqs, chat=True, ping_s=ping_s)


def _model_card(backend) -> dict:
    return {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "odmoe"}


def _check_model(backend, name: str) -> None:
    if name != backend.model_name:
        raise ApiError(
            404,
            f"model {name!r} is not served here; this cluster serves {backend.model_name!r}",
            "model",
            kind="not_found_error",
        )


def _completion_prompts(prompt) -> list[tuple[str, tuple[int, ...]]]:
    """(text, token ids) of each prompt of a completions request, in order."""
    if isinstance(prompt, str):
        return [(prompt, ())]
    if not prompt:
        raise ApiError(400, "the prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [("", tuple(prompt))]
    if len(prompt) > MAX_PROMPTS:
        raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [(p, ()) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [("", tuple(p)) for p in prompt]
    raise ApiError(400, "prompt must be a string, token ids, or a list of either, not a mix", "prompt")


def _chat_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
    plain = []
    for m in messages:
        if isinstance(m.content, str):
            text = m.content
        else:  # [{"type": "text", "text": ...}, ...]: only text parts
            if any(part.get("type") != "text" for part in m.content):
                raise ApiError(400, "only text content parts are supported", "messages")
            text = "".join(part.get("text", "") for part in m.content)
        plain.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    out = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def _requests(
    body: _Common, max_tokens: int, prompt: str = "", token_ids: tuple[int, ...] = ()
) -> list[GenerateRequest]:
    """One request per choice: `n` > 1 choices share the prompt's prefill, choice i seeded `seed + i`
    (the module's contract); greedy choices are all the same."""
    n, sampling = body.n or 1, body.sampling()
    rid = uuid.uuid4().hex[:12]
    if n > 1 and sampling.do_sample and sampling.seed is None:
        sampling = replace(sampling, seed=secrets.randbelow(MAX_SEED - MAX_N))
    return [
        GenerateRequest(
            prompt=prompt,
            token_ids=token_ids,
            max_new_tokens=max_tokens,
            sampling=sampling
            if i == 0 or sampling.seed is None
            else replace(sampling, seed=sampling.seed + i),
            stop=body.stops(),
            ignore_eos=body.ignore_eos,
            logprobs=body.top(),
            prompt_logprobs=getattr(body, "echo", False) and body.top() is not None,
            request_id=rid if n == 1 else f"{rid}-{i}",
            prefill_group=rid if n > 1 else "",
        )
        for i in range(n)
    ]


# -- running a request ---------------------------------------------------------------------------
def _error_of(event: Exception) -> ApiError:
    """The same table as the gRPC door's (odmoe.serving.error_status)."""
    status = status_of(event)
    return ApiError(status.http, message_of(event), kind=status.kind)


async def _events(ticket, request: Request | None):
    """The ticket's events as they come; cancels the request when the client has gone. A stream
    passes no `request`: sse-starlette watches the connection itself and cancels this generator
    (asking the request as well made both read the connection's messages and race)."""
    checked = time.monotonic()
    try:
        while True:
            event = await asyncio.to_thread(ticket.next, POLL_S)
            # every POLL_S, tokens flowing or not: with a token in every POLL_S, a check only in the
            # gaps never came, and a client gone mid-request kept its place to the end
            if request is not None and time.monotonic() - checked >= POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return  # the finally cancels the request
            if event is None:
                continue
            if event is END:
                return
            yield event
    finally:  # also when the stream's task is cancelled because the client disconnected
        ticket.cancel()


async def _answer(
    backend, request: Request, body: _Common, reqs: list[GenerateRequest], chat: bool, ping_s: float
):
    rid = ("chatcmpl-" if chat else "cmpl-") + (reqs[0].prefill_group or reqs[0].request_id)
    echo = getattr(body, "echo", False)
    texts, scored = TokenTexts(backend.tokenizer), body.top() is not None
    shape = _Shape(rid, int(time.time()), backend.model_name, chat, texts, scored, body.n or 1)
    echoed = [_echo_text(backend.tokenizer, r) if echo else "" for r in reqs]
    if echo and reqs[0].max_new_tokens == 0 and body.top() is None:  # the prompt back, nothing to compute
        prompts = [len(r.token_ids) or len(backend.tokenizer(r.prompt)["input_ids"]) for r in reqs]
        stats = [{"finish_reason": "length", "prompt_tokens": n, "new_tokens": 0} for n in prompts]
        return shape.whole([_Answer(t, s) for t, s in zip(echoed, stats, strict=True)])
    tickets = []
    try:
        for req in reqs:
            tickets.append(backend.submit(req, None))
    except (InvalidRequest, QueueFull, QueueClosed) as exc:
        for ticket in tickets:  # all choices or none
            ticket.cancel()
        raise _error_of(exc) from None
    if body.stream:
        options = body.stream_options or StreamOptions()
        running = len(reqs[0].token_ids) or len(backend.tokenizer(reqs[0].prompt)["input_ids"])
        running = running if options.continuous_usage_stats else None  # the prompt's tokens
        events = _stream(tickets, shape, options.include_usage, running, echoed)
        return EventSourceResponse(events, ping=ping_s, sep="\n")
    try:
        answers = await asyncio.gather(*(_collect(ticket, request) for ticket in tickets))
    finally:
        for ticket in tickets:
            ticket.cancel()  # an error in one choice: the others stop too (a no-op for finished ones)
    return shape.whole([replace(a, text=e + a.text) for a, e in zip(answers, echoed, strict=True)])


def _echo_text(tokenizer, request: GenerateRequest) -> str:
    """The prompt as echo gives it back: as sent, or the text its token ids decode to."""
    return request.prompt or tokenizer.decode(list(request.token_ids), skip_special_tokens=True)


@dataclass
class _Answer:
    """One choice: its text, stats, and with logprobs the scored prompt and new tokens."""

    text: str
    stats: dict
    scored: list[Scored] = field(default_factory=list)


async def _collect(ticket, request: Request) -> _Answer:
    """One choice's answer (ApiError when it failed, 499 when it was cancelled)."""
    text, stats, scored = [], None, []
    async for event in _events(ticket, request):
        if isinstance(event, TokenEvent):
            text.append(event.text)
            if event.logprob is not None:
                scored.append(Scored(event.token_id, event.logprob, event.top))
        elif isinstance(event, PromptEvent):
            scored[:0] = _prompt_scored(event)
        elif isinstance(event, DoneEvent):
            stats = event.stats
        elif isinstance(event, Exception):
            raise _error_of(event)
    if stats is None:
        raise ApiError(499, "the request was cancelled", kind="cancelled")
    return _Answer("".join(text), stats, scored)


def _prompt_scored(event: PromptEvent) -> list[Scored]:
    return [Scored(*entry) for entry in zip(event.token_ids, event.logprobs, event.top, strict=True)]


async def _stream(tickets, shape: _Shape, usage: bool, prompt_tokens: int | None, echoed: list[str]):
    """Every choice's chunks as they come (each with its index), then usage and [DONE]. With
    `prompt_tokens` (continuous_usage_stats) every chunk also carries the usage so far; with echo
    the first chunk of a choice is its prompt (and its prompt's logprobs when asked)."""
    if shape.chat:
        for index in range(len(tickets)):
            yield json.dumps(shape.chunk({"role": "assistant", "content": ""}, None, index))
    events: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, ticket) -> None:
        try:
            async for event in _events(ticket, None):
                await events.put((index, event))
        finally:
            await events.put((index, END))

    pumps = [asyncio.create_task(pump(i, t)) for i, t in enumerate(tickets)]
    sent = _Sent(shape, echoed, prompt_tokens, [[] for _ in tickets], [bool(e) for e in echoed])
    done, failed = 0, False
    try:
        while done < len(tickets):
            index, event = await events.get()
            if event is END:
                done += 1
            elif isinstance(event, Exception):
                yield json.dumps(_error_of(event).body())
                failed = True
                break
            else:
                for chunk in sent.chunks(index, event):
                    yield json.dumps(chunk)
        if usage and not failed:
            yield json.dumps({**shape.head(), "choices": [], "usage": _usage(*sent.stats, n=shape.n)})
        yield "[DONE]"
    finally:
        for task in pumps:
            task.cancel()
        for ticket in tickets:
            ticket.cancel()


@dataclass
class _Sent:
    """What a stream has sent so far: each choice's tokens (logprobs' text_offset), whether its echo
    is still to come, the tokens generated in all, the finished choices' stats."""

    shape: _Shape
    echoed: list[str]
    prompt_tokens: int | None  # continuous usage: every chunk carries the usage so far
    tokens: list[list[int]]
    echo_pending: list[bool]
    generated: int = 0
    stats: list[dict] = field(default_factory=list)

    def chunks(self, index: int, event) -> list[dict]:
        """The chunks one event of choice `index` makes (a token without text or logprobs: none)."""
        shape, tokens, out = self.shape, self.tokens[index], []
        if self.echo_pending[index] and not isinstance(event, PromptEvent):
            self.echo_pending[index] = False  # echo without logprobs: the prompt text alone first
            out.append(shape.chunk(self.echoed[index], None, index))
        if isinstance(event, PromptEvent):
            self.echo_pending[index] = False
            scored = _prompt_scored(event)
            out.append(shape.chunk(self.echoed[index], None, index, scored, tokens))
            tokens.extend(s.token_id for s in scored)
        elif isinstance(event, TokenEvent):
            self.generated += 1
            scored = [Scored(event.token_id, event.logprob, event.top)] if event.logprob is not None else []
            if event.text or scored:
                chunk = shape.chunk(event.text, None, index, scored, tokens)
                if self.prompt_tokens is not None:
                    chunk["usage"] = _usage(
                        {"prompt_tokens": self.prompt_tokens, "new_tokens": self.generated}
                    )
                out.append(chunk)
            tokens.append(event.token_id)
        elif isinstance(event, DoneEvent):
            self.stats.append(event.stats)
            out.append(shape.chunk("" if not shape.chat else {}, event.stats["finish_reason"], index))
        return out


def _usage(*stats: dict, n: int = 0) -> dict:
    """Tokens of the answer: each prompt once (its `n` choices share it), every choice's completion."""
    prompt = sum(s.get("prompt_tokens", 0) for s in stats[:: n or len(stats) or 1])
    completion = sum(s.get("new_tokens", 0) for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Shape:
    """The JSON shapes of one answer (completion or chat; whole or chunk by chunk)."""

    def __init__(self, rid, created, model, chat: bool, texts: TokenTexts, logprobs: bool, n: int = 1):
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.texts, self.logprobs, self.n = texts, logprobs, n  # n: choices per prompt

    def head(self, chunk: bool = True) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, scored: list[Scored], before: list[int]) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_content(self.texts, scored)
        shaped = completion_logprobs(self.texts, scored, 0)
        if before:  # a stream's later chunk: offsets in the whole text so far
            base = len(self.texts.tokenizer.decode(before, skip_special_tokens=True).rstrip("\ufffd"))
            shaped["text_offset"] = [base + o for o in shaped["text_offset"]]
        return shaped

    def chunk(
        self, piece, finish_reason: str | None, index: int = 0, scored=(), before: list[int] = ()
    ) -> dict:
        logprobs = self._logprobs(list(scored), list(before)) if scored else None
        if self.chat and not isinstance(piece, dict):
            piece = {"content": piece}
        key = "delta" if self.chat else "text"
        choice = {"index": index, key: piece, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self.head(), "choices": [choice]}

    def whole(self, answers: list[_Answer]) -> dict:
        key = "message" if self.chat else "text"
        choices = [
            {
                "index": index,
                key: {"role": "assistant", "content": a.text} if self.chat else a.text,
                "logprobs": self._logprobs(a.scored, []) if self.logprobs else None,
                "finish_reason": a.stats["finish_reason"],
            }
            for index, a in enumerate(answers)
        ]
        stats = [a.stats for a in answers]
        brief = _brief(stats[0])
        if len(stats) > 1:  # each choice's own (its seed among them)
            brief["choices"] = [_brief(s) for s in stats]
        usage = _usage(*stats, n=self.n)
        return {**self.head(chunk=False), "choices": choices, "usage": usage, "odmoe": brief}


def _brief(stats: dict) -> dict:
    """odmoe's own figures for this request (an extra field; OpenAI clients ignore it)."""
    keys = ("ttft_s", "decode_tokens_per_s", "experts_loaded", "reloads", "stall_s", "seed")
    keys += ("exact", "substitutions")  # exact: false when a lossy miss policy substituted an expert
    return {k: stats.get(k) for k in keys}


# -- serving -------------------------------------------------------------------------------------
def notice_silent_peers(sock: socket.socket, ping_s: float, ping_timeout_s: float) -> None:
    """TCP options on a listening socket that its accepted connections inherit (Linux copies them
    into each; tests/test_client_keepalive.py checks it): keepalive probes after `ping_s` of quiet,
    and the connection aborted once bytes it sent (data or probes) stay unacknowledged for
    `ping_timeout_s`, so a peer whose link black-holed is dropped within about their sum."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux; elsewhere TCP's own minutes
        idle_s = max(int(round(ping_s)), 1)  # the kernel counts keepalive in whole seconds
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, idle_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(int(ping_timeout_s * 1000), 1))


class HttpServer:
    """uvicorn in a thread of the main process, on a socket bound here (an OSError when the port is
    taken); `url` once bound. With `ping_s`, connections are accepted with `notice_silent_peers`'s
    options, set on the socket before it listens, so no connection is accepted without them."""

    def __init__(
        self,
        app: FastAPI,
        host: str,
        port: int,
        secrets: ServerSecrets | None = None,
        ping_s: float | None = None,
        ping_timeout_s: float = 3.0,
    ):
        self.sock = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        )
        # Accepted connections inherit it (Linux). asyncio sets TCP_NODELAY only where a socket's proto
        # says TCP, and create_server's says 0: with Nagle on, a whole answer's body waited for the
        # client's delayed ACK of its headers, 40 ms behind them over TLS
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ping_s:
            notice_silent_peers(self.sock, ping_s, ping_timeout_s)
        tls = {"ssl_certfile": str(secrets.cert), "ssl_keyfile": str(secrets.key)} if secrets else {}
        self.scheme = "https" if secrets else "http"
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="off", timeout_graceful_shutdown=2, **tls
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="odmoe-http", daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise OSError("the HTTP API did not start (see the log above)")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"{self.scheme}://{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


def start_http(
    backend,
    host: str,
    port: int,
    secrets: ServerSecrets | None = None,
    ping_s: float = 1.0,
    ping_timeout_s: float = 3.0,
) -> HttpServer:
    """`ping_s`, `ping_timeout_s`: how a client whose link went silent is found (module docstring)."""
    app = make_app(backend, secrets, ping_s=ping_s)
    server = HttpServer(app, host, port, secrets, ping_s=ping_s, ping_timeout_s=ping_timeout_s)
    server.start()
    return server
