"""The GPU path: Triton kernels at real sizes, engine parity with HF in fp32, CUDA graphs vs eager.

Skipped without CUDA; run on a GPU machine with `pytest -m gpu`.
"""
from __future__ import annotations


import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def tiny_gpu_dirs(tmp_path_factory):
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    root = tmp_path_factory.mktemp("gpu_models")
    # head_dim 64 and 128 (the kernels' real sizes), GQA 2 and 4, Qwen3's q/k norm.
    return {
        "llama": make_tiny_model(str(root / "llama"), arch="llama", tokenizer="synthetic", hidden_size=256,
                                 num_attention_heads=4, num_key_value_heads=2, intermediate_size=512),
        "qwen3": make_tiny_model(str(root / "qwen3"), arch="qwen3", tokenizer="synthetic", hidden_size=256,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=128, intermediate_size=512),
    }


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(5, 90))] for _ in range(n)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (32, 8, 128), (12, 4, 64)])
def test_paged_attention_real_sizes(dtype, tol, hq, hkv, d):
    from pagedserve.tests.helpers.kernels.kernel_checks import rel_err, run_both
    decodes = [(n, 1) for n in (1, 700, 2048, 4000, 33, 517)]
    prefills = [(1024, 1024), (1500, 300), (80, 7)]
    out, ref = run_both(decodes + prefills, 16, hq, hkv, d, seed=hq + d, dtype=dtype)
    assert rel_err(out, ref) < tol
    out, ref = run_both(decodes, 16, hq, hkv, d, seed=1, dtype=dtype, num_splits=8)
    assert rel_err(out, ref) < tol


def _greedy(model_dir: str, prompts, max_tokens: int, **kwargs) -> list[list[int]]:
    from pagedserve import LLM, SamplingParams
    llm = LLM(model_dir, device="cuda", max_model_len=512, num_gpu_blocks_override=512, **kwargs)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@torch.inference_mode()
def _hf_greedy_cuda(model_dir: str, prompts, max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    outs = []
    for ids in prompts:
        seq = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                             pad_token_id=0, eos_token_id=None)
        outs.append(seq[0, len(ids):].tolist())
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_matches_hf_fp32_on_gpu(tiny_gpu_dirs, arch):
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = _prompts(12, 512, seed=1)
    want = _hf_greedy_cuda(tiny_gpu_dirs[arch], prompts, 24)
    # Chunked prefill (small token budget) so steps mix prefill chunks with decodes.
    got = _greedy(tiny_gpu_dirs[arch], prompts, 24, dtype="float32", max_num_batched_tokens=64)
    assert got == want


def test_cuda_graphs_match_eager(tiny_gpu_dirs):
    prompts = _prompts(40, 512, seed=2)      # 40 decodes pad to a captured size of 40; 5 pad to 8 ...
    eager = _greedy(tiny_gpu_dirs["llama"], prompts, 32, dtype="float32", enforce_eager=True)
    graphs = _greedy(tiny_gpu_dirs["llama"], prompts, 32, dtype="float32")
    assert graphs == eager
    # A partially full graph (5 decodes replay the 8-row graph, with 3 padding rows).
    assert _greedy(tiny_gpu_dirs["llama"], prompts[:5], 32, dtype="float32") == eager[:5]


def test_kv_cache_sized_by_profiling(tiny_gpu_dirs):
    from pagedserve import LLM
    llm = LLM(tiny_gpu_dirs["llama"], device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5,
              max_model_len=512)
    try:
        free, total = torch.cuda.mem_get_info()
        blocks = llm.engine.num_blocks
        cache_bytes = sum(c.numel() * c.element_size() for c in llm.engine.executor.worker.runner.kv_caches)
        # The cache takes most of half the GPU, and the process stays under that half.
        assert cache_bytes > 0.3 * total and blocks * 16 > 100_000
        assert total - free < 0.5 * total + (256 << 20)
    finally:
        llm.shutdown()
