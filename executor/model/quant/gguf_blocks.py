"""GGUF quantized blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) decoded to the group-affine GroupQuantWeight.

Every supported format is, per group of g weights, an f16-derived scale times an unsigned code plus an offset,
so decoding only unpacks bits: no weight is rounded. The fp32 scale/offset are products of an f16 block scale
and a small integer (at most 18 significant bits), so they are exact, and scale * q + offset then reproduces
gguf.quants.dequantize bit for bit. Signed formats get their codes shifted to unsigned (Q4_0 q-8 -> offset -8d,
Q5_0 q-16 -> offset -16d, Q8_0 int8 -> q+128 with offset -128d, Q6_K q-32 -> offset -32 d sc) because the kernels take unsigned codes.

Everything is whole-array numpy: no Python loop over blocks, the 28M-weight Q8_0 embedding decodes in well
under a second.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .group_quant import GroupQuantWeight

# name -> (GGML type id, weights per block, bytes per block); ids and sizes are ggml's (gguf.constants).
_FORMATS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
_NAME_BY_ID = {type_id: name for name, (type_id, _, _) in _FORMATS.items()}

# The GGUF tensor types decode_gguf_tensor keeps quantized (compare with GGMLQuantizationType(...).name).
GGUF_QUANT_TYPES: tuple[str, ...] = tuple(_FORMATS)

@dataclass(frozen=True)
class GGUFBlocks:
    """One quantized GGUF tensor as the file stores it, for a weight update of a GGUF model: its ggml type
    ("Q4_0"), its shape outermost first (rows, cols: torch's order; the file lists it innermost first) and
    its raw block bytes (uint8), which the loader decodes as it decodes the file's."""
    tensor_type: str
    shape: tuple[int, int]
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def gguf_nbytes(tensor_type: str, shape: tuple[int, ...]) -> int:
    """Bytes of a quantized GGUF tensor of `shape` (outermost first); ValueError for an unknown type or a row
    that is not whole blocks."""
    if tensor_type not in _FORMATS:
        raise ValueError(f"GGUF tensor type {tensor_type!r} is not one of {', '.join(GGUF_QUANT_TYPES)}")
    _, block_weights, block_bytes = _FORMATS[tensor_type]
    if len(shape) != 2 or shape[1] % block_weights:
        raise ValueError(f"GGUF {tensor_type} tensor shape {tuple(shape)}: need 2 dimensions, the inner one a "
                         f"multiple of the {block_weights}-weight block")
    return int(shape[0]) * int(shape[1]) // block_weights * block_bytes


# A decoder maps blocks [n, bytes per block] to codes [n, weights per block], scale and offset [n, groups].
_Decoded = tuple[np.ndarray, np.ndarray, np.ndarray, int, int]     # q, scale, offset, bits, group size


def gguf_type_name(qtype: Any) -> str:
    """The ggml name of a tensor type given as GGMLQuantizationType, its integer id, or its name."""
    if isinstance(qtype, str):
        return qtype
    name = getattr(qtype, "name", None)
    if isinstance(name, str):
        return name
    return _NAME_BY_ID.get(int(qtype), f"GGML type id {int(qtype)}")


def decode_gguf_tensor(data: np.ndarray, qtype: Any, shape: tuple[int, int]) -> GroupQuantWeight:
    """Raw GGUF block bytes of a 2-D tensor [rows, cols] (outermost first) as a GroupQuantWeight, exactly."""
    name = gguf_type_name(qtype)
    if name not in _FORMATS:
        raise ValueError(f"GGUF tensor type {name} cannot be kept quantized; supported: "
                         f"{', '.join(GGUF_QUANT_TYPES)}")
    _, block_weights, block_bytes = _FORMATS[name]
    rows, cols = (int(d) for d in shape) if len(shape) == 2 else (0, 0)
    if rows <= 0 or cols <= 0 or cols % block_weights:
        raise ValueError(f"GGUF {name} tensor shape {tuple(shape)}: need 2 positive dimensions, the inner "
                         f"one a multiple of the {block_weights}-weight block")
    n_blocks = rows * cols // block_weights
    raw = np.asarray(data).view(np.uint8)
    if raw.size != n_blocks * block_bytes:
        raise ValueError(f"GGUF {name} tensor of shape {tuple(shape)} needs {n_blocks * block_bytes} bytes, "
                         f"got {raw.size}")
    q, scale, offset, bits, group = _DECODERS[name](raw.reshape(n_blocks, block_bytes))
    return GroupQuantWeight(torch.from_numpy(q.reshape(rows, cols)),
                            torch.from_numpy(scale.reshape(rows, cols // group)),
                            torch.from_numpy(offset.reshape(rows, cols // group)), bits, group,
                            k_quant=name in ("Q4_K", "Q5_K"))


def reverse_permute_rows(w: GroupQuantWeight, n_head: int) -> GroupQuantWeight:
    """Undo llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves).

    The permutation moves whole rows, so codes, scales and offsets move together and stay exact.
    """
    rows = w.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"n_head {n_head}: the {rows} rows must split into n_head heads of two rotary halves")
    # Same index arithmetic as model_loader.reverse_permute, applied to row numbers.
    order = torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(rows)
    return GroupQuantWeight(w.q[order], w.scale[order], w.offset[order], w.bits, w.group_size,
                            k_quant=w.k_quant)


# ---------------------------------------------------------------- bit unpacking


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian f16 at byte `start` of every block, as fp32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray, width: int) -> np.ndarray:
    """ggml's 4-bit layout: each run of `width` bytes holds `width` weights in low nibbles, then `width` high."""
    runs = packed.reshape(packed.shape[0], -1, 1, width)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(packed.shape[0], -1)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 8 six-bit scales and 8 six-bit mins, packed in 12 bytes (ggml's get_scale_min_k4)."""
    packed = packed.reshape(-1, 3, 4)
    lo_sc, lo_m, hi = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = np.concatenate([lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 2) & 0x30)], axis=1)
    mins = np.concatenate([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


# ---------------------------------------------------------------- the formats


def _q4_0(blocks: np.ndarray) -> _Decoded:             # d f16 | 16 bytes of nibbles: w = d * (q - 8)
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 2:], 16), d, d * -8.0, 4, 32


def _q4_1(blocks: np.ndarray) -> _Decoded:             # d f16 | m f16 | 16 bytes of nibbles: w = d * q + m
    return _nibbles(blocks[:, 4:], 16), _f16(blocks, 0), _f16(blocks, 2), 4, 32


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits, a little-endian u32 per block whose bit j belongs to weight j, as 0/16."""
    return ((qh[:, :, None] >> np.arange(8, dtype=np.uint8)) & 1).reshape(qh.shape[0], 32) << 4


def _q5_0(blocks: np.ndarray) -> _Decoded:             # d f16 | qh u32 | 16 bytes of nibbles: w = d * (q - 16)
    d = _f16(blocks, 0)
    return _nibbles(blocks[:, 6:], 16) | _fifth_bits(blocks[:, 2:6]), d, d * -16.0, 5, 32


def _q5_1(blocks: np.ndarray) -> _Decoded:             # d f16 | m f16 | qh u32 | 16 bytes of nibbles: w = d * q + m
    return _nibbles(blocks[:, 8:], 16) | _fifth_bits(blocks[:, 4:8]), _f16(blocks, 0), _f16(blocks, 2), 5, 32


def _q8_0(blocks: np.ndarray) -> _Decoded:             # d f16 | 32 int8: w = d * x = d * (x + 128) - 128 d
    d = _f16(blocks, 0)
    return blocks[:, 2:] ^ np.uint8(0x80), d, d * -128.0, 8, 32


def _q4_k(blocks: np.ndarray) -> _Decoded:             # d | dmin | 12 bytes scales/mins | 128 bytes nibbles
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    return _nibbles(blocks[:, 16:], 32), _f16(blocks, 0) * scales, -(_f16(blocks, 2) * mins), 4, 32


def _q5_k(blocks: np.ndarray) -> _Decoded:             # as Q4_K, plus 32 bytes of fifth bits before the nibbles
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    # Bit j of qh byte i is the fifth bit of weight i of the j-th 32-weight group.
    high = (blocks[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1
    high = high.transpose(0, 2, 1).reshape(blocks.shape[0], 256)
    q = _nibbles(blocks[:, 48:], 32) | (high << 4)
    return q, _f16(blocks, 0) * scales, -(_f16(blocks, 2) * mins), 5, 32


def _q6_k(blocks: np.ndarray) -> _Decoded:             # 128 bytes low nibbles | 64 bytes 2-bit highs | 16 int8 sc | d
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 64)
    # Each 32-byte half of qh holds four 2-bit fields per byte, one for each 32-weight quarter of its 128.
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    q = low | (high.reshape(n, 256) << 4)
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
    return q, scale, scale * -32.0, 6, 16


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
