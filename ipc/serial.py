"""msgpack encoding (msgspec) of the messages in ipc/messages.py, one frame per message. Never pickle.

encode(obj) -> [body]: a list, because every sender hands it to a ZeroMQ multipart send (often after a
token or an identity frame). decode(frames) takes that one-frame list (or the bytes) back to the
decoder's type. No message carries a tensor or an array (every Struct holds numbers, strings and lists
of them), so ipc/ imports neither torch nor numpy and the API process stays free of both.

The decoder trusts nothing in a message: every malformed input ends in ValueError or
msgspec.DecodeError. That includes msgpack Ext values (no sender makes one; a hostile peer may) and
messages of more than one frame. The one Ext that msgpack itself defines, the timestamp, is decoded by
msgspec as a datetime, and only where a field's type admits any value (the untyped lists and dicts of a
result): no message a client sends has such a field.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import msgspec

Frame = Union[bytes, bytearray, memoryview]


class MsgpackEncoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_refuse_unknown)

    def encode(self, obj: Any) -> list[Frame]:
        return [self._encoder.encode(obj)]


def _refuse_unknown(obj: Any) -> Any:
    raise TypeError(f"cannot serialize an object of type {type(obj).__module__}.{type(obj).__qualname__}")


class MsgpackDecoder:
    """decode(frames) -> an object of the given type, from a one-frame message."""

    def __init__(self, typ: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(typ, ext_hook=_reject_ext)

    def decode(self, frames: Union[Sequence[Any], Frame]) -> Any:
        if isinstance(frames, (bytes, bytearray, memoryview)):
            frames = [frames]
        if not isinstance(frames, Sequence):
            raise ValueError(f"a message is a list of frames, got {type(frames).__name__}")
        if len(frames) != 1:
            raise ValueError(f"a message is exactly one frame, got {len(frames)} frames")
        return self._decoder.decode(_as_bytes_view(frames[0]))


def _reject_ext(code: int, data: memoryview) -> Any:
    raise ValueError(f"msgpack extension type {code} is not accepted: no message carries one")


def _as_bytes_view(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)     # a zmq.Frame exposes its bytes as .buffer
    try:
        view = memoryview(buf)
    except TypeError:
        raise ValueError(f"a frame must be a bytes-like object, got {type(frame).__name__}") from None
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ValueError("a frame must be a contiguous buffer")
    return view.cast("B")
