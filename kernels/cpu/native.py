"""The CPU kernels of our own (kernels/cpu/csrc/*.c): built with the system C compiler, loaded with ctypes.

Compiled at first use (`cc -O3 -march=native -ffast-math`, linked without it; about a second) into the pagedserve cache folder,
keyed by the sources, the flags and the CPU's feature flags, so a cache folder shared by different machines
never serves one a library built for another. No torch headers, so no minute-long extension build. Without
a working compiler `library()` is None, and every caller keeps its PyTorch path.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch

from pagedserve.common import envs
from pagedserve.common.config.dtype import cpuinfo_field
from pagedserve.common.model.model_files import cache_root

logger = logging.getLogger(__name__)

_SOURCES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# -ffast-math: vectorized expf and float reductions in the attention kernel (written for it, see there).
# -fopenmp: our threads are torch's OpenMP threads (kernels/cpu/csrc/parallel.c says why).
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
_LINK_FLAGS = ("-shared", "-fopenmp")
I64, PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "ps_dequant_int4_t": [PTR, PTR, I64, I64, PTR, I64, I64, I64, ctypes.c_int],
    "ps_dequant_int8_rows": [PTR, PTR, PTR, I64, I64, I64, I64, I64, ctypes.c_int],
    "ps_int4_rows": [PTR, PTR, I64, I64, I64, I64, I64, PTR, I64, PTR],
    "ps_gemv_int4": [PTR, PTR, I64, I64, I64, I64, I64, PTR, I64, PTR, ctypes.c_int],
    "ps_gemv_int8": [PTR, PTR, I64, I64, I64, PTR, I64, PTR, ctypes.c_int],
    "ps_gemv_int4_layouts": [],
    "ps_gemv_int8_vectorized": [],
    "ps_decode_attention_vectorized": [],
    "ps_decode_step_layouts": [],
    "ps_gemm_int4": [PTR, PTR, I64, I64, I64, I64, PTR, I64, PTR, ctypes.c_int],
    "ps_gemm_int4_vectorized": [],
    "ps_gemm_intn": [PTR, PTR, I64, I64, I64, I64, I64, PTR, I64, PTR, ctypes.c_int],
    "ps_gemm_intn_built": [],
    "ps_dequant_intn_t": [PTR, PTR, I64, I64, PTR, I64, I64, I64, ctypes.c_int],
    "ps_gemm_int4_min_rows": [],
    "ps_gemm_int4_s8": [PTR, PTR, I64, I64, I64, I64, PTR, I64, PTR, ctypes.c_int],
    "ps_gemm_int4_s8_built": [],
    "ps_gemm_int4_s8_amx": [],
    "ps_gemm_int4_s8_vnni": [PTR, PTR, I64, I64, I64, I64, PTR, I64, PTR, ctypes.c_int],
    "ps_decode_step_max_rows": [],
    "ps_decode_step_scratch": [PTR, I64, I64],
    "ps_decode_step": [PTR, PTR, I64, PTR, PTR, PTR, PTR, I64, PTR, PTR, PTR, ctypes.c_int],
    "ps_lora_bgmv": [PTR, PTR, PTR, I64, PTR, I64, PTR, PTR, PTR, I64, PTR, I64, I64, I64, ctypes.c_int],
    "ps_paged_decode": [PTR, PTR, PTR, ctypes.c_int, PTR, I64, PTR, PTR, I64, I64, I64, I64, I64, ctypes.c_float,
                        ctypes.c_int],
}


def _cpu_flags() -> str:
    return cpuinfo_field("flags") or platform.processor()


def _build(compiler: str, sources: list[str], target: str, flags: tuple[str, ...] = _COMPILE_FLAGS) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as work:
        objects = []
        for source in sources:
            objects.append(os.path.join(work, os.path.basename(source) + ".o"))
            subprocess.run([compiler, *flags, "-c", source, "-o", objects[-1]], check=True,
                           capture_output=True, timeout=120)
        # Linked without -ffast-math: with it, gcc adds crtfastmath.o, whose constructor turns on flush-to-zero
        # for the whole process when the library loads (subnormals vanish from every float op after that).
        tmp = os.path.join(work, "lib.so")
        subprocess.run([compiler, *_LINK_FLAGS, *objects, "-o", tmp, "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, target)      # atomic: processes that build at the same time never load a half file


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernels, built once per source and machine; None where no C compiler works."""
    compiler = envs.CC or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.system() != "Linux":
        logger.info("cpu kernels: no C compiler; the PyTorch paths serve every shape")
        return None
    sources = sorted(glob.glob(os.path.join(_SOURCES, "*.c")))
    digest = hashlib.sha256(" ".join((compiler, *_COMPILE_FLAGS, *_LINK_FLAGS, _cpu_flags())).encode())
    for path in sorted(glob.glob(os.path.join(_SOURCES, "*"))):
        with open(path, "rb") as f:
            digest.update(f.read())
    target = os.path.join(cache_root(), "kernels", f"pagedserve_cpu-{digest.hexdigest()[:16]}.so")
    try:
        if not os.path.exists(target):
            _build(compiler, sources, target)
        lib = load(target)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("cpu kernels unavailable (%s %s); the PyTorch paths serve every shape",
                       e, detail.decode(errors="replace")[-500:])
        return None
    return lib


def load(path: str) -> ctypes.CDLL:
    """A built library, its functions typed (also for builds with other flags, in the tests)."""
    lib = ctypes.CDLL(path)
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
    lib.ps_decode_step_scratch.restype = I64
    return lib


# The forms of an int4 weight's group scales (kernels/cpu/csrc/gemv.h): bfloat16 scales alone (symmetric groups),
# bfloat16 (scale, zero) pairs, or a K-quant's 8-bit codes under float16 super-scales of SZ_K_GROUPS groups.
SZ_SCALES, SZ_PAIRS, SZ_K = 1, 2, 3
SZ_K_GROUPS = 8


def int4_sz_form(scales_and_zeros: torch.Tensor) -> int:
    """The C kernels' sz_form of an int4 pack's scales: the K form is the one stored as int16 words."""
    return SZ_K if scales_and_zeros.dtype == torch.int16 else scales_and_zeros.shape[-1]


def threads_for(work: int, min_work_per_thread: int) -> int:
    """Threads worth a parallel region for `work` units: small calls run on the caller's thread alone."""
    return max(1, min(torch.get_num_threads(), work // min_work_per_thread))


def check(code: int, what: str) -> None:
    if code:
        raise RuntimeError(f"{what}: the C kernel failed with code {code}")
