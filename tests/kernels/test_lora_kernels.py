"""LoRA's shrink/expand: the Triton kernels (CPU: TRITON_INTERPRET=1, small shapes) and the grouped torch path
of LoRASlots against a per-token reference, on a mix of slots with different ranks, tokens of the base model
(slot -1), and a pool whose shape does not change with the mix."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before the kernel modules are imported: @triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from pagedserve.executor.model.layers.lora import LoRAContext, LoRASlots, pack_pieces  # noqa: E402
from pagedserve.kernels.triton.lora import lora_delta  # noqa: E402
from pagedserve.tests.helpers.kernels.kernel_checks import DEVICE  # noqa: E402

IN, OUT, MAX_RANK, SLOTS = 40, 24, 8, 3


def _pool(device: torch.device, dtype: torch.dtype = torch.float32, cpu_kernel: bool = False
          ) -> tuple[LoRASlots, LoRAContext, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Three adapters of ranks 8, 3 and 5 in slots 0-2 (two pieces: outputs 0-13 and 14-23); the packed (A, B)
    in float32."""
    gen = torch.Generator().manual_seed(0)
    ctx = LoRAContext(cpu_kernel=cpu_kernel)
    pool = LoRASlots([14, 10], IN, OUT, SLOTS, MAX_RANK, ctx, dtype, device)
    packed = []
    for slot, rank in enumerate((8, 3, 5)):
        pieces = [(torch.randn(rank, IN, generator=gen), 0, torch.randn(14, rank, generator=gen)),
                  (torch.randn(rank, IN, generator=gen), 14, torch.randn(10, rank, generator=gen))]
        a, b = pack_pieces(pieces, rank, IN, OUT, torch.float32)
        pool.set_slot(slot, a.to(device), b.to(device))
        packed.append((a, b))
    return pool, ctx, packed


def _reference(x: torch.Tensor, slots: list[int], packed, y0: torch.Tensor) -> torch.Tensor:
    y = y0.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            a, b = packed[s]
            y[t] += (x[t] @ a.T) @ b.T
    return y


@pytest.mark.parametrize("slots", [[0, -1, 2, 1, 0, -1, 2], [1, 1, 1], [-1, -1], [2, 0, 0, 0, 1]])
def test_grouped_torch_path_and_triton_kernels_match_per_token(slots):
    gen = torch.Generator().manual_seed(len(slots))
    x, y0 = torch.randn(len(slots), IN, generator=gen), torch.randn(len(slots), OUT, generator=gen)
    pool, ctx, packed = _pool(torch.device("cpu"))
    want = _reference(x, slots, packed, y0)
    ctx.set_rows(slots, torch.device("cpu"))
    assert torch.allclose(pool.apply(x, y0.clone()), want, atol=1e-4)
    if ctx.padded is not None:          # the batched-matmul path, where the C kernel does not serve
        assert torch.allclose(pool._apply_padded(x, y0.clone(), ctx.padded), want, atol=1e-4)
    dev = torch.device(DEVICE)
    pool_d, _, _ = _pool(dev)
    got = lora_delta(x.to(dev), pool_d.a, pool_d.b, torch.tensor(slots, dtype=torch.int32, device=dev),
                     y0.clone().to(dev))
    assert torch.allclose(got.cpu(), want, atol=1e-4)


def test_a_cleared_slot_adds_nothing_in_the_kernels():
    """A layer an adapter leaves alone is a cleared slot: zeros, since the kernels sum the pool's whole width."""
    dev = torch.device(DEVICE)
    pool, _, _ = _pool(dev)
    pool.clear_slot(1)
    x, y0 = torch.randn(2, IN), torch.randn(2, OUT)
    got = lora_delta(x.to(dev), pool.a, pool.b, torch.tensor([1, 1], dtype=torch.int32, device=dev), y0.clone().to(dev))
    assert torch.equal(got.cpu(), y0)


def test_c_kernel_matches_per_token_on_interleaved_rows_and_long_runs():
    """The CPU's one-call delta (kernels/cpu/csrc/lora.c) as LoRAManager sets it up (cpu_kernel): rows of several
    slots interleaved and a long run of one slot, every adapter token in one call, sorted by slot."""
    from pagedserve.kernels.cpu.native import library
    if library() is None:
        pytest.skip("no C compiler here")
    slots = [0, 2, 1, -1, 0, 2] + [1] * 12            # six decode rows, then a 12-token prefill run of slot 1
    gen = torch.Generator().manual_seed(3)
    x, y0 = torch.randn(len(slots), IN, generator=gen), torch.randn(len(slots), OUT, generator=gen)
    pool, ctx, packed = _pool(torch.device("cpu"), cpu_kernel=True)
    ctx.set_rows(slots, torch.device("cpu"))
    assert ctx.order.tolist() == [0, 4, 2, *range(6, 18), 1, 5] and not ctx.groups and ctx.padded is None
    assert torch.allclose(pool.apply(x, y0.clone()), _reference(x, slots, packed, y0), atol=1e-4)


