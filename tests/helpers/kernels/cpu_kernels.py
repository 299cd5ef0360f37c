"""Whether this machine runs the C decode step: kernels/cpu/decode_step.py's one rule (the C kernels' vector paths
for the int4 pack form torch writes here: AVX-512 or AVX2 + FMA). Elsewhere the PyTorch paths serve, and the tests
check what they give."""
from __future__ import annotations

from pagedserve.kernels.cpu.decode_step import CpuDecodeStep


def c_step_runs() -> bool:
    return CpuDecodeStep.runs_here()
