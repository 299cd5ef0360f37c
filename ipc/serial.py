"""msgpack encoding (msgspec) with tensors and arrays carried as separate raw frames. Never pickle.

encode(obj) -> [body, buf1, buf2, ...]: the body is msgpack; a torch tensor or numpy array anywhere in
obj becomes a msgpack Ext holding (dtype, shape, frame index), and its bytes travel as their own frame so
that neither side copies them. decode(frames) rebuilds tensors as views over the received frames.

Only an allowlist of plain numeric dtypes crosses; anything else the encoder does not know raises
TypeError, and the decoder trusts nothing in a message: every malformed input ends in ValueError or
msgspec.DecodeError.
"""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Union

import msgspec
import numpy as np
import torch

Frame = Union[bytes, bytearray, memoryview]

TENSOR_EXT = 1
ARRAY_EXT = 2
INLINE_BYTES = 256      # below this a separate frame costs more than copying the bytes into the body
_MAX_NDIM = 32
_MAX_DIM = 1 << 40

# One wire name per dtype, shared by both kinds; numpy has no bfloat16, so only tensors may use it.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64,
}
_TORCH_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _TORCH_DTYPES.items()}
_NUMPY_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name) for name in ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16",
                                      "int32", "int64", "float16", "float32", "float64")
}


class _BufferMeta(msgspec.Struct, array_like=True):
    """What an Ext carries: the buffer itself (when tiny) or the index of the frame holding it."""
    dtype: str
    shape: list[int]
    data: Union[int, bytes]


class MsgpackEncoder:
    """One encoder per thread: the frame list of the message being encoded lives on the instance."""

    def __init__(self, inline_bytes: int = INLINE_BYTES) -> None:
        self._inline_bytes = inline_bytes
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._meta_encoder = msgspec.msgpack.Encoder()
        self._frames: list[Frame] = []

    def encode(self, obj: Any) -> list[Frame]:
        frames: list[Frame] = [b""]
        self._frames = frames
        try:
            frames[0] = self._encoder.encode(obj)
        finally:
            self._frames = []
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            name, raw = _tensor_bytes(obj)
            return msgspec.msgpack.Ext(TENSOR_EXT, self._meta(name, tuple(obj.shape), raw))
        if isinstance(obj, np.ndarray):
            name, raw = _array_bytes(obj)
            return msgspec.msgpack.Ext(ARRAY_EXT, self._meta(name, obj.shape, raw))
        raise TypeError(f"cannot serialize an object of type {type(obj).__module__}.{type(obj).__qualname__}")

    def _meta(self, dtype: str, shape: tuple[int, ...], raw: np.ndarray) -> bytes:
        if raw.nbytes < self._inline_bytes:
            return self._meta_encoder.encode(_BufferMeta(dtype, list(shape), raw.tobytes()))
        # The memoryview keeps raw (and through it the tensor's storage) alive until the frame is sent.
        self._frames.append(memoryview(raw))
        return self._meta_encoder.encode(_BufferMeta(dtype, list(shape), len(self._frames) - 1))


def _tensor_bytes(t: torch.Tensor) -> tuple[str, np.ndarray]:
    name = _TORCH_NAMES.get(t.dtype)
    if name is None or t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise TypeError(f"cannot serialize a tensor of dtype {t.dtype} with layout {t.layout} "
                        f"on {t.device.type}")
    t = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    # A byte view sidesteps numpy's missing bfloat16; the bytes are identical either way.
    raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
    return name, raw


def _array_bytes(a: np.ndarray) -> tuple[str, np.ndarray]:
    name = a.dtype.name
    if _NUMPY_DTYPES.get(name) is None:
        raise TypeError(f"cannot serialize a numpy array of dtype {a.dtype}")
    a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))
    return name, a.reshape(-1).view(np.uint8)


class MsgpackDecoder:
    """decode(frames) -> an object of the given type; big tensors are views over the frames (no copy).

    The frames must stay unmodified while the decoded tensors are in use; they are read-only views.
    """

    def __init__(self, typ: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(typ, ext_hook=self._ext_hook)
        self._meta_decoder = msgspec.msgpack.Decoder(_BufferMeta)
        self._frames: list[memoryview] = []

    def decode(self, frames: Union[Sequence[Any], Frame]) -> Any:
        if isinstance(frames, (bytes, bytearray, memoryview)):
            frames = [frames]
        if len(frames) == 0:
            raise ValueError("cannot decode an empty message: it has no frames")
        self._frames = [_as_bytes_view(f) for f in frames]
        try:
            return self._decoder.decode(self._frames[0])
        finally:
            self._frames = []

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (TENSOR_EXT, ARRAY_EXT):
            raise ValueError(f"unknown msgpack extension type {code}")
        meta = self._meta_decoder.decode(data)
        shape = _checked_shape(meta.shape)
        buf = self._buffer(meta.data)
        if code == TENSOR_EXT:
            return _tensor_from(meta.dtype, shape, buf)
        return _array_from(meta.dtype, shape, buf)

    def _buffer(self, ref: Union[int, bytes]) -> Union[memoryview, bytes]:
        if isinstance(ref, bytes):
            return ref
        if not 0 < ref < len(self._frames):
            raise ValueError(f"message refers to frame {ref} but has only {len(self._frames)} frames")
        return self._frames[ref]


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


def _checked_shape(shape: list[int]) -> tuple[int, ...]:
    if len(shape) > _MAX_NDIM or any(not 0 <= d < _MAX_DIM for d in shape):
        raise ValueError(f"malformed tensor shape {shape}")
    return tuple(shape)


def _lookup(table: dict, kind: str, dtype: str, shape: tuple[int, ...], buf: Union[memoryview, bytes]):
    """(dtype object, element count) after checking the dtype is known and the buffer has the right size."""
    dt = table.get(dtype)
    if dt is None:
        raise ValueError(f"unsupported {kind} dtype {dtype!r}")
    count = math.prod(shape)
    if count * dt.itemsize != len(buf):
        raise ValueError(f"{dtype}{list(shape)} needs {count * dt.itemsize} bytes, the message carries {len(buf)}")
    return dt, count


def _tensor_from(dtype: str, shape: tuple[int, ...], buf: Union[memoryview, bytes]) -> torch.Tensor:
    torch_dtype, count = _lookup(_TORCH_DTYPES, "tensor", dtype, shape, buf)
    if count == 0:
        return torch.empty(shape, dtype=torch_dtype)
    with warnings.catch_warnings():
        # Received frames are read-only; torch warns because it cannot mark a tensor read-only.
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(buf, dtype=torch_dtype, count=count).view(shape)


def _array_from(dtype: str, shape: tuple[int, ...], buf: Union[memoryview, bytes]) -> np.ndarray:
    np_dtype, count = _lookup(_NUMPY_DTYPES, "array", dtype, shape, buf)
    if count == 0:
        return np.empty(shape, dtype=np_dtype)
    return np.frombuffer(buf, dtype=np_dtype, count=count).reshape(shape)
