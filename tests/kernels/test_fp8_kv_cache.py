"""--kv-cache-dtype fp8: the e4m3 cache write and read (reference and Triton, on CPU under TRITON_INTERPRET=1,
which converts e4m3 the way torch does), checkpoint scales, and the engine end to end on the tiny Llama.

Tolerances. e4m3 keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself, relatively (half of
its 2^-3 spacing); below 2^-6 (subnormals, spacing 2^-9) the error is at most 2^-10 absolute. Everything
is in units of the scale: stored = x / scale. Attention over an fp8 cache is a softmax average of rows each
off by at most 2^-4, with scores off by about as much; on N(0, 1) data the measured relative error of the
output is ~1-2 %, so the tests ask for 2^-4 (6 %): a kernel that dropped a scale or lost saturation is off by
far more (a 2x scale mistake is 50-100 %).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before the kernel modules are imported

from pagedserve.kernels.attention import reference  # noqa: E402
from pagedserve.kernels.attention.kv_quant import FP8_KV_DTYPE, dequantize_kv, quantize_kv  # noqa: E402
from pagedserve.tests.helpers.kernels.attention_cases import make_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3_REL = 2.0 ** -4            # half the spacing of 3 mantissa bits, relative
E4M3_SUBNORMAL_ABS = 2.0 ** -10  # half the subnormal spacing 2^-9, in units of the scale


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("scale", [1.0, 0.05, 3.0])
def test_quantize_kv_rounds_within_e4m3_precision_and_saturates(scale):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * 40 * scale
    x[:3] = torch.tensor([1000.0, -1e6, 448.0]) * scale           # past e4m3's range: saturate, never NaN
    codes = quantize_kv(x, scale, FP8_KV_DTYPE)
    assert codes.dtype == FP8_KV_DTYPE
    back = dequantize_kv(codes, scale)
    assert not torch.isnan(back).any()
    assert back[:3].tolist() == pytest.approx([448 * scale, -448 * scale, 448 * scale])
    inside = x[3:]
    bound = E4M3_REL * inside.abs() + E4M3_SUBNORMAL_ABS * scale
    assert bool(((back[3:] - inside).abs() <= bound * (1 + 1e-6)).all())
    # A float cache stores the values unchanged and ignores the scale: `auto` is exactly as before.
    assert torch.equal(quantize_kv(x, scale, torch.float32), x)
    assert dequantize_kv(x, scale) is x


def _fp8_batch(seqs, block_size, hkv, d, seed, k_scale, v_scale):
    """A random paged batch in float32 and the same cache quantized to e4m3 with the given scales."""
    gen = torch.Generator().manual_seed(seed)
    k32, v32, _, meta = make_batch(seqs, block_size, hkv, d, gen)
    k32, v32 = k32 * k_scale * 30, v32 * v_scale * 30             # spread over e4m3's range (|x| ~ 30)
    k8 = quantize_kv(k32, k_scale, FP8_KV_DTYPE)
    v8 = quantize_kv(v32, v_scale, FP8_KV_DTYPE)
    return k32, v32, k8, v8, meta, gen


SEQS = [(1, 1), (17, 1), (70, 1), (20, 20), (45, 13)]


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.02, 0.5)])
def test_reference_attention_over_fp8_cache(k_scale, v_scale):
    k32, v32, k8, v8, meta, gen = _fp8_batch(SEQS, 16, 2, 32, 1, k_scale, v_scale)
    q = torch.randn(meta.query_start_loc_cpu[-1], 6, 32, generator=gen) / (30 * k_scale)
    scale = 32 ** -0.5
    out = reference.paged_attention(q, k8, v8, meta, scale, k_scale=k_scale, v_scale=v_scale)
    # Attention over the dequantized values (the fp8 path only dequantizes after gathering), up to float32
    # rounding: a float32 cache's decodes run the C kernel, whose sums run in another order than SDPA's ...
    deq = reference.paged_attention(q, dequantize_kv(k8, k_scale), dequantize_kv(v8, v_scale), meta, scale)
    torch.testing.assert_close(out, deq, rtol=1e-4, atol=1e-5)
    # ... and close to attention over the unrounded float32 cache.
    exact = reference.paged_attention(q, k32, v32, meta, scale)
    assert rel_err(out, exact) < E4M3_REL


def test_reference_write_divides_by_the_scale():
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(5, 2, 16, generator=gen) * 10, torch.randn(5, 2, 16, generator=gen)
    k_cache = torch.zeros(3, 2, 8, 16, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 9, -1, 23, 4])
    reference.write_kv_cache(key, value, k_cache, v_cache, slots, k_scale=0.25, v_scale=0.01)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, 8)
        assert torch.equal(k_cache[block, :, offset], (key[t] / 0.25).clamp(-448, 448).to(FP8_KV_DTYPE))
        assert torch.equal(v_cache[block, :, offset], (value[t] / 0.01).clamp(-448, 448).to(FP8_KV_DTYPE))


# ---------------------------------------------------------------- Triton (interpreter on CPU)


def _write_both(key, value, slots, k_scale, v_scale, blocks=5, bs=8):
    from pagedserve.kernels.attention import triton_cache
    shape = (blocks, key.shape[1], bs, key.shape[2])
    ref_k, ref_v = (torch.zeros(shape, dtype=FP8_KV_DTYPE) for _ in range(2))
    reference.write_kv_cache(key, value, ref_k, ref_v, slots, k_scale=k_scale, v_scale=v_scale)
    k_cache, v_cache = (torch.zeros(shape, dtype=FP8_KV_DTYPE, device=DEVICE) for _ in range(2))
    triton_cache.write_kv_cache(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE),
                                k_scale=k_scale, v_scale=v_scale)
    return (k_cache.cpu().view(torch.uint8), v_cache.cpu().view(torch.uint8),
            ref_k.view(torch.uint8), ref_v.view(torch.uint8))


SLOTS = torch.tensor([3, -1, 9, 39, 15, 0, -1, 22, 30])


def test_triton_write_kv_cache_fp8_scales_saturates_and_skips_padding():
    """Runs under the interpreter: inputs whose quotient by the scale is an e4m3 value or lies past +-448,
    so that no rounding is involved (the interpreter's fp32 -> e4m3 rounding is wrong: it loses the carry
    into the exponent, -127.3 becomes -64; the GPU converts with cvt.rn.satfinite, checked by the next test)."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(3)
    hkv, d = 3, 32
    codes = torch.randn(9, hkv + 1, d, generator=gen).mul(40).to(FP8_KV_DTYPE).float()
    codes[0, 0, :4] = torch.tensor([1000.0, -5000.0, 448.0, -448.0])    # saturate to +-448, never NaN
    k_scale, v_scale = 0.25, 2.0 ** -7               # powers of two: x / scale is exact in float32
    key = (codes * k_scale)[:, :hkv]                 # strided, like a slice of qkv
    value = codes[:, 1:] * v_scale
    k, v, ref_k, ref_v = _write_both(key, value, SLOTS, k_scale, v_scale)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    assert ref_k.view(FP8_KV_DTYPE)[0, 0, 3, :4].float().tolist() == [448.0, -448.0, 448.0, -448.0]
    written = [s for s in SLOTS.tolist() if s >= 0]
    flat = ref_k.view(5, hkv, 8, d).transpose(1, 2).reshape(40, hkv, d)
    assert bool((flat[[s for s in range(40) if s not in written]] == 0).all())    # -1 rows went nowhere


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter rounds fp32 -> e4m3 wrongly")
def test_triton_write_kv_cache_fp8_rounds_as_torch():
    gen = torch.Generator().manual_seed(4)
    key = torch.randn(9, 3, 64, generator=gen) * 50
    value = torch.randn(9, 3, 64, generator=gen) * 3
    k, v, ref_k, ref_v = _write_both(key, value, SLOTS, 0.3, 0.02)
    # Same codes bit for bit: both divide in float32, saturate, and round to nearest even.
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.02, 0.5)])
def test_triton_attention_fp8_cache_equals_reference(num_splits, k_scale, v_scale):
    pytest.importorskip("triton")
    from pagedserve.kernels.attention import triton_paged as triton_attention
    from pagedserve.tests.helpers.kernels.kernel_checks import to_device
    seqs = SEQS if num_splits == 1 else [(n, 1) for n in (1, 17, 64, 100)]
    k32, v32, k8, v8, meta, gen = _fp8_batch(seqs, 16, 2, 32, 4, k_scale, v_scale)
    q = torch.randn(meta.query_start_loc_cpu[-1], 6, 32, generator=gen) / (30 * k_scale)
    scale = 32 ** -0.5
    ref = reference.paged_attention(q, k8, v8, meta, scale, k_scale=k_scale, v_scale=v_scale)
    out = triton_attention.paged_attention(q.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE), to_device(meta), scale,
                                           num_splits=num_splits, k_scale=k_scale, v_scale=v_scale).cpu()
    # The same e4m3 codes on both sides: only float32 summation order differs (the float32 tests' bound).
    assert rel_err(out, ref) < 1e-3
    assert rel_err(out, reference.paged_attention(q, k32, v32, meta, scale)) < E4M3_REL


