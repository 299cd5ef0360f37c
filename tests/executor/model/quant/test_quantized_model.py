"""The embedded GGUF kept quantized (the default) against the same file dequantized at load.

Issue 14's bar: greedy tokens equal on at least 7 of 8 prompts over 32 tokens, and the mean per-token logprob
of a fixed English text within 0.02 nats. The quantized run uses the default dtype (what users get); the
reference is the dequantized model in float32 (float32 KV cache too; the quantized run's auto cache is
bfloat16, so the bar covers that as well). The prompts are chat turns, as the embedded instruct model is
used; raw-text continuations of it sit on near-ties that even bfloat16 activations flip (measured: the
dequantized model in bfloat16 kept 5 of 8 such prompts).
"""
from __future__ import annotations

import os

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.executor.model.quant.loading import num_weights, weight_bytes
from pagedserve.kernels.weights.weight_only import Int4Weight, Int8Weight
from pagedserve.tests.helpers.prompts import LIGHTHOUSE_TEXT as TEXT

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "How do I make a cup of tea?",
             "Name the three primary colors.", "Write a Python function that reverses a string.",
             "Why did the French Revolution begin?", "Give me one tip for learning a new language.",
             "What is photosynthesis?"]


def _greedy_and_text_logprob(llm: LLM) -> tuple[list[list[int]], float]:
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                    SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    scored = llm.generate([TEXT], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    logprobs = [next(iter(entry.values())).logprob for entry in scored.prompt_logprobs[1:]]
    return [o.outputs[0].token_ids for o in outs], sum(logprobs) / len(logprobs)


@pytest.fixture(scope="module")
def dequantized(smollm2_path):
    with LLM(smollm2_path, dtype="float32", quantization="none", max_model_len=512) as llm:
        return _greedy_and_text_logprob(llm)


@pytest.mark.slow
def test_kept_quantized_matches_the_dequantized_model(smollm2_path, dequantized):
    with LLM(smollm2_path, max_model_len=512) as llm:
        assert llm.engine.config.model.dtype == "float32"                  # auto, for int4/int8 weights
        runner = llm.engine.executor.worker.runner
        assert runner.kv_caches[0].dtype == torch.bfloat16                 # auto cache for int4/int8 on CPU
        model = runner.model
        layer = model.model.layers[0]
        assert isinstance(layer.mlp.gate_up_proj.packed, Int4Weight)       # Q4_1: int4 kernel
        assert isinstance(model.model.embed_tokens.packed, Int8Weight)     # Q8_0: int8 rows, tied head
        bits = 8 * weight_bytes(model) / num_weights(model)
        tokens, mean_logprob = _greedy_and_text_logprob(llm)
    ref_tokens, ref_logprob = dequantized
    same = sum(a == b for a, b in zip(tokens, ref_tokens))
    assert same >= 7, f"only {same} of 8 prompts gave the dequantized model's tokens"
    assert abs(mean_logprob - ref_logprob) < 0.02, (mean_logprob, ref_logprob)
    # The file itself holds 5 bits per Q4_1 weight and 8.5 per Q8_0 one (5.85 on average): we hold no more.
    file_bits = 8 * os.path.getsize(smollm2_path) / num_weights(model)
    assert bits <= file_bits, (bits, file_bits)


def test_dequantized_model_is_dense(smollm2_path):
    with LLM(smollm2_path, dtype="float32", quantization="none", max_model_len=256) as llm:
        model = llm.engine.executor.worker.runner.model
        assert model.model.layers[0].mlp.gate_up_proj.packed is None
        assert 8 * weight_bytes(model) / num_weights(model) == 32.0


def test_quantization_flag_is_checked_against_the_checkpoint(smollm2_path, tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization 'awq' needs a AWQ checkpoint"):
        LLM(smollm2_path, quantization="awq")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(tiny_llama_dir, quantization="int3")
