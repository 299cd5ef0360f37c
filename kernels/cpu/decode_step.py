"""A Llama-family decode step in one C call (kernels/cpu/csrc/decode_step.c), for CPU steps of a few sequences.

The model describes its weights once (`DecoderWeights`); `CpuDecodeStep.build` checks every tensor the C
code will read raw and returns None where anything is outside what it takes, so the caller keeps its
PyTorch path. Weight-only int4/int5/int6/int8 linears only: those are where the PyTorch path's casts and per-op costs
outweighed the GEMVs (docs/cpu_performance.md).

LoRA: a layer's linears may carry their adapter slots (`LoraPool`, the pool executor/model/layers/lora.py
fills in place): the step binds their pointers once, and a call's `lora_slots` names each row's slot.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu import int4_pack
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.weights.weight_intn import IntNWeight
from pagedserve.kernels.weights.weight_only import Int4Weight, Int8Weight
from pagedserve.kernels.weights.weight_split import RowSplitWeight, WeightOnly

_MAX_HEAD_DIM, _MAX_BLOCK, _MAX_GROUP = 256, 128, 16      # decode_attention.h
_LINEAR_INT4, _LINEAR_INT8, _LINEAR_INTN, _LINEAR_SPLIT = 1, 2, 3, 4


class _Linear(ctypes.Structure):
    pass


_Linear._fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                    ("group", ctypes.c_int64), ("chunks", ctypes.c_int64), ("w", ctypes.c_void_p),
                    ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("sz_form", ctypes.c_int64),
                    ("bits", ctypes.c_int64), ("layout", ctypes.c_int64), ("parts", ctypes.POINTER(_Linear)),
                    ("num_parts", ctypes.c_int64)]


class _Lora(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("b_t", ctypes.c_void_p), ("widths", ctypes.c_void_p),
                ("bounds", ctypes.c_void_p), ("pieces", ctypes.c_int64), ("wmax", ctypes.c_int64),
                ("bf16", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("qkv_lora", _Lora), ("o_lora", _Lora), ("gate_up_lora", _Lora), ("down_lora", _Lora)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("num_heads", ctypes.c_int64),
                ("num_kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("cache_bf16", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("final_norm", ctypes.c_void_p), ("layers", ctypes.POINTER(_Layer)),
                ("lora_width", ctypes.c_int64)]


@dataclass(frozen=True)
class LoraPool:
    """A linear's adapter slots, filled in place between steps (never reallocated: the step keeps pointers).
    Per slot: A [wmax, in] and B transposed [wmax, out], float32 or bfloat16 (both the same), the adapter's
    scaling folded into B; piece p of a merged linear is rows p*r..(p+1)*r, in output columns
    bounds[p]..bounds[p + 1]; widths[s] = pieces * r of slot s's adapter (0: empty)."""
    a: torch.Tensor          # [slots, wmax, in]
    b_t: torch.Tensor        # [slots, wmax, out]
    widths: torch.Tensor     # int64 [slots]
    bounds: torch.Tensor     # int64 [pieces + 1]


@dataclass(frozen=True)
class LayerWeights:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: WeightOnly
    o: WeightOnly
    gate_up: WeightOnly                  # [gate | up] rows
    down: WeightOnly
    kv_cache: torch.Tensor               # [2, num_blocks, num_kv_heads, block_size, head_dim]
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    biases: tuple[torch.Tensor | None, ...] = (None, None, None, None)    # qkv, o, gate_up, down
    loras: tuple[LoraPool | None, ...] = (None, None, None, None)         # the same order


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


