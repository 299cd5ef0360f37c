"""Our C kernels and lookups read torch's CPU int4 pack in whichever form torch's dispatch writes
(kernels/cpu/int4_pack.py): on an AVX2 machine the AVX-512 form was read before, and every widened weight and
tied int4 embedding row came out wrong. Each form torch can write on this machine is checked in a process of
its own (ATEN_CPU_CAPABILITY picks the dispatch at start): the widening and the embedding rows equal torch's own
kernel's weight, bit for bit."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels.cpu import int4_pack
from pagedserve.kernels.cpu import native as cpu_native

_CHECK = """
import torch
from pagedserve.kernels.cpu import dequant, int4_pack
from pagedserve.kernels.weights.weight_only import Int4Weight, int4_embedding
out, cols, group = 192, 128, 32
g = torch.Generator().manual_seed(0)
q = torch.randint(0, 16, (out, cols), generator=g, dtype=torch.int32)
pairs = torch.randn(cols // group, out, 2, generator=g).to(torch.bfloat16)
packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
kernels = torch._weight_int4pack_mm_for_cpu(torch.eye(cols, dtype=torch.bfloat16), packed, group, pairs)
assert torch.equal(dequant.int4_to_bf16_t(packed, pairs, out, cols, group), kernels)
ids = torch.tensor([0, 5, 31, 32, 63, 64, 100, 191])
rows = int4_embedding(ids, Int4Weight(packed, pairs, group, out, cols), torch.float32)
assert torch.equal(rows.to(torch.bfloat16), kernels.t()[ids]), "embedding rows"
print(torch.backends.cpu.get_cpu_capability(), int4_pack.pack_layout())
"""


def test_the_form_found_is_the_one_torch_writes() -> None:
    q = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
    layout = int4_pack.pack_layout()
    assert torch.equal(packed.view(128, 32), int4_pack.pack_codes(q, layout))
    channels = torch.tensor([0, 17, 31, 32, 47, 63, 64, 127])
    assert torch.equal(int4_pack.channel_codes(packed, 64, channels, layout), q[channels])


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_widening_and_lookups_read_each_form(capability: str) -> None:
    flags = open("/proc/cpuinfo").read() if sys.platform == "linux" else ""
    if capability != "default" and f" {capability}" not in flags.replace("avx512f", "avx512"):
        pytest.skip(f"this CPU has no {capability}")
    done = subprocess.run([sys.executable, "-c", _CHECK], env={**os.environ,
                          "ATEN_CPU_CAPABILITY": capability}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    reported, layout = done.stdout.split()
    want = {"DEFAULT": int4_pack.PACK_PLAIN, "AVX2": int4_pack.PACK_AVX2, "AVX512": int4_pack.PACK_AVX512}
    assert int(layout) == want[reported]