def test_triton_attention_fp8_cache_with_a_half_precision_query():
    """fp16 queries: the e4m3 tiles are converted to fp16 (exact) for the dot products. (bf16 dots are wrong
    under the interpreter, see test_kernels.py; the GPU test covers bf16.)"""
    pytest.importorskip("triton")
    from pagedserve.kernels.attention import triton_paged as triton_attention
    from pagedserve.tests.helpers.kernels.kernel_checks import to_device
    _, _, k8, v8, meta, gen = _fp8_batch(SEQS, 16, 2, 32, 6, 0.05, 0.1)
    q = (torch.randn(meta.query_start_loc_cpu[-1], 4, 32, generator=gen) / 1.5).half()
    ref = reference.paged_attention(q.float(), k8, v8, meta, 32 ** -0.5, k_scale=0.05, v_scale=0.1)
    out = triton_attention.paged_attention(q.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE), to_device(meta),
                                           32 ** -0.5, k_scale=0.05, v_scale=0.1)
    assert out.dtype == torch.float16
    assert rel_err(out.float().cpu(), ref) < 2e-2        # the fp16 bound of test_attention_half_precision


def test_triton_attention_ignores_scales_for_a_float_cache():
    pytest.importorskip("triton")
    from pagedserve.kernels.attention import triton_paged as triton_attention
    from pagedserve.tests.helpers.kernels.kernel_checks import to_device
    k32, v32, _, _, meta, gen = _fp8_batch(SEQS, 16, 2, 32, 5, 1.0, 1.0)
    q = torch.randn(meta.query_start_loc_cpu[-1], 4, 32, generator=gen) / 30
    args = (q.to(DEVICE), k32.to(DEVICE), v32.to(DEVICE), to_device(meta), 32 ** -0.5)
    plain = triton_attention.paged_attention(*args)
    scaled = triton_attention.paged_attention(*args, k_scale=0.1, v_scale=7.0)
    assert torch.equal(plain, scaled)


