"""Client SDK: talk to a running cluster's main node over gRPC.

    client = odmoe.Client("127.0.0.1:50051")
    result = client.generate("def fibonacci(n):", max_new_tokens=32)
    result.text, result.token_ids, result.stats
    for piece in client.stream("def f(x):", max_new_tokens=16): print(piece.text, end="")

A prompt string is tokenized by main exactly as `tokenizer(prompt)` (no chat template); a list of
ints is sent as token ids. Errors arrive as `grpc.RpcError` with INVALID_ARGUMENT,
FAILED_PRECONDITION or UNAVAILABLE and a readable message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import torch

from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc


@dataclass(frozen=True)
class Piece:
    token_id: int
    text: str


@dataclass
class GenerateResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the new tokens only
    stats: dict = field(default_factory=dict)
    final_logits: torch.Tensor | None = None  # [vocab] fp32 when asked for (return_logits=True)


class Client:
    def __init__(self, address: str, timeout_s: float | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = odmoe_pb2_grpc.InferenceStub(self._channel)

    def _request(self, prompt: str | list[int], max_new_tokens: int, return_logits: bool, request_id: str):
        if isinstance(prompt, str):
            return odmoe_pb2.GenerateRequest(
                prompt=prompt,
                max_new_tokens=max_new_tokens,
                return_logits=return_logits,
                request_id=request_id,
            )
        return odmoe_pb2.GenerateRequest(
            token_ids=list(prompt),
            max_new_tokens=max_new_tokens,
            return_logits=return_logits,
            request_id=request_id,
        )

    def _replies(self, prompt, max_new_tokens, return_logits=False, request_id=""):
        request = self._request(prompt, max_new_tokens, return_logits, request_id)
        return self._stub.Generate(request, timeout=self.timeout_s)

    def stream(self, prompt: str | list[int], max_new_tokens: int = 32) -> Iterator[Piece]:
        for reply in self._replies(prompt, max_new_tokens):
            if reply.WhichOneof("kind") == "token":
                yield Piece(reply.token.token_id, reply.token.text)

    def generate(
        self,
        prompt: str | list[int],
        max_new_tokens: int = 32,
        return_logits: bool = False,
        request_id: str = "",
    ) -> GenerateResult:
        result = GenerateResult()
        for reply in self._replies(prompt, max_new_tokens, return_logits, request_id):
            if reply.WhichOneof("kind") == "token":
                result.token_ids.append(reply.token.token_id)
                result.text += reply.token.text
            else:
                result.stats = json.loads(reply.done.stats_json)
                if reply.done.final_logits:
                    result.final_logits = torch.frombuffer(
                        bytearray(reply.done.final_logits), dtype=torch.float32
                    )
        return result

    def info(self) -> dict:
        reply = self._stub.Info(odmoe_pb2.InfoRequest(), timeout=self.timeout_s)
        return {
            "model_path": reply.model_path,
            "family": reply.family,
            "workers": reply.workers,
            "group_size": reply.group_size,
            **json.loads(reply.info_json),
        }

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
