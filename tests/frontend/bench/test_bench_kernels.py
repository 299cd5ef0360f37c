"""`pagedserve bench kernels` (frontend/bench/gpu/): it builds and imports on a machine without a GPU, says so
when asked to run there, and on a GPU writes its tables."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from pagedserve.frontend import pagedserve_cli
from pagedserve.frontend.bench.gpu import kernels


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve.frontend.pagedserve_cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_names_both_tables():
    proc = cli("bench", "kernels", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "GPU kernel timings against the two floors" in proc.stdout
    assert "pagedserve bench kernels --moe --out" in proc.stdout and "--out" in proc.stdout
    args = pagedserve_cli.parse_args(["bench", "kernels", "--moe"])
    assert args.moe and args.out is None and args.run is kernels.main


def test_the_gpu_modules_import_without_a_gpu():
    pytest.importorskip("triton")
    for name in ("timing", "dense", "moe"):           # nothing touches CUDA at import time
        importlib.import_module(f"pagedserve.frontend.bench.gpu.{name}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the benchmark would run")
@pytest.mark.parametrize("flags", [(), ("--moe",)])
def test_without_a_gpu_it_says_so(tmp_path, flags):
    out = tmp_path / "kernels.md"
    proc = cli("bench", "kernels", *flags, "--out", str(out))
    assert proc.returncode == 1 and "pagedserve bench kernels needs a CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_table_on_a_gpu(tmp_path):
    out = tmp_path / "moe.md"
    proc = cli("bench", "kernels", "--moe", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "### Fused MoE, OLMoE-1B-7B expert layer" in text
    rows = [line for line in text.splitlines() if line.startswith("| fused MoE T=")]
    assert [r.split()[3] for r in rows] == ["T=1", "T=8", "T=64", "T=256", "T=1024", "T=4096"]
