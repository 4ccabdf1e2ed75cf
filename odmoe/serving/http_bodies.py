"""The OpenAI-compatible door's request bodies and its error: what a client may send, checked as
it arrives (pydantic), and turned into main's sampling parameters. The handlers are
odmoe/serving/http_api.py; the limits are main's (odmoe/main/request_limits.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from odmoe.main.request_limits import MAX_LOGPROBS, MAX_STOPS
from odmoe.main.sampling import SamplingParams

MAX_N = 64  # choices per request (each runs as a request of its own, sharing the prompt's prefill)


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        }


# -- request bodies ------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's extension (serving benchmarks send it): every chunk carries the usage so far
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Parameters of both endpoints. Unknown fields are refused (extra="forbid")."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=0)  # 0: completions with echo only (scoring)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 (vLLM) or 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as every server does
    # vLLM's extension, which serving benchmarks (guidellm, aiperf) send to fix the output length:
    # an end-of-sequence token does not end the request (the token is still generated and shown)
    ignore_eos: bool = False
    n: int | None = Field(default=1, ge=1, le=MAX_N)  # choices; each samples with seed + its index
    # not implemented: refused unless neutral
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict | None = None

    def refuse_unsupported(self) -> None:
        neutral = {
            "presence_penalty": (not self.presence_penalty, "presence_penalty is not supported"),
            "frequency_penalty": (
                not self.frequency_penalty,
                "frequency_penalty is not supported (repetition_penalty is)",
            ),
            "logit_bias": (not self.logit_bias, "logit_bias is not supported"),
        }
        for param, (ok, message) in neutral.items():
            if not ok:
                raise ApiError(400, message, param)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or not all(stops):
            raise ApiError(400, f"stop takes at most {MAX_STOPS} non-empty strings", "stop")
        return tuple(stops)

    def sampling(self) -> SamplingParams:
        greedy = self.temperature == 0
        return SamplingParams(
            do_sample=not greedy,
            temperature=None if greedy else self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
        )


class CompletionBody(_Common):
    # one prompt (a string or token ids), or a batch: several strings or token-id lists, one choice
    # each (n choices each with n > 1), in order: what evaluation harnesses send
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the prompt back before the completion (with its logprobs when asked)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # best tokens per position
    best_of: int | None = None
    suffix: str | None = None

    def top(self) -> int | None:
        return self.logprobs


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # vLLM's also takes "model", "messages" ...: not needed
    prompt: str
    add_special_tokens: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]
    name: str | None = None


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False  # each new token's logprob
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # and the best ones (with logprobs)

    def top(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None
