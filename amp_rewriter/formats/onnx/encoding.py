"""Protobuf's wire format, for writing parts of an ONNX model without building the message.

A message's encoding is the concatenation of its fields' encodings, and the encodings of two
messages concatenated read as the two merged: so a million nodes can be encoded one at a time
and joined, instead of copied into one message first (four times the memory of their encoding).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from functools import cache
from typing import Any

import onnx

from ...packed import PackedRecords

#: Field numbers of onnx.proto: ModelProto.graph, GraphProto.node, GraphProto.value_info.
MODEL_GRAPH, GRAPH_NODE, GRAPH_VALUE_INFO = 7, 1, 13
#: NodeProto.name and NodeProto.op_type (protobuf writes a node's input and output names
#: first, then these).
NODE_NAME, NODE_OP_TYPE = 3, 4


def varint(number: int) -> bytes:
    """`number` (>= 0) as a protobuf varint."""
    out = bytearray()
    while number > 0x7F:
        out.append((number & 0x7F) | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def read_varint(data: bytes | bytearray, at: int) -> tuple[int, int]:
    """The varint at `at` in `data`, and where it ends."""
    number = shift = 0
    while True:
        byte = data[at]
        at += 1
        number |= (byte & 0x7F) << shift
        if byte < 0x80:
            return number, at
        shift += 7


@cache
def field_key(field_number: int) -> bytes:
    """The key of a length-delimited field (a message, a string)."""
    return varint(field_number << 3 | 2)


#: The varints of the lengths most fields have (a node's encoding is rarely 16 KB), made once:
#: `append_field` runs once per node.
_SHORT_VARINTS = tuple(varint(number) for number in range(1 << 14))


def append_field(out: bytearray, field_number: int, payload: bytes | bytearray) -> None:
    """Append to `out` one entry of field `field_number` holding `payload`."""
    out += field_key(field_number)
    size = len(payload)
    out += _SHORT_VARINTS[size] if size < len(_SHORT_VARINTS) else varint(size)
    out += payload


def encoded_fields(field_number: int, messages: Iterable[Any]) -> bytearray:
    """Each message encoded as one entry of repeated message field `field_number`."""
    out = bytearray()
    for message in messages:
        append_field(out, field_number, message.SerializeToString())
    return out


#: Nodes whose names `EncodedNodes` keeps in one marshalled chunk.
NAME_CHUNK = 100_000

#: A node's op type, input names and output names.
NodeNames = tuple[str, tuple[str, ...], tuple[str, ...]]


class EncodedNodes:
    """A graph's nodes as they lie encoded in a buffer, with their op types and value names:
    what reading them back through protobuf would give, without building a message per node
    (seconds at a million nodes). Filled by an emitter as it encodes (`add`), then placed in
    the model's encoding (`place`)."""

    def __init__(self) -> None:
        self.buffer: bytes | bytearray = b""
        self.start = 0
        #: End of each node's field, from the start of the first.
        self.ends = array("Q")
        self._names = PackedRecords(NAME_CHUNK)

    def __len__(self) -> int:
        return len(self.ends)

    def add(self, end: int, op_type: str, inputs: tuple[str, ...],
            outputs: tuple[str, ...]) -> None:
        """Record the next node: where its field ends, its op type and value names."""
        self.ends.append(end)
        self._names.append((op_type, inputs, outputs))

    def pack(self) -> None:
        """Pack the names recorded since the last full block (`PackedRecords.seal`)."""
        self._names.seal()

    def place(self, buffer: bytes | bytearray, start: int) -> None:
        """The nodes now lie in `buffer` from `start` on."""
        self.buffer, self.start = buffer, start

    def fields(self, first: int, last: int) -> bytes:
        """The encoded fields of nodes `first` to `last` - 1, as one run."""
        begin = self.ends[first - 1] if first else 0
        return bytes(memoryview(self.buffer)[self.start + begin:self.start + self.ends[last - 1]])

    def names_between(self, first: int, last: int) -> list[NodeNames]:
        """The op type, input names and output names of nodes `first` to `last` - 1."""
        names: list[NodeNames] = self._names.between(first, last)
        return names


class EncodedModel:
    """A converted model as one encoding, before it is parsed: what the cost summary's
    inference and the checker read, at a fraction of a parsed model's memory (at a million
    nodes the encoding is about 200 MB, the parsed model 500 MB more)."""

    def __init__(self, encoding: bytearray, head_length: int, graph_length: int,
                 nodes: EncodedNodes | None):
        self.encoding = encoding
        self._head_length = head_length
        self._graph_length = graph_length
        #: Where the main graph's nodes lie in `encoding`, with their names.
        self.nodes = nodes

    def shell(self) -> onnx.ModelProto:
        """The model without its main graph's nodes (their count: `len(self.nodes)`)."""
        with memoryview(self.encoding) as view:
            shell = onnx.ModelProto.FromString(bytes(view[:self._head_length]))
            shell.graph.MergeFromString(bytes(view[len(self.encoding) - self._graph_length:]))
        return shell

    def parse(self) -> onnx.ModelProto:
        """The whole ModelProto."""
        return onnx.ModelProto.FromString(self.encoding)
