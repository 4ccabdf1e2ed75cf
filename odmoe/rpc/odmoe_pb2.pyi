from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "token_ids", "max_new_tokens", "request_id", "return_logits", "resume_ids", "sampling", "stop", "timeout_s", "logprobs", "prompt_logprobs", "ignore_eos")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    RESUME_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    request_id: str
    return_logits: bool
    resume_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    stop: _containers.RepeatedScalarFieldContainer[str]
    timeout_s: float
    logprobs: int
    prompt_logprobs: bool
    ignore_eos: bool
    def __init__(self, prompt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., return_logits: _Optional[bool] = ..., resume_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., timeout_s: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int
    def __init__(self, do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("token", "done", "prompt")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    token: TokenPiece
    done: Done
    prompt: PromptLogprobs
    def __init__(self, token: _Optional[_Union[TokenPiece, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., prompt: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class TokenPiece(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("stats_json", "final_logits")
    STATS_JSON_FIELD_NUMBER: _ClassVar[int]
    FINAL_LOGITS_FIELD_NUMBER: _ClassVar[int]
    stats_json: str
    final_logits: bytes
    def __init__(self, stats_json: _Optional[str] = ..., final_logits: _Optional[bytes] = ...) -> None: ...

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
    def __init__(self, model_path: _Optional[str] = ..., family: _Optional[str] = ..., workers: _Optional[int] = ..., group_size: _Optional[int] = ..., info_json: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("role", "index", "address", "pub_address", "where")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PUB_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    role: str
    index: int
    address: str
    pub_address: str
    where: str
    def __init__(self, role: _Optional[str] = ..., index: _Optional[int] = ..., address: _Optional[str] = ..., pub_address: _Optional[str] = ..., where: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("detail",)
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    detail: str
    def __init__(self, detail: _Optional[str] = ...) -> None: ...

class ShareIndexRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShareIndexReply(_message.Message):
    __slots__ = ("index_json",)
    INDEX_JSON_FIELD_NUMBER: _ClassVar[int]
    index_json: str
    def __init__(self, index_json: _Optional[str] = ...) -> None: ...

class ShareReadRequest(_message.Message):
    __slots__ = ("file", "offset", "length")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    file: str
    offset: int
    length: int
    def __init__(self, file: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ShareChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class ChallengeRequest(_message.Message):
    __slots__ = ("box_nonce",)
    BOX_NONCE_FIELD_NUMBER: _ClassVar[int]
    box_nonce: bytes
    def __init__(self, box_nonce: _Optional[bytes] = ...) -> None: ...

class ChallengeReply(_message.Message):
    __slots__ = ("nonce", "main_proof")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    MAIN_PROOF_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    main_proof: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., main_proof: _Optional[bytes] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("nonce", "proof", "role", "name", "host", "public_key")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    proof: bytes
    role: str
    name: str
    host: str
    public_key: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ..., role: _Optional[str] = ..., name: _Optional[str] = ..., host: _Optional[str] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class AdmitReply(_message.Message):
    __slots__ = ("name", "role", "index", "public_keys", "secret_key", "cert_pem", "token", "words")
    class PublicKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEYS_FIELD_NUMBER: _ClassVar[int]
    SECRET_KEY_FIELD_NUMBER: _ClassVar[int]
    CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    index: int
    public_keys: _containers.ScalarMap[str, bytes]
    secret_key: bytes
    cert_pem: bytes
    token: str
    words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., index: _Optional[int] = ..., public_keys: _Optional[_Mapping[str, bytes]] = ..., secret_key: _Optional[bytes] = ..., cert_pem: _Optional[bytes] = ..., token: _Optional[str] = ..., words: _Optional[_Iterable[str]] = ...) -> None: ...

class ReadyRequest(_message.Message):
    __slots__ = ("name", "address", "pub_address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PUB_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    pub_address: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., pub_address: _Optional[str] = ...) -> None: ...

class ReadyReply(_message.Message):
    __slots__ = ("detail",)
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    detail: str
    def __init__(self, detail: _Optional[str] = ...) -> None: ...

class KeysRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeysReply(_message.Message):
    __slots__ = ("public_keys",)
    class PublicKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    PUBLIC_KEYS_FIELD_NUMBER: _ClassVar[int]
    public_keys: _containers.ScalarMap[str, bytes]
    def __init__(self, public_keys: _Optional[_Mapping[str, bytes]] = ...) -> None: ...
