"""speculative_config.draft_tensor_parallel_size, vLLM's rule: a draft model sharded over the model's tensor-parallel
ranks (its linears all-reduce through the model's group, its KV cache sized by its sharded heads) keeps the greedy
output and its drafts; 1 runs it whole on each rank (tests/executor/worker/spec_decode/test_spec_decode.py); anything else, or a draft
whose heads do not split over the ranks, is refused naming the field."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.tests.helpers.spec_costs import FixedStepCosts

PROMPTS = [{"prompt_token_ids": [21, 22, 23, 24, 25, 26] * 4}, {"prompt_token_ids": [300, 301, 302] * 6}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
KV_GIB = 0.01


def test_a_sharded_draft_keeps_the_greedy_tokens_and_its_drafts(tiny_llama_dir):
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV_GIB) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        plain_blocks = llm.engine.num_blocks
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3,
            "draft_tensor_parallel_size": 2}
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=KV_GIB, tensor_parallel_size=2,
             speculative_config=spec) as llm:
        llm.engine.scheduler.spec.cost = FixedStepCosts()     # drafts verified however fast this machine steps
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        stats = llm.engine.scheduler.make_stats()
        # each rank holds half the model's KV heads and half the draft's: a block costs what it does on one
        # rank without a draft (an unsharded draft would take 2/3 of the blocks)
        assert llm.engine.num_blocks == plain_blocks
    assert got == want
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 10      # the model drafting for itself


@pytest.mark.parametrize("tp,draft_tp", [(1, 2), (2, 3), (2, 0)])
def test_a_draft_tp_other_than_1_or_the_models_is_refused(tp, draft_tp):
    spec = {"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": draft_tp}
    with pytest.raises(ValueError, match=r"speculative_config\.draft_tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=tp, speculative_config=spec).validate()


def test_a_draft_whose_heads_do_not_split_is_refused(tiny_llama_dir, tmp_path):
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    one_head = make_tiny_model(str(tmp_path / "one_head"), arch="llama", num_attention_heads=1, num_key_value_heads=1)
    spec = {"method": "draft_model", "model": one_head, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config\.draft_tensor_parallel_size: the draft cannot shard"):
        EngineArgs(model=tiny_llama_dir, tensor_parallel_size=2, speculative_config=spec).create_engine_config()
    whole = EngineArgs(model=tiny_llama_dir, tensor_parallel_size=2,
                       speculative_config={**spec, "draft_tensor_parallel_size": 1}).create_engine_config()
    assert whole.speculative.draft_tensor_parallel_size == 1 and whole.draft_model is not None