def _linear(w: WeightOnly, n: int, k: int, bias: torch.Tensor | None, keep: list) -> _Linear | None:
    """The C description of a linear (keep holds the parts' array of a split one for the step's life)."""
    if not _float_vector(bias, n):
        return None
    if isinstance(w, RowSplitWeight):
        if w.out_features != n:
            return None
        bounds = [sum(w.widths[:i]) for i in range(len(w.widths) + 1)]
        parts = [_linear(part, width, k, None if bias is None else bias[a:b], keep)
                 for part, width, a, b in zip(w.parts, w.widths, bounds, bounds[1:])]
        if any(part is None or part.kind == _LINEAR_SPLIT for part in parts):
            return None
        array = (_Linear * len(parts))(*parts)
        keep.append(array)
        return _Linear(_LINEAR_SPLIT, n, k, 0, 0, None, None, None, 0, 0, 0,
                       ctypes.cast(array, ctypes.POINTER(_Linear)), len(parts))
    ptr = 0 if bias is None else bias.data_ptr()
    if isinstance(w, Int4Weight):
        if (w.out_features, w.in_features) != (n, k) or n % 64 or w.packed.device.type != "cpu" \
                or not (w.packed.is_contiguous() and w.scales_and_zeros.is_contiguous()):
            return None
        # the pack is the form this process's torch writes (weight_only.py packs with it)
        return _Linear(_LINEAR_INT4, n, k, w.group_size, 1, w.packed.data_ptr(), w.scales_and_zeros.data_ptr(), ptr,
                       w.sz_form, 4, int4_pack.pack_layout())
    if isinstance(w, IntNWeight):
        if (w.out_features, w.in_features) != (n, k) or w.packed.device.type != "cpu" \
                or not (w.packed.is_contiguous() and w.scales_and_zeros.is_contiguous()):
            return None
        return _Linear(_LINEAR_INTN, n, k, w.group_size, 1, w.packed.data_ptr(), w.scales_and_zeros.data_ptr(), ptr,
                       w.scales_and_zeros.shape[-1], w.bits)
    if isinstance(w, Int8Weight):
        chunks, rows, chunk = w.q.shape
        if (rows, chunks * chunk) != (n, k) or w.q.device.type != "cpu" \
                or not (w.q.is_contiguous() and w.scale.is_contiguous()):
            return None
        return _Linear(_LINEAR_INT8, n, k, chunk, chunks, w.q.data_ptr(), w.scale.data_ptr(), ptr, 0, 8)
    return None


def _lora(pool: LoraPool | None, n: int, k: int) -> _Lora | None:
    """The C view of a linear's slots; an empty one (a NULL) for none; None where the pool is not as lora.h
    reads it."""
    if pool is None:
        return _Lora()
    a, b_t, widths, bounds = pool.a, pool.b_t, pool.widths, pool.bounds
    if (a.dim() != 3 or a.shape[2] != k or b_t.shape != (a.shape[0], a.shape[1], n)
            or a.dtype not in (torch.float32, torch.bfloat16) or b_t.dtype != a.dtype
            or any(t.device.type != "cpu" or not t.is_contiguous() for t in (a, b_t))
            or any(t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous() for t in (widths, bounds))
            or widths.shape != (a.shape[0],) or bounds.dim() != 1 or bounds.numel() < 2
            or a.shape[1] % (bounds.numel() - 1) or int(bounds[0]) != 0 or int(bounds[-1]) != n):
        return None
    return _Lora(a.data_ptr(), b_t.data_ptr(), widths.data_ptr(), bounds.data_ptr(), bounds.numel() - 1, a.shape[1],
                 int(a.dtype == torch.bfloat16))


