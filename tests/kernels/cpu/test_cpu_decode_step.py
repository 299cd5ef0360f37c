"""The C GEMVs (kernels/cpu/csrc/gemv_entry.c and its loops) and the one-call decode step (decode_step.c).

GEMVs: against a float64 matmul of the exact weights the packed forms hold, for every row count they take,
through this machine's build (AVX-512 or AVX2 + FMA, where the CPU has it), a portable build of the same sources
and an AVX2 one.
Decode step: against the PyTorch path on the same int8 weights (PAGEDSERVE_CPU_DECODE_STEP=0): the same
greedy tokens and logprobs up to float32 summation order, for Llama (GQA), Qwen2 (q/k/v biases) and Qwen3
(q/k norms), alone, a few at once, and in batches that move between the two paths. The embedded model's
int4 run through it is tests/executor/model/quant/test_quantized_model.py.
"""
from __future__ import annotations

import glob
import os
import platform
import shutil

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.kernels.cpu import decode_step as cpu_decode_step
from pagedserve.kernels.cpu import int4_pack
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.weights import weight_only
from pagedserve.tests.helpers.kernels.int4_cases import assert_float64_close as _close, int4_case as _int4_case
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model, random_prompts

LIB = cpu_native.library()
# The GEMVs weight_only.py calls where they have a vector path for this process's int4 pack form, and the step where
# all its kernels do (CpuDecodeStep.runs_here, the rule the engine follows).
GEMVS = (LIB is not None and bool(LIB.ps_gemv_int8_vectorized())
         and bool(LIB.ps_gemv_int4_layouts() >> int4_pack.pack_layout() & 1))
needs_gemvs = pytest.mark.skipif(not GEMVS, reason="needs the vector GEMVs (AVX-512, or AVX2 + FMA) for this int4 pack")
needs_c_step = pytest.mark.skipif(not cpu_decode_step.CpuDecodeStep.runs_here(),
                                  reason="the C step needs the AVX-512 or AVX2 + FMA build of the CPU kernels")


