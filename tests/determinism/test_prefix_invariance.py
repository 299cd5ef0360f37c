"""A prefix-cache hit, the chunked-prefill split and the prompts beside a request never change its greedy answer
(issue 50): token ids and top-5 logprobs bit for bit, on the embedded SmolLM2 (its Q4_1 GGUF, the default
engine) and on a tiny random Llama quantized at load (-q int8), both on the CPU's C step, by default; and on the
tiny Llama in float32 (the PyTorch layers) under VLLM_BATCH_INVARIANT=1 (docs/determinism.md).

Per chunk size (--max-num-batched-tokens 32, 256, 2048: one engine each) a prompt is sent alone (fresh), then
in a batch of three other prompts that have not been seen (their first sends, a prefix hit for it), then alone
again (the first two: hits); every send of every prompt must equal the fresh alone one of the 2048-token engine."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.tests.helpers.kernels.cpu_kernels import c_step_runs
from pagedserve.tests.helpers.models.tiny_models import random_prompts

CHUNKS = (32, 256, 2048)
LENGTHS = [61, 40, 52, 64]          # full blocks of 16 and a tail each: a hit leaves a few tokens to prefill
NEW_TOKENS = 20
SAMPLING = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=5, ignore_eos=True)

pytestmark = pytest.mark.skipif(not c_step_runs(), reason="the C decode step does not build on this CPU")

Answer = tuple[tuple[int, ...], tuple[tuple[tuple[int, float], ...], ...]]


def answers(llm: LLM, prompts: list[list[int]]) -> list[Answer]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SAMPLING, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids),
             tuple(tuple(sorted((i, lp.logprob) for i, lp in step.items())) for step in o.outputs[0].logprobs))
            for o in outs]


def sends(model: str, vocab: int, **engine: object) -> dict[tuple[int, str, int], Answer]:
    """(chunk, how, prompt index) -> the answer; how: alone-fresh, batch (fresh for 1-3, a hit for 0), alone-hit."""
    prompts = random_prompts(7, LENGTHS, vocab)
    got: dict[tuple[int, str, int], Answer] = {}
    for chunk in CHUNKS:
        with LLM(model, max_num_batched_tokens=chunk, max_model_len=512, **engine) as llm:
            got[chunk, "alone-fresh", 0] = answers(llm, prompts[:1])[0]
            for i, a in enumerate(answers(llm, [prompts[1], prompts[0], prompts[2], prompts[3]])):
                got[chunk, "batch", (1, 0, 2, 3)[i]] = a
            for i in range(2):          # a hit of the first prompt's, and of one first seen in the batch
                got[chunk, "alone-hit", i] = answers(llm, prompts[i:i + 1])[0]
            assert llm.engine.kv_cache_manager.prefix_stats.hits >= 4 * 32
    return got


def check_invariant(got: dict[tuple[int, str, int], Answer]) -> None:
    for i in range(len(LENGTHS)):
        ref_key = (2048, "alone-fresh" if i == 0 else "batch", i)
        ref = got[ref_key]
        assert len(ref[0]) == NEW_TOKENS
        for key, answer in got.items():
            if key[2] != i:
                continue
            assert answer[0] == ref[0], f"prompt {i}: token ids of {key} differ from {ref_key}"
            assert answer[1] == ref[1], f"prompt {i}: top-5 logprobs of {key} differ from {ref_key}"


@pytest.mark.slow
def test_embedded_model_invariant(smollm2_path):
    check_invariant(sends(smollm2_path, 49152))


def test_tiny_model_invariant(tiny_llama_dir):
    check_invariant(sends(tiny_llama_dir, 512, dtype="float32", quantization="int8"))


def test_float_model_invariant_when_asked(tiny_llama_dir, monkeypatch):
    """A float model runs the PyTorch layers, whose matmuls are row-invariant only under VLLM_BATCH_INVARIANT=1
    (fixed row blocks, every token's attention alone)."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    check_invariant(sends(tiny_llama_dir, 512, dtype="float32"))
