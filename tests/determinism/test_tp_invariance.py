"""At TP = 2 over gloo with --batch-invariant, a prompt's greedy ids and top-5 logprobs are the same bits alone at
chunk 2048 as all at once at chunk 32 (issue 50). Why two ranks hold (docs/determinism.md): each element of a
row-parallel all-reduce is one addition of two partial sums, the same in either order however gloo chunks the
buffer; the ranks' own linears (fixed 16-row blocks) and attention (every token alone) are row-invariant."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.tests.helpers.kernels.cpu_kernels import c_step_runs
from pagedserve.tests.helpers.models.tiny_models import random_prompts

SAMPLING = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)

pytestmark = pytest.mark.skipif(not c_step_runs(), reason="the per-token attention is the C decode kernel")


def _answers(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SAMPLING, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids),
             tuple(tuple(sorted((i, lp.logprob) for i, lp in step.items())) for step in o.outputs[0].logprobs))
            for o in outs]


def test_two_ranks_batch_invariant(tiny_llama_dir):
    prompts = random_prompts(23, [150, 61, 97, 40], 512)
    engine = dict(dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp", batch_invariant=True,
                  enable_prefix_caching=False, max_model_len=256)
    with LLM(tiny_llama_dir, max_num_batched_tokens=2048, **engine) as llm:
        alone = [_answers(llm, [p])[0] for p in prompts]
    with LLM(tiny_llama_dir, max_num_batched_tokens=32, **engine) as llm:
        together = _answers(llm, prompts)
    assert together == alone