# ---------------------------------------------------------------- config, checkpoint scales, engine


def test_kv_cache_dtype_setting():
    from pagedserve.common.config.engine_args import EngineArgs
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="int8").validate()
    EngineArgs(kv_cache_dtype="fp8_e4m3").validate()


def test_take_kv_scales_from_the_stream():
    from pagedserve.executor.model.quant.kv_scales import take_kv_scales
    stream = [("model.layers.0.self_attn.k_scale", torch.tensor(0.5)),
              ("model.layers.0.self_attn.qkv.weight", torch.ones(2)),
              ("model.layers.0.self_attn.v_scale", torch.tensor([0.25])),
              ("model.layers.1.self_attn.kv_scale", torch.tensor(2.0)),
              ("model.layers.2.self_attn.k_proj.output_scale", torch.tensor(3.0)),
              ("model.layers.2.self_attn.k_proj.input_scale", torch.tensor(9.0))]
    found: dict[int, dict[str, float]] = {}
    rest = [name for name, _ in take_kv_scales(iter(stream), found)]
    assert rest == ["model.layers.0.self_attn.qkv.weight", "model.layers.2.self_attn.k_proj.input_scale"]
    assert found == {0: {"k": 0.5, "v": 0.25}, 1: {"k": 2.0, "v": 2.0}, 2: {"k": 3.0}}
    with pytest.raises(ValueError, match="one number per layer"):
        list(take_kv_scales(iter([("model.layers.0.self_attn.k_scale", torch.ones(4))]), {}))
    with pytest.raises(ValueError, match="positive finite"):
        list(take_kv_scales(iter([("model.layers.0.self_attn.v_scale", torch.tensor(0.0))]), {}))


def _prompt_logprobs(llm, prompts) -> list[float]:
    from pagedserve import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [next(iter(e.values())).logprob for o in outs for e in o.prompt_logprobs[1:]]


PROMPTS = [[1 + (7 * i + 3 * j) % 500 for j in range(40 + 9 * i)] for i in range(4)]


def test_fp8_kv_cache_end_to_end(tiny_llama_dir):
    from pagedserve import LLM
    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory=0.01)
    with LLM(tiny_llama_dir, **kw) as llm:
        ref = _prompt_logprobs(llm, PROMPTS)
    with LLM(tiny_llama_dir, kv_cache_dtype="fp8", **kw) as llm:
        runner = llm.engine.executor.worker.runner
        assert runner.kv_caches[0].dtype == FP8_KV_DTYPE
        fp8_blocks = llm.engine.num_blocks
        got = _prompt_logprobs(llm, PROMPTS)
    with LLM(tiny_llama_dir, dtype="bfloat16", max_model_len=256, kv_cache_memory=0.01) as llm:
        bf16_blocks = llm.engine.num_blocks
    # 1 byte per element against 2 in the same memory (each count is floored: budget // bytes per block)
    assert 2 * bf16_blocks <= fp8_blocks <= 2 * bf16_blocks + 1
    _assert_close_logprobs(got, ref)


