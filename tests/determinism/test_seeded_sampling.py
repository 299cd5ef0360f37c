"""Seeded sampling and beam search repeat token for token whatever runs beside them (issue 50), on the embedded
SmolLM2 (its Q4_1 GGUF, the default engine's C step):

- a request with a seed and temperature > 0 gets the same tokens and logprobs alone, in a batch of 16 others
  (greedy and sampled, seeded and not, prompts of 12-87 tokens in chunks of 64: prefill and decode mixed in
  steps), and after a prefix-cache hit;
- the siblings of an n > 1 request keep their seed-derived streams: sibling i equals the request with n=1 and
  seed + i (vLLM's rule, frontend/client/input_processor.py), and the whole n-set is the same alone and in a batch;
- LLM.beam_search gives the same beams for a prompt searched alone and beside three other prompts' beams.
"""
from __future__ import annotations

import msgspec
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common.params.beam_search_params import BeamSearchParams
from pagedserve.tests.helpers.kernels.cpu_kernels import c_step_runs
from pagedserve.tests.helpers.models.tiny_models import random_prompts

VOCAB = 49152
SEED = 1234
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=SEED, max_tokens=16, logprobs=5,
                        ignore_eos=True)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not c_step_runs(), reason="the C decode step does not build on this CPU")]

Answer = tuple[tuple[int, ...], tuple[tuple[tuple[int, float], ...], ...]]


def answer(completion) -> Answer:
    return (tuple(completion.token_ids),
            tuple(tuple(sorted((i, lp.logprob) for i, lp in step.items())) for step in completion.logprobs))


@pytest.fixture(scope="module")
def llm(smollm2_path):
    with LLM(smollm2_path, max_num_batched_tokens=64, max_model_len=1024) as engine:
        yield engine


def others() -> list[tuple[dict, SamplingParams]]:
    """16 requests of 12-87 prompt tokens: greedy, seeded at other seeds, unseeded; 4-12 new tokens."""
    prompts = random_prompts(5, [12 + 5 * i for i in range(16)], VOCAB)
    kinds = [SamplingParams(temperature=0.0, max_tokens=4 + i // 2, logprobs=2) if i % 3 == 0 else
             SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12 - i // 2) if i % 3 == 1 else
             SamplingParams(temperature=0.7, top_k=20, max_tokens=6 + i // 3) for i in range(16)]
    return [({"prompt_token_ids": p}, k) for p, k in zip(prompts, kinds)]


def in_batch(llm: LLM, targets: list[tuple[dict, SamplingParams]]) -> list[list]:
    """The targets sent among 16 others (at positions 3, 11, ...): each one's completions."""
    batch = others()
    for k, target in enumerate(targets):
        batch.insert(3 + 8 * k, target)
    outs = llm.generate([p for p, _ in batch], [k for _, k in batch], use_tqdm=False)
    return [outs[3 + 8 * k].outputs for k in range(len(targets))]


def test_seeded_request_alone_in_a_batch_and_after_a_hit(llm):
    first, second = ({"prompt_token_ids": p} for p in random_prompts(9, [70, 41], VOCAB))
    alone = answer(llm.generate(first, SEEDED, use_tqdm=False)[0].outputs[0])
    assert len(alone[0]) == SEEDED.max_tokens
    hit, fresh = in_batch(llm, [(first, SEEDED), (second, SEEDED)])   # first: a prefix hit; second: first seen
    assert answer(hit[0]) == alone, "in a batch, after a prefix hit"
    assert answer(llm.generate(first, SEEDED, use_tqdm=False)[0].outputs[0]) == alone, "alone, after a hit"
    assert answer(llm.generate(second, SEEDED, use_tqdm=False)[0].outputs[0]) == answer(fresh[0])
    other_seed = msgspec.structs.replace(SEEDED, seed=SEED + 1)   # the seed fixes the draw: another, another answer
    assert answer(llm.generate(first, other_seed, use_tqdm=False)[0].outputs[0])[0] != alone[0]


def test_n_siblings_keep_their_seeds(llm):
    prompt = {"prompt_token_ids": random_prompts(13, [64], VOCAB)[0]}
    params = SamplingParams(n=4, temperature=1.0, seed=77, max_tokens=10, logprobs=5, ignore_eos=True)
    alone = sorted((c.index, answer(c)) for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs)
    assert [i for i, _ in alone] == [0, 1, 2, 3]
    assert len({a[0] for _, a in alone}) > 1, "siblings of one seed still draw different streams"
    batched = sorted((c.index, answer(c)) for c in in_batch(llm, [(prompt, params)])[0])
    assert batched == alone, "the n-set in a batch differs from the n-set alone"
    for i, sibling in alone:
        single = SamplingParams(temperature=1.0, seed=77 + i, max_tokens=10, logprobs=5, ignore_eos=True)
        assert answer(llm.generate(prompt, single, use_tqdm=False)[0].outputs[0]) == sibling, f"sibling {i}"


def test_beam_search_alone_and_beside_other_beams(llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(17, [30, 60, 20, 45], VOCAB)]
    params = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)

    def beams(out) -> list[tuple[tuple[int, ...], float]]:
        return [(tuple(s.tokens), s.cum_logprob) for s in out.sequences]

    alone = beams(llm.beam_search([prompts[0]], params)[0])
    assert len(alone) == 2
    together = llm.beam_search([prompts[1], prompts[0], prompts[2], prompts[3]], params)
    assert beams(together[1]) == alone
