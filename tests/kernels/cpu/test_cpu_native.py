"""The C library of CPU kernels (kernels/cpu/native.py): a fresh build in an empty cache folder loads, and
loading it leaves the process's floating point alone (a -ffast-math link once turned on flush-to-zero for
the whole process, which broke hypothesis in the HTTP fuzz tests and fp8 subnormals)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels.cpu import native as cpu_native

PROBE = """
import glob, os, sys
import torch
from pagedserve.kernels.cpu import native as cpu_native
assert cpu_native.library() is not None, "no library"
assert 5e-324 * 1.0 > 0.0, "python floats lost subnormals"
assert torch.tensor([1e-40]).mul(1.0).item() > 0.0, "torch lost subnormals"
print(len(glob.glob(os.path.join(os.environ["PAGEDSERVE_CACHE_DIR"], "kernels", "*.so"))))
"""


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler on this machine")
def test_fresh_build_loads_and_keeps_subnormals(tmp_path):
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    for _ in range(2):                       # the second process finds the cached library
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "1"


def test_threads_for_small_work_is_one():
    assert cpu_native.threads_for(10, 1 << 19) == 1
    assert cpu_native.threads_for(1 << 30, 1) == torch.get_num_threads()
