"""Widening packed int4 / int8 weights to bfloat16 on CPU, through the small C file next to this one.

The C file is compiled at first use with the system C compiler (`cc -O3 -march=native`, about a second) into
the pagedserve cache folder, keyed by its source, the flags and the CPU's feature flags, and loaded with
ctypes: no torch headers, so no minute-long extension build. Without a compiler `library()` is None and the
callers keep torch's weight-only kernels for every shape.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch

from pagedserve.common.model_files import cache_root

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_dequant.c")
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build(compiler: str, target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, _SOURCE, "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)      # atomic: processes that build at the same time never load a half file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernels, built once per source and machine; None where no C compiler works."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        logger.info("cpu dequant kernels: no C compiler; weight-only kernels serve every batch size")
        return None
    with open(_SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join((compiler, *_FLAGS, _cpu_flags())).encode()).hexdigest()[:16]
    target = os.path.join(cache_root(), "kernels", f"cpu_dequant-{key}.so")
    try:
        if not os.path.exists(target):
            _build(compiler, target)
        lib = ctypes.CDLL(target)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("cpu dequant kernels unavailable (%s %s); weight-only kernels serve every batch size",
                       e, detail.decode(errors="replace")[-500:])
        return None
    lib.ps_dequant_int4_t.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int]
    lib.ps_dequant_int8_rows.argtypes = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_int]
    return lib


def _check(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what}: the C kernel failed with code {code}")


def _expect(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    # The C side reads raw memory: a strided view or another dtype would be read as garbage.
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype} "
                         f"{'contiguous' if t.is_contiguous() else 'strided'} on {t.device}")


def int4_to_bf16_t(packed: torch.Tensor, scales_and_zeros: torch.Tensor, out_features: int, in_features: int,
                   group_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight of torch's CPU int4 pack, widened and transposed: bfloat16 [in_features, out_features]."""
    lib = library()
    if lib is None:
        raise RuntimeError("cpu dequant kernels are unavailable (no C compiler)")
    _expect(packed, torch.uint8, "packed")
    _expect(scales_and_zeros, torch.bfloat16, "scales_and_zeros")
    if out is None:
        out = torch.empty(in_features, out_features, dtype=torch.bfloat16)
    _expect(out, torch.bfloat16, "out")
    if packed.numel() != out_features * in_features // 2 or out.numel() != out_features * in_features:
        raise ValueError(f"int4 widening: sizes do not match a [{out_features}, {in_features}] weight")
    _check(lib.ps_dequant_int4_t(packed.data_ptr(), scales_and_zeros.data_ptr(), out.data_ptr(), out_features,
                                 in_features, group_size, torch.get_num_threads()), "int4 widening")
    return out


def int8_rows_to_bf16(q: torch.Tensor, scale: torch.Tensor, first: int, last: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows first..last-1 of an int8 weight (q [chunks, rows, chunk], scale [chunks, rows]), widened:
    bfloat16 [last - first, chunks * chunk]."""
    lib = library()
    if lib is None:
        raise RuntimeError("cpu dequant kernels are unavailable (no C compiler)")
    _expect(q, torch.int8, "q")
    _expect(scale, torch.bfloat16, "scale")
    chunks, rows, chunk = q.shape
    if not 0 <= first <= last <= rows:
        raise ValueError(f"int8 widening: row range {first}..{last} is not within 0..{rows}")
    if out is None:
        out = torch.empty(last - first, chunks * chunk, dtype=torch.bfloat16)
    _expect(out, torch.bfloat16, "out")
    if scale.shape != (chunks, rows) or out.shape != (last - first, chunks * chunk):
        raise ValueError("int8 widening: scale or out does not match q's shape and the row range")
    _check(lib.ps_dequant_int8_rows(q.data_ptr(), scale.data_ptr(), out.data_ptr(), chunks, rows, chunk, first,
                                    last, torch.get_num_threads()), "int8 widening")
    return out