def _int8_case(out: int, cols: int, chunk: int | None, seed: int) -> tuple[weight_only.Int8Weight, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = weight_only.quantize_int8(torch.randn(out, cols, generator=gen), chunk)
    chunks, rows, width = w.q.shape
    dense = (w.q.double() * w.scale.double().unsqueeze(-1)).transpose(0, 1).reshape(rows, chunks * width)
    return w, dense


@needs_gemvs
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("out,cols,group", [(64, 64, 32), (192, 576, 32), (128, 256, 128)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_gemv_matches_the_weights(rows, out, cols, group, symmetric):
    w, dense = _int4_case(out, cols, group, seed=rows + out, symmetric=symmetric)
    # scales alone only where our kernels take every int4 call (the GEMM too: torch's kernel reads pairs)
    assert w.scales_and_zeros.shape[-1] == (1 if symmetric and weight_only._native().int4_gemm else 2)
    x = torch.randn(rows, cols)
    _close(weight_only._int4_gemv(x, w), x, dense)      # int4_linear takes the integer GEMM where it is built


@needs_gemvs
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 13, 15])
@pytest.mark.parametrize("out,cols,chunk", [(80, 64, 32), (37, 200, None), (1000, 96, 32), (96, 128, 16),
                                            (48, 48, 16), (1100, 64, 16)])
def test_int8_gemv_matches_the_weights(rows, out, cols, chunk):
    """Chunked (a Q8_0 head; Q6_K's 16-column chunks, read in pairs, and an odd count of them; one row reads
    pairs in tiles of 256 channels: 550 a thread are two tiles, a partial one and a tail past the blocks of 16)
    and whole-row int8; channel counts with a tail past the blocks of 16; decode batches past GEMV_MAX_ROWS,
    below weight_only.INT8_DENSE_MIN_ROWS."""
    w, dense = _int8_case(out, cols, chunk, seed=rows + out)
    x = torch.randn(rows, cols)
    _close(weight_only.int8_linear(x, w), x, dense, int16_inputs=True)


@needs_gemvs
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("cols", [8192, 8256])
def test_int8_whole_rows_reach_their_largest_sums(rows, cols):
    """Whole-row int8 sums exactly in int32 lanes (gemv_int8.c): each lane takes cols / 16 products of at most
    127 * 32767, under 2^31 up to 8192 columns; past that the float sums take over. Every code and input at its
    largest: an overflow would come back negative."""
    w = weight_only.Int8Weight(torch.full((1, 32, cols), 127, dtype=torch.int8), torch.ones(1, 32, dtype=torch.bfloat16))
    y = weight_only.int8_linear(torch.ones(rows, cols), w)
    assert torch.allclose(y, torch.full((rows, 32), 127.0 * cols), rtol=1e-5)


@needs_gemvs
@pytest.mark.parametrize("out,cols,chunk", [(80, 64, 32), (1000, 96, 32), (37, 200, None), (96, 128, 16),
                                            (1100, 64, 16)])
def test_int8_gemv_gives_a_row_the_same_bits_whatever_rows_run_beside_it(out, cols, chunk):
    """A speculative verify pass's logits, and a decode batch's: rows share each widened code, and each still
    sums exactly as a one-row call does."""
    w, _ = _int8_case(out, cols, chunk, seed=out)
    x = torch.randn(19, cols) * torch.rand(19, 1) * 3
    alone = torch.cat([weight_only._int8_gemv(x[r:r + 1], w) for r in range(19)])
    for rows in (*range(2, 10), 16, 19):
        assert torch.equal(weight_only._int8_gemv(x[:rows], w), alone[:rows]), rows


def _has_avx2() -> bool:
    from pagedserve.common.config.dtype import cpuinfo_field
    return {"avx2", "fma", "f16c"} <= set((cpuinfo_field("flags") or "").split())


@pytest.mark.skipif(LIB is None or platform.machine() != "x86_64" or shutil.which("cc") is None,
                    reason="needs the C compiler on x86-64")
@pytest.mark.parametrize("march,layouts", [("x86-64-v2", 0), ("x86-64-v3", 1 << int4_pack.PACK_AVX2)])
def test_portable_build_gemvs(tmp_path, march, layouts):
    """The same sources built without AVX2 (the portable loops) and with AVX2 + FMA alone (its vector paths for
    the AVX2 pack, the portable loop for the other forms): the same results, and each says what it has."""
    if layouts and not _has_avx2():
        pytest.skip("the AVX2 build needs a CPU with AVX2, FMA and F16C")
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in cpu_native._COMPILE_FLAGS)
    target = str(tmp_path / "portable.so")
    cpu_native._build(shutil.which("cc"), sorted(glob.glob(os.path.join(cpu_native._SOURCES, "*.c"))), target, flags)
    lib = cpu_native.load(target)
    assert lib.ps_gemv_int4_layouts() == layouts
    assert lib.ps_gemv_int8_vectorized() == bool(layouts)
    assert lib.ps_decode_attention_vectorized() == bool(layouts)
    assert lib.ps_decode_step_layouts() == layouts
    assert lib.ps_gemm_int4_vectorized() == 0          # no VNNI: it says so, and declines every call
    w4, dense4 = _int4_case(128, 96, 32, seed=1)
    w8, dense8 = _int8_case(40, 96, 32, seed=2)
    w4s, dense4s = _int4_case(128, 96, 32, seed=3, symmetric=True)          # scales alone: stride 1
    scales_alone = w4s.scales_and_zeros[..., :1].contiguous()     # packed so only where the vector kernels run
    layout = int4_pack.pack_layout()
    codes = int4_pack.channel_codes(w4.packed, 96, torch.arange(128), layout)
    for rows in (1, 3):
        x = torch.randn(rows, 96)
        y4, y8 = torch.empty(rows, 128), torch.empty(rows, 40)
        assert lib.ps_gemv_int4(w4s.packed.data_ptr(), scales_alone.data_ptr(), 1, layout, 128, 96, 32,
                                x.data_ptr(), rows, y4.data_ptr(), 2) == 0
        _close(y4, x, dense4s)
        for other in (int4_pack.PACK_AVX512, int4_pack.PACK_AVX2, int4_pack.PACK_PLAIN):   # each form torch writes
            packed = int4_pack.pack_codes(codes, other)
            assert lib.ps_gemv_int4(packed.data_ptr(), w4.scales_and_zeros.data_ptr(), 2, other, 128, 96, 32,
                                    x.data_ptr(), rows, y4.data_ptr(), 2) == 0
            _close(y4, x, dense4)
        assert lib.ps_gemv_int4(w4.packed.data_ptr(), w4.scales_and_zeros.data_ptr(), 2, layout, 128, 96, 32,
                                x.data_ptr(), rows, y4.data_ptr(), 2) == 0
        assert lib.ps_gemv_int8(w8.q.data_ptr(), w8.scale.data_ptr(), 3, 40, 32, x.data_ptr(), rows,
                                y8.data_ptr(), 2) == 0
        assert lib.ps_gemm_int4(w4.packed.data_ptr(), w4.scales_and_zeros.data_ptr(), 2, 128, 96, 32, x.data_ptr(),
                                rows, y4.data_ptr(), 2) == 2
        _close(y4, x, dense4)
        _close(y8, x, dense8, int16_inputs=True)


