"""The ZeroMQ wire between a front end and its core process.

Every message is two frames: its kind (one byte, an `EngineCoreRequestType` towards the core or an
`EngineCoreOutputType` from it), which says how to decode the body, and its msgpack body (a msgspec
Struct of engine/outputs.py). Nothing from a socket is ever unpickled.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import zmq

from engine.outputs import (
    AbortRequests,
    EngineCoreFailure,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    StopSequence,
    UtilityOutput,
    UtilityRequest,
)

K = TypeVar("K", EngineCoreRequestType, EngineCoreOutputType)

# Each kind's body, both directions in one table. (Pairs, not a dict: the two enums are bytes, so a
# kind of one direction equals the kind of the other with the same byte.)
_BODY_TYPES: tuple[tuple[enum.Enum, type[msgspec.Struct]], ...] = (
    (EngineCoreRequestType.ADD, EngineCoreRequest),
    (EngineCoreRequestType.ABORT, AbortRequests),
    (EngineCoreRequestType.STOP_SEQUENCE, StopSequence),
    (EngineCoreRequestType.UTILITY, UtilityRequest),
    (EngineCoreOutputType.OUTPUTS, EngineCoreOutputs),
    (EngineCoreOutputType.UTILITY, UtilityOutput),
    (EngineCoreOutputType.READY, EngineCoreReady),
    (EngineCoreOutputType.FAILURE, EngineCoreFailure),
)


class MessageDecoder(Generic[K]):
    """Decodes the messages of one direction, named by its kind enum."""

    def __init__(self, kinds: type[K]) -> None:
        self._kinds = kinds
        self._decoders = {
            kind: msgspec.msgpack.Decoder(body_type)
            for kind, body_type in _BODY_TYPES
            if isinstance(kind, kinds)
        }

    def decode(self, frames: Sequence[zmq.Frame]) -> tuple[K, Any]:
        kind_frame, body = frames
        kind = self._kinds(kind_frame.bytes)
        return kind, self._decoders[kind].decode(body.buffer)


def encode_message(encoder: msgspec.msgpack.Encoder, kind: K, message: msgspec.Struct) -> tuple[bytes, bytes]:
    """The two frames of `message` (each sending thread keeps its own encoder)."""
    return kind.value, encoder.encode(message)
