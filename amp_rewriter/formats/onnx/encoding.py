"""Protobuf's wire format, for writing parts of an ONNX model without building the message.

A message's encoding is the concatenation of its fields' encodings, and the encodings of two
messages concatenated read as the two merged: so a million nodes can be encoded one at a time
and joined, instead of copied into one message first (four times the memory of their encoding).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: Field numbers of onnx.proto: ModelProto.graph, GraphProto.node, GraphProto.value_info.
MODEL_GRAPH, GRAPH_NODE, GRAPH_VALUE_INFO = 7, 1, 13


def varint(number: int) -> bytes:
    """`number` (>= 0) as a protobuf varint."""
    out = bytearray()
    while number > 0x7F:
        out.append((number & 0x7F) | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def field_key(field_number: int) -> bytes:
    """The key of a length-delimited field (a message, a string)."""
    return varint(field_number << 3 | 2)


def append_field(out: bytearray, field_number: int, payload: bytes | bytearray) -> None:
    """Append to `out` one entry of field `field_number` holding `payload`."""
    out += field_key(field_number)
    out += varint(len(payload))
    out += payload


def encoded_fields(field_number: int, messages: Iterable[Any]) -> bytearray:
    """Each message encoded as one entry of repeated message field `field_number`."""
    out = bytearray()
    for message in messages:
        append_field(out, field_number, message.SerializeToString())
    return out
