"""scripts/bench_cpu_gemm.py: on an AMX CPU it times both tiles on every ladder shape, checks their outputs equal
to the bit, and writes one result line per shape and row count."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.kernels.cpu import native as cpu_native

LIB = cpu_native.library()


@pytest.mark.skipif(LIB is None or not LIB.ps_gemm_int4_s8_amx(), reason="needs a CPU whose kernel grants AMX")
def test_writes_a_line_per_shape_with_both_tiles(tmp_path, scripts_on_path):
    out = tmp_path / "gemm.jsonl"
    subprocess.run([sys.executable, str(scripts_on_path / "bench_cpu_gemm.py"), "--rows", "32", "--repeats", "1", "--result-file", str(out)],
                   check=True, capture_output=True, timeout=300)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 12                                  # 6 shapes, symmetric and with zeros, 32 rows
    assert {(r["out"], r["in"]) for r in lines} == {(2048, 2048), (16384, 2048), (2048, 8192), (960, 960),
                                                    (5120, 960), (960, 2560)}
    for r in lines:
        assert r["bench"] == "cpu_gemm_amx" and r["rows"] == 32 and r["vnni_ms"] > 0 and r["amx_ms"] > 0
        assert r["speedup"] == pytest.approx(r["vnni_ms"] / r["amx_ms"])
