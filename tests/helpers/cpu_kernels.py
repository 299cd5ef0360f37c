"""Whether this machine runs the C decode step: the AVX-512 build of kernels/cpu/csrc, over torch's AVX-512 int4
pack (kernels/cpu/int4_pack.py). Elsewhere the PyTorch paths serve, and the tests check what they give."""
from __future__ import annotations

from pagedserve.kernels.cpu import int4_pack
from pagedserve.kernels.cpu import native as cpu_native


def c_step_runs() -> bool:
    lib = cpu_native.library()
    return (lib is not None and bool(lib.ps_gemv_vectorized())
            and int4_pack.pack_layout() == int4_pack.PACK_AVX512)
