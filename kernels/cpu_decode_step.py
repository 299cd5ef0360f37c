"""A Llama-family decode step in one C call (kernels/csrc/decode_step.c), for CPU steps of a few sequences.

The model describes its weights once (`DecoderWeights`); `CpuDecodeStep.build` checks every tensor the C
code will read raw and returns None where anything is outside what it takes, so the caller keeps its
PyTorch path. Weight-only int4/int8 linears only: those are where the PyTorch path's casts and per-op costs
outweighed the GEMVs (docs/cpu_performance.md).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedserve.kernels import cpu_native
from pagedserve.kernels.weight_only import Int4Weight, Int8Weight

_MAX_HEAD_DIM, _MAX_BLOCK, _MAX_GROUP = 256, 128, 16      # decode_attention.h
_LINEAR_INT4, _LINEAR_INT8 = 1, 2


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("group", ctypes.c_int64),
                ("chunks", ctypes.c_int64), ("w", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("sz_stride", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("num_heads", ctypes.c_int64),
                ("num_kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("cache_bf16", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("final_norm", ctypes.c_void_p), ("layers", ctypes.POINTER(_Layer))]


Weight = Int4Weight | Int8Weight


@dataclass(frozen=True)
class LayerWeights:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Weight
    o: Weight
    gate_up: Weight                      # [gate | up] rows
    down: Weight
    kv_cache: torch.Tensor               # [2, num_blocks, num_kv_heads, block_size, head_dim]
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    biases: tuple[torch.Tensor | None, ...] = (None, None, None, None)    # qkv, o, gate_up, down


@dataclass(frozen=True)
class DecoderWeights:
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float


def _float_vector(t: torch.Tensor | None, size: int) -> bool:
    return t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
                         and t.numel() == size)


def _linear(w: Weight, n: int, k: int, bias: torch.Tensor | None) -> _Linear | None:
    if not _float_vector(bias, n):
        return None
    ptr = 0 if bias is None else bias.data_ptr()
    if isinstance(w, Int4Weight):
        if (w.out_features, w.in_features) != (n, k) or n % 64 or w.packed.device.type != "cpu" \
                or not (w.packed.is_contiguous() and w.scales_and_zeros.is_contiguous()):
            return None
        return _Linear(_LINEAR_INT4, n, k, w.group_size, 1, w.packed.data_ptr(), w.scales_and_zeros.data_ptr(), ptr,
                       w.scales_and_zeros.shape[-1])
    if isinstance(w, Int8Weight):
        chunks, rows, chunk = w.q.shape
        if (rows, chunks * chunk) != (n, k) or w.q.device.type != "cpu" \
                or not (w.q.is_contiguous() and w.scale.is_contiguous()):
            return None
        return _Linear(_LINEAR_INT8, n, k, chunk, chunks, w.q.data_ptr(), w.scale.data_ptr(), ptr, 0)
    return None


class CpuDecodeStep:
    """Holds the C description of a model (and the tensors it points into) for `__call__`."""

    def __init__(self, lib: ctypes.CDLL, model: _Model, layers: ctypes.Array, keep: DecoderWeights) -> None:
        self._lib, self._model, self._layers, self._keep = lib, model, layers, keep
        self._scratch: dict[int, torch.Tensor] = {}
        # Tokens one call takes: 32 where the int4 GEMM is built, else the GEMV's 8 (decode_step.c says why).
        self.max_rows = int(lib.ps_decode_step_max_rows())

    @classmethod
    def build(cls, w: DecoderWeights) -> CpuDecodeStep | None:
        lib = cpu_native.library()
        if lib is None or not lib.ps_gemv_vectorized() or not w.layers:
            return None
        hidden, d = w.final_norm.numel(), w.head_dim
        hq, hkv = w.num_heads, w.num_kv_heads
        cache = w.layers[0].kv_cache
        if (hkv <= 0 or hq % hkv or hq // hkv > _MAX_GROUP or d > _MAX_HEAD_DIM or d % 2
                or cache.dim() != 5 or cache.shape[3] > _MAX_BLOCK):
            return None
        inter = w.layers[0].down.in_features if isinstance(w.layers[0].down, Int4Weight) \
            else w.layers[0].down.q.shape[0] * w.layers[0].down.q.shape[2]
        layers = (_Layer * len(w.layers))()
        for i, lw in enumerate(w.layers):
            c = lw.kv_cache
            if (c.shape != cache.shape or c.dtype != cache.dtype or c.dtype not in (torch.float32, torch.bfloat16)
                    or not c.is_contiguous() or c.device.type != "cpu"
                    or not all(_float_vector(t, hidden) for t in (lw.in_norm, lw.post_norm))
                    or not all(_float_vector(t, d) for t in (lw.q_norm, lw.k_norm))):
                return None
            linears = [_linear(lw.qkv, (hq + 2 * hkv) * d, hidden, lw.biases[0]),
                       _linear(lw.o, hq * d, hq * d, lw.biases[1]) if hq * d == hidden else None,
                       _linear(lw.gate_up, 2 * inter, hidden, lw.biases[2]),
                       _linear(lw.down, hidden, inter, lw.biases[3])]
            if any(lin is None for lin in linears):
                return None
            ptr = (lambda t: 0 if t is None else t.data_ptr())
            layers[i] = _Layer(lw.in_norm.data_ptr(), lw.post_norm.data_ptr(), ptr(lw.q_norm), ptr(lw.k_norm),
                               c[0].data_ptr(), c[1].data_ptr(), *linears)
        if not _float_vector(w.final_norm, hidden):
            return None
        model = _Model(len(w.layers), hidden, hq, hkv, d, inter, cache.shape[3], int(cache.dtype == torch.bfloat16),
                       w.eps, w.scale, w.final_norm.data_ptr(), layers)
        return cls(lib, model, layers, w)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] float32 embeddings -> final-normed hidden states [T, H] (computed in place);
        cos/sin [T, head_dim] float32, slots [T] int64 (all valid), tables [T, *] / lens [T] int32."""
        rows = hidden.shape[0]
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"CpuDecodeStep: 1..{self.max_rows} rows per step, got {rows}")
        for t, dtype, name in ((hidden, torch.float32, "hidden"), (cos, torch.float32, "cos"),
                               (sin, torch.float32, "sin"), (slots, torch.int64, "slots"),
                               (tables, torch.int32, "tables"), (lens, torch.int32, "lens")):
            if t.dtype != dtype or t.device.type != "cpu" or t.shape[0] != rows:
                raise ValueError(f"CpuDecodeStep: {name} must be a CPU {dtype} tensor with {rows} rows, got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
        hidden = hidden.contiguous()
        cos, sin, slots, lens = (t.contiguous() for t in (cos, sin, slots, lens))
        if tables.stride(-1) != 1:
            tables = tables.contiguous()
        scratch = self._scratch.get(rows)
        if scratch is None:
            scratch = self._scratch[rows] = torch.empty(self._lib.ps_decode_step_scratch(ctypes.byref(self._model),
                                                                                          rows))
        cpu_native.check(self._lib.ps_decode_step(ctypes.byref(self._model), hidden.data_ptr(), rows, cos.data_ptr(),
                                                  sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                                                  tables.stride(0), lens.data_ptr(), scratch.data_ptr(),
                                                  torch.get_num_threads()), "decode step")
        return hidden
