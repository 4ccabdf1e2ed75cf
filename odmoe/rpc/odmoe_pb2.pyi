from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "token_ids", "max_new_tokens", "request_id", "return_logits")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    request_id: str
    return_logits: bool
    def __init__(
        self,
        prompt: str | None = ...,
        token_ids: _Iterable[int] | None = ...,
        max_new_tokens: int | None = ...,
        request_id: str | None = ...,
        return_logits: bool | None = ...,
    ) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("token", "done")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    token: TokenPiece
    done: Done
    def __init__(
        self, token: TokenPiece | _Mapping | None = ..., done: Done | _Mapping | None = ...
    ) -> None: ...

class TokenPiece(_message.Message):
    __slots__ = ("token_id", "text")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    def __init__(self, token_id: int | None = ..., text: str | None = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("stats_json", "final_logits")
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    FINAL_LOGITS_FIELD_NUMBER: _ClassVar[int]
    stats_json: str
    final_logits: bytes
    def __init__(self, stats_json: str | None = ..., final_logits: bytes | None = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("model_path", "family", "workers", "group_size", "info_json")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    family: str
    workers: int
    group_size: int
    info_json: str
    def __init__(
        self,
        model_path: str | None = ...,
        family: str | None = ...,
        workers: int | None = ...,
        group_size: int | None = ...,
        info_json: str | None = ...,
    ) -> None: ...
