"""msgpack encoding (msgspec) with tensors and arrays as separate raw frames. Never pickle."""
from __future__ import annotations

import warnings
from typing import Any

import msgspec
import numpy as np
import torch

_TENSOR_EXT = 1
_ARRAY_EXT = 2
INLINE_BYTES = 256      # smaller buffers ride inside the body: a frame costs more than the copy


class MsgpackEncoder:
    """encode(obj) -> [body, *raw buffers]; a tensor in obj becomes an Ext pointing at its frame."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._hook)
        self._frames: list[Any] = []

    def encode(self, obj: Any) -> list[Any]:
        self._frames = [b""]
        try:
            self._frames[0] = self._encoder.encode(obj)
            return self._frames
        finally:
            self._frames = []

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous().cpu()
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
            return msgspec.msgpack.Ext(_TENSOR_EXT, self._meta(str(t.dtype).removeprefix("torch."), t.shape, raw))
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError("numpy arrays of Python objects cannot be serialized")
            a = np.ascontiguousarray(obj)
            return msgspec.msgpack.Ext(_ARRAY_EXT, self._meta(a.dtype.str, a.shape, a.reshape(-1).view(np.uint8)))
        raise TypeError(f"cannot serialize an object of type {type(obj).__name__}")

    def _meta(self, dtype: str, shape: tuple[int, ...], raw: np.ndarray) -> bytes:
        if raw.nbytes < INLINE_BYTES:
            return msgspec.msgpack.encode((dtype, list(shape), raw.tobytes()))
        self._frames.append(memoryview(raw))
        return msgspec.msgpack.encode((dtype, list(shape), len(self._frames) - 1))


class MsgpackDecoder:
    """decode(frames) -> obj of the given type; tensors are views over the received frames (no copy)."""

    def __init__(self, typ: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(typ, ext_hook=self._ext)
        self._frames: list[Any] = []

    def decode(self, frames: list[Any]) -> Any:
        if not frames:
            raise ValueError("empty message")
        self._frames = [f.buffer if hasattr(f, "buffer") else f for f in frames]
        try:
            return self._decoder.decode(self._frames[0])
        finally:
            self._frames = []

    def _ext(self, code: int, data: memoryview) -> Any:
        if code not in (_TENSOR_EXT, _ARRAY_EXT):
            raise ValueError(f"unknown extension type {code}")
        dtype, shape, ref = msgspec.msgpack.decode(data)
        if isinstance(ref, int):
            if not 0 < ref < len(self._frames):
                raise ValueError(f"message refers to missing frame {ref}")
            buf = self._frames[ref]
        elif isinstance(ref, (bytes, bytearray)):
            buf = ref
        else:
            raise ValueError("malformed tensor reference")
        return _tensor(dtype, shape, buf) if code == _TENSOR_EXT else _array(dtype, shape, buf)


def _tensor(dtype: str, shape: list[int], buf: Any) -> torch.Tensor:
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {dtype!r}")
    count = int(np.prod(shape)) if shape else 1
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype)
    with warnings.catch_warnings():     # received frames are read-only; we never write to them
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch_dtype, count=count)
    return flat.view(shape)


def _array(dtype: str, shape: list[int], buf: Any) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise ValueError("object arrays are refused")
    return np.frombuffer(buf, dtype=dt, count=int(np.prod(shape)) if shape else 1).reshape(shape)
