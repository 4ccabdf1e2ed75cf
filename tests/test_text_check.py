"""Text that is not valid Unicode, refused where requests enter (odmoe/serving/text_check.py): the
pure checks, the HTTP door (the real app over a stand-in backend with the test model's own
tokenizer) and the gRPC door's interceptor (an in-process server). A real cluster answers the same
in tests/test_http_api.py and tests/test_bad_input.py."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from odmoe.rpc import odmoe_pb2, odmoe_pb2_grpc
from odmoe.serving.http_api import make_app
from odmoe.serving.text_check import TextCheck, invalid_proto_text, invalid_text, invalid_utf8

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

LONE = "\ud800abc"  # valid JSON as "\\ud800abc", not valid Unicode


# -- the checks ----------------------------------------------------------------------------------
def test_invalid_text_names_the_first_bad_string_by_its_path():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}
    bad = invalid_text(body)
    assert bad is not None and bad.field == "messages[0].content[0].text"
    assert "lone surrogate '\\ud800' at character 0" in bad.message
    assert invalid_text({"prompt": ["ok", "x" + LONE]}).field == "prompt[1]"  # type: ignore[union-attr]
    assert invalid_text({"a": {"b\udc00": 1}}).field == "a"  # type: ignore[union-attr]
    assert invalid_text({"prompt": "ok", "stop": ["\n", "é 漢 🙂"], "n": 2}) is None


def test_a_message_never_carries_the_bad_text_itself():
    """The answer is JSON encoded as UTF-8: a lone surrogate in it would break the error too."""
    for value in ({"x\ud800": 1}, {"p": LONE}, [LONE]):
        bad = invalid_text(value)
        assert bad is not None
        bad.message.encode("utf-8")


def test_invalid_utf8_gives_the_offset():
    assert invalid_utf8(b'{"prompt": "ok"}') is None
    bad = invalid_utf8(b'{"prompt": "\xffok"}')
    assert bad is not None and bad.field is None and "byte 12" in bad.message
    assert invalid_utf8(b"\xed\xa0\x80") is not None  # a surrogate written as UTF-8 is not UTF-8


def test_invalid_proto_text_names_the_string_field():
    good = odmoe_pb2.GenerateRequest(prompt="ok", stop=["a", "b"]).SerializeToString()
    assert invalid_proto_text(odmoe_pb2.GenerateRequest, good) is None
    raw = bytearray(good)
    raw[raw.index(b"b")] = 0xFF  # the second stop string
    bad = invalid_proto_text(odmoe_pb2.GenerateRequest, bytes(raw))
    assert bad is not None and bad.field == "stop[1]"
    raw = odmoe_pb2.GenerateRequest(prompt="okay", max_new_tokens=3).SerializeToString()
    bad = invalid_proto_text(odmoe_pb2.GenerateRequest, raw.replace(b"okay", b"ok\xed\xa0"))
    assert bad is not None and bad.field == "prompt"


# -- the HTTP door -------------------------------------------------------------------------------
class Backend:
    """What make_app needs from main; a request that reaches `submit` is refused 429 (none should)."""

    model_name, context_length, tokenizer_vocab_size = "m", 256, 1024

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.submitted = 0

    def health(self) -> None:
        return None

    def submit(self, request, timeout_s):
        from odmoe.main.request_queue import QueueFull

        self.submitted += 1
        raise QueueFull("stand-in backend")


@pytest.fixture(scope="module")
def http(model_dirs):
    backend = Backend(AutoTokenizer.from_pretrained(model_dirs["mixtral"]))
    return TestClient(make_app(backend), raise_server_exceptions=False), backend


def _post(client, path: str, raw: bytes):
    return client.post(path, content=raw, headers={"content-type": "application/json"})


# (route, JSON body with \ud800 escapes written as such, the field the answer must name)
LONE_SURROGATES = [
    ("/v1/completions", '{"model": "m", "prompt": "\\ud800abc"}', "prompt"),
    ("/v1/completions", '{"model": "m", "prompt": ["ok", "\\udfff"]}', "prompt[1]"),
    ("/v1/completions", '{"model": "m", "prompt": "ok", "stop": ["\\ud800"]}', "stop[0]"),
    ("/v1/completions", '{"model": "m\\ud800", "prompt": "ok"}', "model"),
    ("/v1/completions", '{"model": "m", "prompt": "ok", "user": "\\udc00"}', "user"),
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "\\ud800abc"}]}',
     "messages[0].content"),
    ("/v1/chat/completions",
     '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions",
     '{"model": "m", "messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}',
     "messages[0].name"),
    ("/tokenize", '{"prompt": "\\ud800abc"}', "prompt"),
    ("/detokenize", '{"tokens": [1], "note": "\\ud800"}', "note"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,field", LONE_SURROGATES)
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(http, path, body, field):
    client, backend = http
    reply = _post(client, path, body.encode())
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["message"].startswith(f"{field} is not valid Unicode")
    assert backend.submitted == 0


BAD_BYTES = [
    ("/v1/completions", b'{"model": "m", "prompt": "\xff\xfeabc"}', 26),
    ("/v1/completions", b'{"model": "m", "prompt": "\xed\xa0\x80abc"}', 26),  # a surrogate as UTF-8
    ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\xc3"}]}', 57),
    ("/tokenize", b'{"prompt": "ok\x80"}', 14),
    ("/v1/completions", '{"model": "m", "prompt": "ok"}'.encode("utf-16"), 0),  # JSON, not UTF-8
]


@pytest.mark.parametrize("path,raw,offset", BAD_BYTES)
def test_a_body_that_is_not_utf8_is_a_400_naming_the_byte(http, path, raw, offset):
    client, _ = http
    reply = _post(client, path, raw)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"].startswith(f"the request body is not valid UTF-8 (byte {offset}")
    assert error["type"] == "invalid_request_error" and error["param"] is None


def test_after_bad_text_the_next_request_is_answered(http, model_dirs):
    client, _ = http
    text = "é 漢 🙂 def f():"
    for path, raw in [(p, b.encode()) for p, b, _ in LONE_SURROGATES] + [(p, r) for p, r, _ in BAD_BYTES]:
        assert _post(client, path, raw).status_code == 400
        reply = _post(client, "/tokenize", json.dumps({"prompt": text}).encode())
        assert reply.status_code == 200, reply.text
    want = AutoTokenizer.from_pretrained(model_dirs["mixtral"])(text)["input_ids"]
    assert reply.json()["tokens"] == want


# -- the gRPC door -------------------------------------------------------------------------------
class Echo(odmoe_pb2_grpc.InferenceServicer):
    def Generate(self, request, context):
        yield odmoe_pb2.GenerateReply(token=odmoe_pb2.TokenPiece(token_id=1, text=request.prompt))

    def Info(self, request, context):
        return odmoe_pb2.InfoReply(model_path="here")


@pytest.fixture(scope="module")
def grpc_door():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[TextCheck()])
    odmoe_pb2_grpc.add_InferenceServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    server.stop(grace=None)


def _raw_generate(channel, raw: bytes) -> list:
    """Generate with these request bytes as they are (no client-side protobuf to refuse them)."""
    call = channel.unary_stream(
        "/odmoe.rpc.Inference/Generate", response_deserializer=odmoe_pb2.GenerateReply.FromString
    )
    return list(call(raw, timeout=10))


def _bad(**fields) -> bytes:
    """A GenerateRequest whose string "okay" fields are made bad UTF-8."""
    return odmoe_pb2.GenerateRequest(**fields).SerializeToString().replace(b"okay", b"ok\xff\xfe")


@pytest.mark.parametrize(
    "raw,field",
    [
        (_bad(prompt="okay", max_new_tokens=4), "prompt"),
        (_bad(prompt="fine", stop=["\n", "okay"]), "stop[1]"),
        (_bad(token_ids=[1, 2], request_id="okay"), "request_id"),
    ],
)
def test_grpc_bad_utf8_is_invalid_argument_naming_the_field(grpc_door, raw, field):
    with pytest.raises(grpc.RpcError) as caught:
        _raw_generate(grpc_door, raw)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{field} is not valid UTF-8")
    # and the next request is served
    good = odmoe_pb2.GenerateRequest(prompt="é 漢 🙂").SerializeToString()
    assert [r.token.text for r in _raw_generate(grpc_door, good)] == ["é 漢 🙂"]


def test_grpc_a_request_that_does_not_parse_is_invalid_argument(grpc_door):
    with pytest.raises(grpc.RpcError) as caught:
        _raw_generate(grpc_door, b"\x0a\x09ok")  # says 9 bytes follow, 2 do
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the Generate request does not parse" in caught.value.details()
    info = odmoe_pb2_grpc.InferenceStub(grpc_door).Info(odmoe_pb2.InfoRequest(), timeout=10)
    assert info.model_path == "here"