def _randomize_norms_and_biases(folder: str) -> None:
    """transformers initialises norm weights to ones and biases to zeros: random values make a norm or a
    bias applied wrongly show."""
    from safetensors.torch import load_file, save_file
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(0)
    for name, w in tensors.items():
        if w.dim() == 1:
            tensors[name] = (0.0 if name.endswith(".bias") else 1.0) + 0.2 * torch.randn(w.shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_model(request, tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp(f"step_{request.param}"))
    make_tiny_model(folder, request.param, tie_word_embeddings=True)
    _randomize_norms_and_biases(folder)
    return folder


def _run(folder: str, prompts: list[list[int]], max_tokens: list[int], c_step: bool, monkeypatch) -> list:
    monkeypatch.setenv("PAGEDSERVE_CPU_DECODE_STEP", "1" if c_step else "0")
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in max_tokens]
    with LLM(folder, dtype="float32", quantization="int8", max_model_len=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@needs_c_step
def test_c_step_matches_the_pytorch_path(tiny_model, monkeypatch):
    """Same int8 weights, same C GEMVs for small-row linears both ways: the C step's norms, rotary, biases,
    cache writes and attention against PyTorch's, up to summation order."""
    calls, cap = [], []
    real_call, real_init = cpu_decode_step.CpuDecodeStep.__call__, cpu_decode_step.CpuDecodeStep.__init__
    monkeypatch.setattr(cpu_decode_step.CpuDecodeStep, "__call__",
                        lambda self, hidden, *a: calls.append(hidden.shape[0]) or real_call(self, hidden, *a))

    def capped_init(self, *args):
        real_init(self, *args)
        self.max_rows = min([self.max_rows, *cap])
    monkeypatch.setattr(cpu_decode_step.CpuDecodeStep, "__init__", capped_init)
    max_rows = cpu_native.library().ps_decode_step_max_rows()
    prompts = random_prompts(3, [5, 17, 33, 9, 12, 40, 3, 21, 28, 7, 15], vocab=512)
    # The last case caps the step at 8 rows: its batch moves from the layers to the step as requests finish.
    cases = [(prompts[:1], [24], None), (prompts[:3], [20, 14, 24], None),
             (prompts, [4 + 2 * i for i in range(11)], None), (prompts, [4 + 2 * i for i in range(11)], 8)]
    wants = {}
    for batch, max_tokens, limit in cases:
        calls.clear()
        cap[:] = [] if limit is None else [limit]
        got = _run(tiny_model, batch, max_tokens, True, monkeypatch)
        # The C step ran (a decode step of every sequence where they fit), and no step of more rows than it takes
        # did: it also takes a short prompt's prefill, each token a row attending up to its own position.
        limit = limit or max_rows
        assert calls and max(calls) <= limit and (len(batch) > limit or len(batch) in calls)
        key = (len(batch), tuple(max_tokens))
        want = wants[key] = wants.get(key) or _run(tiny_model, batch, max_tokens, False, monkeypatch)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            diffs = [abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob)
                     for a, b in zip(g.logprobs, w.logprobs)]
            # The int8 GEMVs round their inputs to int16 steps (max|x| / 32767): a last-bit difference between
            # the paths can move an input by a step, ~3e-5 relative, and that carries through the layers (up to
            # 2.1e-3 after 24 tokens, measured, once batches of 9-15 rows rounded to int16 too).
            # A wrong norm, bias, rotary or cache slot moves logprobs by 0.1 or more.
            assert max(diffs) < 5e-3, diffs