def _assert_close_logprobs(got: list[float], ref: list[float]) -> None:
    """The tiny random model is peaky (initializer_range 0.2): measured, running it in bfloat16 instead of
    float32 moves its per-token logprobs by 0.027 nats on average (max 0.28); an e4m3 KV cache, 16x coarser
    than bf16 but on K/V only, by 0.117 (max 0.82), while the mean logprob over all 210 tokens moves by
    0.0006. Bounds: the issue's 0.02 nats on the mean, 0.25 on the mean |difference|. A dropped scale or a
    lost clamp moves logprobs by nats."""
    diffs = [abs(a - b) for a, b in zip(got, ref)]
    assert abs(sum(got) / len(got) - sum(ref) / len(ref)) < 0.02
    assert sum(diffs) / len(diffs) < 0.25, (sum(diffs) / len(diffs), max(diffs))


def test_checkpoint_kv_scales_reach_the_layers(tiny_llama_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from pagedserve import LLM
    folder = tmp_path / "with_scales"
    shutil.copytree(tiny_llama_dir, folder)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.05)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.02)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.03)
    save_file(tensors, str(path), metadata={"format": "pt"})
    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory=0.01)
    with LLM(str(folder), kv_cache_dtype="fp8", **kw) as llm:
        layers = llm.engine.executor.worker.runner.model.attention_layers()
        assert [(a.k_scale, a.v_scale) for a in layers] == [pytest.approx((0.05, 0.02)),
                                                             pytest.approx((0.03, 0.03))]
        got = _prompt_logprobs(llm, PROMPTS)
    with LLM(str(folder), **kw) as llm:          # auto: the scales are read but change nothing
        ref = _prompt_logprobs(llm, PROMPTS)
    with LLM(tiny_llama_dir, **kw) as llm:
        assert _prompt_logprobs(llm, PROMPTS) == ref
    # Small scales put the codes higher in e4m3's range (|K| / 0.05 stays below 448 here): same precision.
    _assert_close_logprobs(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compute capability 8.9+)")
def test_fp8_kv_cache_on_gpu_graphs_equal_eager(tmp_path):
    """Triton write and attention on an e4m3 cache inside CUDA graphs and eagerly: the same greedy tokens and
    logprobs, and close to a bf16 cache. Not run here (no GPU for this task)."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    path = make_tiny_model(str(tmp_path / "llama"), arch="llama", tokenizer="synthetic", hidden_size=256,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs = {}
    for name, kw in {"auto": {}, "fp8": dict(kv_cache_dtype="fp8"),
                     "fp8_eager": dict(kv_cache_dtype="fp8", enforce_eager=True)}.items():
        with LLM(path, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3, **kw) as llm:
            if name == "fp8":
                assert llm.engine.executor.worker.runner.kv_caches[0].dtype == FP8_KV_DTYPE
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[name] = ([o.outputs[0].token_ids for o in outs], _prompt_logprobs(llm, PROMPTS))
    assert runs["fp8"][0] == runs["fp8_eager"][0]
    torch.testing.assert_close(runs["fp8"][1], runs["fp8_eager"][1], rtol=0, atol=1e-2)
    _assert_close_logprobs(runs["fp8"][1], runs["auto"][1])


@pytest.mark.slow
def test_fp8_kv_cache_on_the_embedded_model(smollm2_path):
    """The issue's text criterion on a real model: the mean per-token logprob of a fixed English text within
    0.02 nats of the default cache (measured: 0.0036 against a float32 cache; greedy chat tokens over 32 steps stayed equal on 5 of
    8 prompts, the near-ties that bfloat16 activations also flip, see test_quantized_model.py)."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.tests.helpers.prompts import LIGHTHOUSE_TEXT as TEXT

    def text_logprob(**kw) -> tuple[float, int]:
        with LLM(smollm2_path, max_model_len=512, kv_cache_memory=0.05, **kw) as llm:
            out = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            lps = [next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]]
            return sum(lps) / len(lps), llm.engine.num_blocks
    ref, ref_blocks = text_logprob()
    got, blocks = text_logprob(kv_cache_dtype="fp8")
    assert abs(got - ref) < 0.02, (got, ref)
    # the auto cache is bfloat16 here (int4/int8 weights on CPU): 2 bytes per element -> 1, counts floored
    assert 2 * ref_blocks <= blocks <= 2 * ref_blocks + 1