class CpuDecodeStep:
    """Holds the C description of a model (and the tensors it points into) for `__call__`."""

    def __init__(self, lib: ctypes.CDLL, model: _Model, layers: ctypes.Array, keep: tuple[DecoderWeights, list],
                 lora_slots: int) -> None:
        self._lib, self._model, self._layers, self._keep = lib, model, layers, keep     # what the C side points into
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}   # by (rows, threads)
        # Tokens one call takes: 32 where the int4 GEMM is built, else the GEMV's 8 (decode_step.c says why).
        self.max_rows = int(lib.ps_decode_step_max_rows())
        self.lora_slots = lora_slots        # adapter slots every linear holds (0: the step takes no LoRA rows)

    @staticmethod
    def runs_here() -> bool:
        """Whether this process builds the step at all: where the C kernels it calls have their vector paths
        for the int4 pack form torch writes here (decode_step.c's ps_decode_step_layouts: AVX-512 over the
        AVX-512 form, AVX2 + FMA over the AVX2 one). Elsewhere its portable loops are slower than the PyTorch
        layers."""
        lib = cpu_native.library()
        return lib is not None and bool(lib.ps_decode_step_layouts() >> int4_pack.pack_layout() & 1)

    @classmethod
    def build(cls, w: DecoderWeights) -> CpuDecodeStep | None:
        if not w.layers or not cls.runs_here():
            return None
        lib = cpu_native.library()
        hidden, d = w.final_norm.numel(), w.head_dim
        hq, hkv = w.num_heads, w.num_kv_heads
        cache = w.layers[0].kv_cache
        if (hkv <= 0 or hq % hkv or hq // hkv > _MAX_GROUP or d > _MAX_HEAD_DIM or d % 2
                or cache.dim() != 5 or cache.shape[3] > _MAX_BLOCK):
            return None
        down = w.layers[0].down
        if isinstance(down, RowSplitWeight):      # one checkpoint tensor: never split (packing.py)
            return None
        inter = down.q.shape[0] * down.q.shape[2] if isinstance(down, Int8Weight) else down.in_features
        layers = (_Layer * len(w.layers))()
        arrays: list = []
        pools = [p for lw in w.layers for p in lw.loras]
        if any(p is None for p in pools) and any(p is not None for p in pools):
            return None           # some linears without slots: a LoRA row would miss their deltas
        for i, lw in enumerate(w.layers):
            c = lw.kv_cache
            if (c.shape != cache.shape or c.dtype != cache.dtype or c.dtype not in (torch.float32, torch.bfloat16)
                    or not c.is_contiguous() or c.device.type != "cpu"
                    or not all(_float_vector(t, hidden) for t in (lw.in_norm, lw.post_norm))
                    or not all(_float_vector(t, d) for t in (lw.q_norm, lw.k_norm))):
                return None
            linears = [_linear(lw.qkv, (hq + 2 * hkv) * d, hidden, lw.biases[0], arrays),
                       _linear(lw.o, hq * d, hq * d, lw.biases[1], arrays) if hq * d == hidden else None,
                       _linear(lw.gate_up, 2 * inter, hidden, lw.biases[2], arrays),
                       _linear(lw.down, hidden, inter, lw.biases[3], arrays)]
            loras = [_lora(pool, lin.n, lin.k) if lin is not None else None for pool, lin in zip(lw.loras, linears)]
            if any(lin is None for lin in linears + loras):
                return None
            ptr = (lambda t: 0 if t is None else t.data_ptr())
            layers[i] = _Layer(lw.in_norm.data_ptr(), lw.post_norm.data_ptr(), ptr(lw.q_norm), ptr(lw.k_norm),
                               c[0].data_ptr(), c[1].data_ptr(), *linears, *loras)
        if not _float_vector(w.final_norm, hidden) or len({p.a.shape[0] for p in pools if p is not None}) > 1:
            return None
        lora_width = max((p.a.shape[1] for p in pools if p is not None), default=0)
        model = _Model(len(w.layers), hidden, hq, hkv, d, inter, cache.shape[3], int(cache.dtype == torch.bfloat16),
                       w.eps, w.scale, w.final_norm.data_ptr(), layers, lora_width)
        return cls(lib, model, layers, (w, arrays), pools[0].a.shape[0] if pools and pools[0] is not None else 0)

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H] float32 embeddings -> final-normed hidden states [T, H] (computed in place);
        cos/sin [T, head_dim] float32, slots [T] int64 (all valid), tables [T, *] / lens [T] int32;
        lora_slots [T] int32, each row's adapter slot (-1: the base model), or None for a step without LoRA."""
        rows = hidden.shape[0]
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"CpuDecodeStep: 1..{self.max_rows} rows per step, got {rows}")
        for t, dtype, name in ((hidden, torch.float32, "hidden"), (cos, torch.float32, "cos"),
                               (sin, torch.float32, "sin"), (slots, torch.int64, "slots"),
                               (tables, torch.int32, "tables"), (lens, torch.int32, "lens")):
            if t.dtype != dtype or t.device.type != "cpu" or t.shape[0] != rows:
                raise ValueError(f"CpuDecodeStep: {name} must be a CPU {dtype} tensor with {rows} rows, got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if lora_slots is not None:
            self._check_lora_slots(lora_slots, rows)
            lora_slots = lora_slots.contiguous()
        hidden = hidden.contiguous()
        cos, sin, slots, lens = (t.contiguous() for t in (cos, sin, slots, lens))
        if tables.stride(-1) != 1:
            tables = tables.contiguous()
        threads = torch.get_num_threads()
        scratch = self._scratch.get((rows, threads))
        if scratch is None:
            scratch = self._scratch[rows, threads] = torch.empty(
                self._lib.ps_decode_step_scratch(ctypes.byref(self._model), rows, threads))
        cpu_native.check(self._lib.ps_decode_step(ctypes.byref(self._model), hidden.data_ptr(), rows, cos.data_ptr(),
                                                  sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                                                  tables.stride(0), lens.data_ptr(),
                                                  None if lora_slots is None else lora_slots.data_ptr(),
                                                  scratch.data_ptr(), threads), "decode step")
        return hidden

    def _check_lora_slots(self, lora_slots: torch.Tensor, rows: int) -> None:
        if lora_slots.dtype != torch.int32 or lora_slots.device.type != "cpu" or lora_slots.shape != (rows,):
            raise ValueError(f"CpuDecodeStep: lora_slots must be a CPU int32 tensor of {rows} rows, got "
                             f"{lora_slots.dtype} {tuple(lora_slots.shape)} on {lora_slots.device}")
        low, high = int(lora_slots.min()), int(lora_slots.max())
        if low < -1 or high >= self.lora_slots:
            raise ValueError(f"CpuDecodeStep: lora_slots must lie in -1..{self.lora_slots - 1} (the adapter slots "
                             f"this step was built with), got {low}..{high}")
