"""Greedy tokens equal HF transformers (fp32) through batching, chunking, preemption and prefix hits."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.tests.helpers.models.tiny_models import hf_greedy, random_prompts

LENGTHS = [10, 300, 25, 47, 180, 80, 120, 230, 15]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)

# name -> engine settings; each must give exactly the reference tokens.
CONFIGS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=64),
    "preempt": dict(num_gpu_blocks_override=40, max_model_len=512, max_num_batched_tokens=128),
    "no_prefix_cache": dict(enable_prefix_caching=False, max_num_seqs=3),
}


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    base = random_prompts(7, [150], vocab)[0]
    tails = random_prompts(8, [5, 17, 40, 1, 33, 64, 9, 21], vocab)
    return [base[: 60 + 10 * i] + tail for i, tail in enumerate(tails)]


def check(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> None:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert out.prompt_token_ids == prompts[i]
        assert out.outputs[0].token_ids == want, f"prompt {i} ({len(prompts[i])} tokens) diverged"
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_blocks


@pytest.fixture(scope="class")
def setup(request):
    """(model path, prompts, HF tokens, shared-prefix prompts, HF tokens) for the class's model."""
    path = request.getfixturevalue(request.cls.model_fixture)
    hf = request.getfixturevalue(request.cls.hf_fixture)
    vocab = hf.config.vocab_size
    prompts = random_prompts(1, LENGTHS, vocab)
    shared = shared_prefix_prompts(vocab)
    return path, prompts, hf_greedy(hf, prompts, NEW_TOKENS), shared, hf_greedy(hf, shared, NEW_TOKENS)


class ParitySuite:
    """Shared cases; subclasses bind a model path and its HF reference."""
    model_fixture = ""
    hf_fixture = ""
    engine_kwargs: dict = {}

    @pytest.mark.parametrize("name", list(CONFIGS))
    def test_batch_parity(self, setup, name):
        path, prompts, expected, _, _ = setup
        llm = LLM(path, dtype="float32", **self.engine_kwargs, **CONFIGS[name])
        check(llm, prompts, expected)
        if name == "preempt":
            assert llm.engine.scheduler.num_preemptions > 0
        if name == "chunked":
            assert llm.engine.config.scheduler.max_num_batched_tokens < max(LENGTHS)

    def test_prefix_cache_parity(self, setup):
        path, _, _, shared, expected = setup
        llm = LLM(path, dtype="float32", max_num_batched_tokens=256, **self.engine_kwargs)
        check(llm, shared[:1], expected[:1])          # warm the cache with the first prompt
        check(llm, shared, expected)
        stats = llm.engine.kv_cache_manager.prefix_stats
        assert stats.hits >= 7 * 48                    # every later prompt reused >= 3 blocks


class TestTinyLlama(ParitySuite):
    model_fixture = "tiny_llama_dir"
    hf_fixture = "hf_tiny_llama"


@pytest.mark.slow
class TestSmolLM2(ParitySuite):
    model_fixture = "smollm2_path"
    hf_fixture = "hf_smollm2"
    # HF dequantizes the GGUF at load; so must we, to compare token for token (test_quantized_model.py
    # checks the kept-quantized default against this dequantized model).
    engine_kwargs = {"quantization": "none"}
