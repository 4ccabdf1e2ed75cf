"""Text that is not valid Unicode, refused where requests enter, with the field that holds it.

Contract: each function returns None for valid input, else a `BadText`: the field (`messages[0].
content`, `prompt[2]`, `stop[1]`; None for a whole HTTP body) and a sentence for the client naming
it, so a front door can answer 400 / INVALID_ARGUMENT before any work is done.
- `invalid_utf8(raw)`: an HTTP body's bytes that are not UTF-8 (JSON between systems must be,
  RFC 8259 §8.1), with the offset of the first bad byte.
- `invalid_text(value)`: the first string (or object key) of a parsed JSON value, or of a Python
  prompt, that is not valid Unicode: a lone surrogate, which JSON's `\\ud800` escape can carry
  although no UTF-8 can, and which the tokenizer refuses with a TypeError.
- `invalid_proto_text(message_class, raw)`: a serialized protobuf whose `string` fields (nested
  messages' too) hold bytes that are not UTF-8. protobuf refuses to parse such a message at all
  ("String field had bad UTF-8", naming no field), which gRPC answered INTERNAL.
- `TextCheck`: a gRPC server interceptor that parses each request itself and answers
  INVALID_ARGUMENT naming the field, or what else is wrong with it, instead.

Why at the doors rather than in the engine: the tokenizer is called on the request's thread (the
HTTP door tokenizes chat messages itself), and one check where bytes become text covers every
route that takes text, present or future.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import empty_pb2, unknown_fields
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class BadText:
    field: str | None  # where the text is (None: the whole body)
    message: str


def invalid_utf8(raw: bytes, field: str | None = None) -> BadText | None:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        what = field or "the request body"
        return BadText(
            field, f"{what} is not valid UTF-8 (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})"
        )
    return None


def invalid_text(value: object, path: str = "") -> BadText | None:
    """The first string in `value` (str, list, tuple, dict; depth-first, in order) that cannot be
    encoded as UTF-8, named by its path from `path`."""
    if isinstance(value, str):
        if why := _lone_surrogate(value):
            return BadText(path or None, f"{path or 'the text'} is not valid Unicode: {why}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if found := invalid_text(item, f"{path}[{i}]"):
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            if why := _lone_surrogate(str(key)):  # the name itself cannot be shown back
                return BadText(
                    path or None, f"a field name in {path or 'the body'} is not valid Unicode: {why}"
                )
            if found := invalid_text(item, f"{path}.{key}" if path else str(key)):
                return found
    return None


def _lone_surrogate(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate {text[exc.start]!r} at character {exc.start}"
    return None


def invalid_proto_text(message_class, raw: bytes) -> BadText | None:
    """Which string field of `raw` (a serialized `message_class`) is not UTF-8; None if none is
    (the message may still fail to parse for another reason)."""
    return _bad_strings(message_class.DESCRIPTOR, raw, "")


def _bad_strings(descriptor: Descriptor, raw: bytes, path: str) -> BadText | None:
    # parsed as an empty message every field is unknown: its number and raw bytes, nothing decoded
    try:
        fields = unknown_fields.UnknownFieldSet(empty_pb2.Empty.FromString(raw))
    except DecodeError:
        return None
    seen: dict[int, int] = {}  # field number -> elements of it so far (a repeated field's index)
    for unknown in fields:
        field = descriptor.fields_by_number.get(unknown.field_number)
        if field is None or not isinstance(unknown.data, bytes):
            continue
        n = seen[field.number] = seen.get(field.number, -1) + 1
        name = f"{path}{field.name}" + (f"[{n}]" if _repeated(field) else "")
        if field.type == FieldDescriptor.TYPE_STRING:
            if found := invalid_utf8(unknown.data, name):
                return found
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if found := _bad_strings(field.message_type, unknown.data, name + "."):
                return found
    return None


def _repeated(field: FieldDescriptor) -> bool:
    # protobuf 7 has only is_repeated; protobuf 6 (pyproject allows it) may have only label
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return bool(field.label == 3)  # LABEL_REPEATED


class _Refused:
    """What a request that did not parse becomes: its handler answers INVALID_ARGUMENT with `why`."""

    def __init__(self, why: str):
        self.why = why


class TextCheck(grpc.ServerInterceptor):
    """Every request is parsed here: one that does not parse (bad UTF-8 in a string field, or
    malformed) ends INVALID_ARGUMENT with the reason, naming the field when it is a string's."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        parse, name = handler.request_deserializer, details.method.rsplit("/", 1)[-1]
        message_class = getattr(parse, "__self__", None)  # Message.FromString is a classmethod

        def tolerant(raw: bytes):
            try:
                return parse(raw)
            except DecodeError as exc:
                bad = invalid_proto_text(message_class, raw) if message_class is not None else None
                return _Refused(bad.message if bad else f"the {name} request does not parse: {exc}")

        behaviour = handler.unary_stream if handler.response_streaming else handler.unary_unary

        def checked(request, context):
            if isinstance(request, _Refused):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.why)
            return behaviour(request, context)

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(checked, tolerant, handler.response_serializer)