@needs_c_step
def test_c_step_refuses_bad_inputs_by_name(tiny_model):
    with LLM(tiny_model, dtype="float32", quantization="int8", max_model_len=256) as llm:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3), use_tqdm=False)
        step = llm.engine.executor.worker.runner.decode_step.c_step
    assert step is not None
    hidden, cos = torch.zeros(1, 64), torch.zeros(1, 16)
    ok = dict(slots=torch.zeros(1, dtype=torch.int64), tables=torch.zeros(1, 4, dtype=torch.int32),
              lens=torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="slots"):
        step(hidden, cos, cos, **{**ok, "slots": torch.zeros(1, dtype=torch.int32)})
    with pytest.raises(ValueError, match="rows"):
        step(torch.zeros(step.max_rows + 1, 64), cos, cos, **ok)


@needs_c_step
@pytest.mark.skipif(LIB is None or LIB.ps_decode_step_max_rows() < 24, reason="needs the int4 GEMM (AVX512-VNNI)")
def test_c_step_takes_int4_batches_past_the_gemv(tmp_path, monkeypatch):
    """A GPTQ model kept in int4: a decode batch of 24 sequences is one C call (the int4 GEMM past the GEMV's 8
    rows; the 4352-wide down_proj rounds its rows on the heap), against the PyTorch layers on the same weights."""
    from pagedserve.tests.helpers.models.quant_checkpoints import write_quantized_checkpoint
    float_dir = make_tiny_model(str(tmp_path / "float"), "llama", intermediate_size=4352)
    write_quantized_checkpoint(float_dir, str(tmp_path / "gptq"), str(tmp_path / "dequant"), "gptq", group_size=32)
    calls = []
    real_call = cpu_decode_step.CpuDecodeStep.__call__
    monkeypatch.setattr(cpu_decode_step.CpuDecodeStep, "__call__",
                        lambda self, hidden, *a: calls.append(hidden.shape[0]) or real_call(self, hidden, *a))
    prompts = random_prompts(5, [6 + (i * 7) % 23 for i in range(24)], vocab=512)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    runs = []
    for c_step in (True, False):
        monkeypatch.setenv("PAGEDSERVE_CPU_DECODE_STEP", "1" if c_step else "0")
        with LLM(str(tmp_path / "gptq"), dtype="float32", max_model_len=256) as llm:
            assert isinstance(llm.engine.executor.worker.runner.model.model.layers[0].mlp.down_proj.packed,
                              weight_only.Int4Weight)
            runs.append([o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)])
        if c_step:
            assert 24 in calls
    for got, want in zip(*runs):
        assert got.token_ids == want.token_ids
        diffs = [abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob)
                 for a, b in zip(got.logprobs, want.logprobs)]
        assert max(diffs) < 5e-3, diffs
