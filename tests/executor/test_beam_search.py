"""LLM.beam_search against HF transformers' beam search (generate with num_beams, do_sample=False): the same best
beam and, where both find the same beams, the same order and scores; beams share prefix blocks, and every block
returns to the pool."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, BeamSearchParams
from pagedserve.common.errors import RequestError
from pagedserve.frontend.beam_search.search import BeamSearchOutput, beam_search_score
from pagedserve.tests.helpers.models.tiny_models import random_prompts

# (beam width, max tokens, length_penalty, early_stopping)
TINY_CASES = [(2, 8, 1.0, False), (4, 16, 1.0, False), (4, 16, 0.5, True), (3, 10, 2.0, "never")]


def hf_beams(hf: torch.nn.Module, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
             early_stopping: bool | str, eos: list[int]) -> tuple[list[list[int]], list[float]]:
    """HF's width returned beams (generated tokens, through the EOS that ended one) and their scores."""
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          num_beams=width, do_sample=False, num_return_sequences=width, max_new_tokens=max_tokens,
                          length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                          pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True)
    beams = []
    for seq in out.sequences.tolist():
        gen = seq[len(prompt):]
        ends = [i for i, t in enumerate(gen) if t in eos]
        beams.append(gen[:ends[0] + 1] if ends else gen)
    return beams, out.sequences_scores.tolist()


def check_against_hf(llm: LLM, hf: torch.nn.Module, prompts: list[list[int]], case: tuple) -> list[BeamSearchOutput]:
    width, max_tokens, penalty, early = case
    eos = llm.info.eos_token_ids
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty, early_stopping=early)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        want, want_scores = hf_beams(hf, prompt, width, max_tokens, penalty, early, eos)
        seqs = output.sequences
        got = [s.output_token_ids for s in seqs]
        assert got[0] == want[0], f"best beam differs from HF's for {case}"
        assert len(got) == width
        scores = [s.score for s in seqs]
        assert scores == sorted(scores, reverse=True)
        for s in seqs:
            assert s.tokens[:len(prompt)] == prompt and len(s.logprobs) == len(s.output_token_ids)
            assert s.score == pytest.approx(beam_search_score(s.cum_logprob, len(s.output_token_ids), penalty))
            assert s.finish_reason == ("stop" if s.output_token_ids[-1] in eos else "length")
            assert s.text == llm.tokenizer.decode(s.tokens)
        if sorted(got) == sorted(want):
            assert got == want
            assert scores == pytest.approx(want_scores, abs=1e-3)
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_blocks
    return outputs


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_path):
    # Dequantized at load: the same float32 weights as HF's GGUF load, so scores agree to float rounding.
    with LLM(smollm2_path, dtype="float32", quantization="none") as llm:
        yield llm


def chat_prompt(llm: LLM) -> list[int]:
    """A question whose beams end with EOS within a few tokens."""
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2? Answer with one number."}], tokenize=False,
        add_generation_prompt=True))


@pytest.mark.slow
def test_smollm2_best_beam_equals_hf(smollm2_llm, hf_smollm2):
    check_against_hf(smollm2_llm, hf_smollm2, [smollm2_llm.tokenizer.encode("The capital of France is")],
                     (2, 16, 1.0, False))


@pytest.mark.slow
def test_smollm2_eos_beams_equal_hf(smollm2_llm, hf_smollm2):
    out = check_against_hf(smollm2_llm, hf_smollm2, [chat_prompt(smollm2_llm)], (4, 8, 0.5, True))
    best = out[0].sequences[0]
    assert best.finish_reason == "stop" and best.stop_reason in smollm2_llm.info.eos_token_ids


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=128) as llm:
        yield llm


@pytest.mark.parametrize("case", TINY_CASES, ids=lambda c: "-".join(map(str, c)))
def test_tiny_model_equals_hf_and_shares_prefix_blocks(tiny_llm, hf_tiny_llama, case):
    prompts = random_prompts(3, [40, 23], hf_tiny_llama.config.vocab_size)
    stats = tiny_llm.engine.kv_cache_manager.prefix_stats
    queries, hits = stats.queries, stats.hits
    check_against_hf(tiny_llm, hf_tiny_llama, prompts, case)
    # Each step re-submits every beam whole: all but its partial last block must come from the cache.
    assert stats.hits - hits >= 0.6 * (stats.queries - queries)


def test_ignore_eos_and_max_model_len(tiny_llm):
    prompt = random_prompts(4, [120], 512)[0]
    out = tiny_llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=50, ignore_eos=True))[0]
    assert [len(s.output_token_ids) for s in out.sequences] == [8, 8]      # capped at max_model_len (128)
    assert tiny_llm.engine.kv_cache_manager.num_free_blocks == tiny_llm.engine.num_blocks


@pytest.mark.parametrize("fields,field", [(dict(beam_width=0), "beam_width"), (dict(beam_width=20), "beam_width"),
                                          (dict(max_tokens=0), "max_tokens"), (dict(early_stopping="x"),
                                                                               "early_stopping")])
def test_bad_params_name_the_field(tiny_llm, fields, field):
    params = BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})
    with pytest.raises(RequestError) as err:
        tiny_llm.beam_search(["w5 w6"], params)
    assert err.value.field == field


def test_concurrency_limit_gives_the_same_beams(tiny_llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(5, [17, 30, 9], 512)]
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    together = tiny_llm.beam_search(prompts, params)
    one_by_one = tiny_llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in one_by_one]


def test_without_prefix_caching_the_beams_are_the_same(tiny_llm, tiny_llama_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, [35], 512)]
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=128, enable_prefix_caching=False) as plain:
        got = plain.beam_search(prompts, params)
        assert plain.engine.kv_cache_manager.prefix_stats.hits == 0
        assert plain.engine.kv_cache_manager.num_free_blocks == plain.engine.num_blocks
    want = tiny_llm.beam_search(prompts, params)
    assert [s.tokens for s in got[0].sequences] == [s.tokens for s in want[0].sequences]
    assert [s.score for s in got[0].sequences] == pytest.approx([s.score for s in want[0].sequences], abs=1e-5)