def test_bfloat16_slots_match_per_token_on_their_rounded_weights():
    """bfloat16 slots (LoRAManager's pool_dtype over a quantized CPU base): the C kernel widens the weights and
    keeps x and the sums in float32, so it matches the float32 reference on the rounded weights as closely as
    float32 slots do; torch's matmuls (no C kernel) also round x and x A^T to bfloat16 (2^-9 of the delta)."""
    from pagedserve.kernels.cpu.native import library
    if library() is None:
        pytest.skip("no C compiler here")
    slots = [0, 2, 1, -1, 0, 2] + [1] * 12
    gen = torch.Generator().manual_seed(4)
    x, y0 = torch.randn(len(slots), IN, generator=gen), torch.randn(len(slots), OUT, generator=gen)
    for cpu_kernel in (True, False):
        pool, ctx, packed = _pool(torch.device("cpu"), torch.bfloat16, cpu_kernel)
        want = _reference(x, slots, [(a.bfloat16().float(), b.bfloat16().float()) for a, b in packed], y0)
        ctx.set_rows(slots, torch.device("cpu"))
        got = pool.apply(x, y0.clone())
        if cpu_kernel:
            assert torch.allclose(got, want, atol=1e-4)
            assert ((_reference(x, slots, packed, y0) - want).abs() > 1e-3).any()     # bfloat16 did round them
        else:
            assert ((got - want).abs() <= 0.02 * (want - y0).abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_build_of_the_c_kernel_matches(dtype, march, tmp_path):
    """lora.c built without AVX2 (its plain loops) and with AVX2 + FMA alone (its 8-lane loops) gives what the
    reference gives, as this machine's build does; a width and feature counts that are not multiples of the
    vectors' 8 or 16 lanes (the masked tails there)."""
    import ctypes
    import glob
    import platform
    import shutil

    from pagedserve.kernels.cpu import native as cpu_native
    if cpu_native.library() is None or platform.machine() != "x86_64" or shutil.which("cc") is None:
        pytest.skip("needs the C compiler on x86-64")
    if march == "x86-64-v3" and not {"avx2", "fma"} <= set(cpu_native._cpu_flags().split()):
        pytest.skip("the AVX2 build needs a CPU with AVX2 and FMA")
    sources = [s for s in glob.glob(os.path.join(cpu_native._SOURCES, "*.c")) if os.path.basename(s) in
               ("lora.c", "parallel.c")]
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in cpu_native._COMPILE_FLAGS)
    cpu_native._build(shutil.which("cc"), sorted(sources), str(tmp_path / "portable.so"), flags)
    portable = ctypes.CDLL(str(tmp_path / "portable.so"))
    portable.ps_lora_bgmv.argtypes = cpu_native._SIGNATURES["ps_lora_bgmv"]
    slots = [0, 2, 1, -1, 0, 2, 2, 1, 0, 0, 0]
    gen = torch.Generator().manual_seed(5)
    x, y0 = torch.randn(len(slots), IN, generator=gen), torch.randn(len(slots), OUT, generator=gen)
    pool, _, packed = _pool(torch.device("cpu"), dtype)
    want = _reference(x, slots, [(a.to(dtype).float(), b.to(dtype).float()) for a, b in packed], y0)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    order = torch.tensor(sorted((t for t, s in enumerate(slots) if s >= 0), key=lambda t: slots[t]), dtype=torch.int32)
    for lib in (cpu_native.library(), portable):
        y = y0.clone()
        assert lib.ps_lora_bgmv(x.data_ptr(), pool.a.data_ptr(), pool.b_t.data_ptr(), int(dtype == torch.bfloat16),
                                order.data_ptr(), order.numel(), token_slots.data_ptr(), pool.widths.data_ptr(),
                                pool.bounds_t.data_ptr(), 2, y.data_ptr(), IN, OUT, pool.a.shape[1], 2) == 0
        assert torch.allclose(y, want, atol=1e-4)
