"""Speculative decoding through the whole engine: the same greedy tokens (and logprobs) as without it on the
embedded quantized model, where its C decode step verifies the drafts, and on a tiny float model through the
PyTorch layers with chunked prefill, preemption and prefix hits; stops, max_tokens, n > 1, min_tokens and
seeds with drafts in flight."""
from __future__ import annotations

import math
import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.tests.helpers.kernels.cpu_kernels import c_step_runs
from pagedserve.tests.helpers.spec_costs import FixedStepCosts

PASSAGE = ("def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
           "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
           "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
           "    return out\n")
MESSAGES = [[{"role": "user", "content": "Rewrite this function, renaming `out` to `result`, and change nothing "
                                         "else:\n\n" + PASSAGE}],
            [{"role": "user", "content": "Repeat this list exactly: apples, pears, plums, apples, pears, figs, "
                                         "apples, pears, plums, cherries."}]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=120, logprobs=2),
    "max_tokens": SamplingParams(temperature=0.0, max_tokens=37),
    "stop": SamplingParams(temperature=0.0, max_tokens=120, stop=["result.extend"]),
    "min_tokens": SamplingParams(temperature=0.0, max_tokens=60, min_tokens=50),
    "n2_seeded": SamplingParams(temperature=0.7, max_tokens=60, n=2, seed=11),
}


def _run(llm: LLM) -> dict[str, list]:
    return {name: [list(c.outputs) for c in llm.chat(MESSAGES, params, use_tqdm=False)]
            for name, params in CASES.items()}


@pytest.fixture(scope="module")
def embedded_runs(smollm2_path):
    with LLM(smollm2_path, max_model_len=1024) as llm:
        off = _run(llm)
    with LLM(smollm2_path, max_model_len=1024, speculative_config=NGRAM) as llm:
        on = _run(llm)
        again = _run(llm)
        stats = llm.engine.scheduler.make_stats()
    return off, on, again, stats


@pytest.mark.slow
def test_greedy_tokens_and_logprobs_equal_without_drafts(embedded_runs):
    off, on, _, stats = embedded_runs
    assert stats.spec_num_accepted_tokens > 50                   # drafts were accepted, often
    for a, b in zip(off["greedy"], on["greedy"]):
        assert a[0].token_ids == b[0].token_ids
        assert a[0].text == b[0].text
        want = [{t: lp.logprob for t, lp in e.items()} for e in a[0].logprobs]
        got = [{t: lp.logprob for t, lp in e.items()} for e in b[0].logprobs]
        if c_step_runs():        # the C step gives a verified token the bits a one-token decode gives it
            assert got == want
        else:      # torch's bfloat16 int4 kernels sum a k + 1-row pass in another order than a one-row one (up
            # to 0.04 apart in probability on a 2-core AVX2 VM): near-tied alternatives may swap, so the chosen
            # token's probability and the ranked ones are compared
            for token, g, w in zip(a[0].token_ids, got, want):
                assert abs(math.exp(g[token]) - math.exp(w[token])) < 0.1
                assert all(abs(math.exp(x) - math.exp(y)) < 0.1
                           for x, y in zip(sorted(g.values()), sorted(w.values()))), (g, w)


@pytest.mark.slow
def test_stops_and_lengths_inside_a_draft(embedded_runs):
    off, on, _, _ = embedded_runs
    for name in ("max_tokens", "stop", "min_tokens"):
        for a, b in zip(off[name], on[name]):
            assert (a[0].token_ids, a[0].text, a[0].finish_reason) == (b[0].token_ids, b[0].text, b[0].finish_reason)
    assert len(on["max_tokens"][0][0].token_ids) == 37 and on["max_tokens"][0][0].finish_reason == "length"
    assert on["stop"][0][0].finish_reason == "stop" and "result.extend" not in on["stop"][0][0].text
    assert all(len(o[0].token_ids) >= 50 for o in on["min_tokens"])
    assert len(off["min_tokens"][1][0].token_ids) > len(off["greedy"][1][0].token_ids)    # it held off an EOS


@pytest.mark.slow
def test_seeded_samples_repeat_with_drafts(embedded_runs):
    """The draft lengths follow step timings, which differ run to run: a seeded request's tokens do not (they are
    the tokens it samples without drafts)."""
    off, on, again, _ = embedded_runs
    for a, b, c in zip(on["n2_seeded"], again["n2_seeded"], off["n2_seeded"]):
        assert len(a) == 2 and [o.token_ids for o in a] == [o.token_ids for o in b] == [o.token_ids for o in c]


def _repetitive_prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(4, 9))] * rng.randrange(3, 7)}
            for _ in range(n)]


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_batched_tokens=24),                              # prompts chunked, drafts beside them
    dict(num_gpu_blocks_override=40, max_num_seqs=8),             # preemption with drafts in flight
    dict(enable_prefix_caching=True),                             # shared prompts hit the cache
])
def test_tiny_model_same_greedy_tokens_with_drafts(tiny_llama_dir, engine_kw):
    prompts = _repetitive_prompts(6, seed=3)
    prompts += [dict(p) for p in prompts[:2]]                     # repeats: prefix hits
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    runs = {}
    for name, spec in (("off", None), ("on", {**NGRAM, "disable_by_batch_size": 8})):
        with LLM(tiny_llama_dir, dtype="float32", max_model_len=512, speculative_config=spec, **engine_kw) as llm:
            runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = llm.engine.scheduler.make_stats()
            if spec:
                assert stats.spec_num_drafts > 0
            if "num_gpu_blocks_override" in engine_kw:
                assert stats.num_preemptions > 0
    assert runs["on"] == runs["off"]


def test_the_step_cost_model_drafts_only_where_drafts_pay(tiny_llama_dir):
    """The engine times its own steps into the cost model, which then picks each step's drafts; told that verify
    rows cost seconds, it drafts nothing (nor probes). The greedy tokens are those of no drafts either way."""
    from pagedserve.core.spec_decode.cost_model import StepCostModel
    prompts = _repetitive_prompts(3, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=512) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=512, speculative_config=NGRAM) as llm:
        spec = llm.engine.scheduler.spec
        timed = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert spec.num_drafts > 0 and spec.cost.num_row_counts > 2      # prompts, one-token steps, verify passes
        spec.cost = StepCostModel()
        for rows in range(2, NGRAM["num_speculative_tokens"] + 2):
            spec.cost.observe(rows, 10.0)
        drafts = spec.num_drafts
        costly = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert spec.num_drafts == drafts and spec.cost.cost(1) < 1.0      # its own one-token steps were timed
    assert timed == want and costly == want


def test_a_rejected_draft_is_never_served_from_the_prefix_cache(tiny_llama_dir):
    """After steps that rejected drafts, a prompt that runs over those positions hits the cache: its greedy
    continuation equals the one computed with no cache at all."""
    prompt = _repetitive_prompts(1, seed=5)[0]["prompt_token_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=512, speculative_config=NGRAM, block_size=4) as llm:
        first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        stats = llm.engine.scheduler.make_stats()
        assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens          # some were rejected
        longer = {"prompt_token_ids": prompt + first}
        hit = llm.generate([longer], params, use_tqdm=False)[0]
        assert hit.num_cached_tokens > len(prompt)
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=512, enable_prefix_caching=False) as llm:
        fresh = llm.generate([longer], params, use_tqdm=False)[0]
    assert hit.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_tensor_parallel_and_async_scheduling_keep_the_greedy_tokens(tiny_llama_dir):
    """TP = 2 (a worker process per rank, gloo) verifies the same drafts on both ranks, ngram's and an unsharded
    draft model's (each rank runs its own copy); async scheduling waits for each step's output while drafts run.
    All give what one rank without drafts gives."""
    prompts = _repetitive_prompts(3, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    runs = {}
    for name, kw in (("plain", {}), ("tp2", dict(tensor_parallel_size=2, speculative_config=NGRAM)),
                     ("async", dict(async_scheduling=True, speculative_config=NGRAM)),
                     ("tp2_draft", dict(tensor_parallel_size=2, speculative_config={
                         "method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3,
                         "draft_tensor_parallel_size": 1}))):     # sharded: tests/executor/worker/spec_decode/test_draft_tp.py
        with LLM(tiny_llama_dir, dtype="float32", max_model_len=512, **kw) as llm:
            runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs["tp2"] == runs["plain"] and runs["async"] == runs["plain"] and runs["tp2_draft"] == runs["plain"]


# ---------------------------------------------------------------- method draft_model


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory) -> str:
    """A one-layer random Llama with the tiny model's vocabulary: it guesses badly, so most drafts are rejected."""
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_draft")), arch="llama", seed=1, num_hidden_layers=1)


@pytest.mark.parametrize("engine_kw", [dict(max_num_batched_tokens=24), dict(num_gpu_blocks_override=40, max_num_seqs=8)])
def test_draft_model_keeps_the_greedy_tokens(tiny_llama_dir, tiny_draft_dir, engine_kw):
    """The model drafting for itself (every draft accepted: the lookahead slots and the draft's own cache through
    chunked prefill and preemption) and a poor draft (most rejected): both give the tokens of no drafts."""
    prompts = _repetitive_prompts(6, seed=3)
    prompts += [dict(p) for p in prompts[:2]]                     # repeats: prefix hits for both caches
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    runs, stats = {}, {}
    for name, draft in (("off", None), ("self", tiny_llama_dir), ("poor", tiny_draft_dir)):
        spec = None if draft is None else {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                                           "disable_by_batch_size": 8}
        with LLM(tiny_llama_dir, dtype="float32", max_model_len=512, speculative_config=spec, **engine_kw) as llm:
            runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            stats[name] = llm.engine.scheduler.make_stats()
    assert runs["self"] == runs["off"] and runs["poor"] == runs["off"]
    assert stats["self"].spec_num_accepted_tokens == stats["self"].spec_num_draft_tokens > 0
    assert stats["poor"].spec_num_accepted_tokens < stats["poor"].spec_num_draft_tokens
    if "num_gpu_blocks_override" in engine_kw:
        assert stats["self"].num_preemptions > 0


def test_draft_model_sampled_runs_repeat_with_a_seed(tiny_llama_dir, tiny_draft_dir):
    prompts = _repetitive_prompts(3, seed=4)
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=40, seed=5, ignore_eos=True)
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 4}
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=512, speculative_config=spec) as llm:
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.scheduler.make_stats().spec_num_accepted_tokens > 0
    assert first == again and all(len(t) == 40 for t in first)


def test_draft_model_shares_the_cache_memory_and_bad_drafts_are_refused(tiny_llama_dir, tiny_draft_dir, tmp_path):
    from pagedserve.common.config.engine_args import EngineArgs
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=0.01) as llm:
        alone = llm.engine.num_blocks
    spec = {"method": "draft_model", "model": tiny_draft_dir, "num_speculative_tokens": 2}
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=0.01, speculative_config=spec) as llm:
        # the draft's one layer beside the model's two: a block costs 3/2 of what it did
        assert llm.engine.num_blocks == alone * 2 // 3
    other_vocab = make_tiny_model(str(tmp_path / "v"), arch="llama", vocab_size=1024)
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's vocabulary"):
        EngineArgs(model=tiny_llama_dir, speculative_config={**spec, "model": other_vocab}).create_engine_config()
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        EngineArgs(model=tiny_llama_dir, speculative_config={"method": "draft_model",
                                                             "num_speculative_tokens": 2}).create_engine_config()


@pytest.mark.slow
def test_drafts_under_a_grammar_are_checked_and_masked_per_position(smollm2_path):
    """A JSON schema and a regex with ngram drafts: every draft the grammar forbids is cut before the pass, each
    verified position gets its own mask row, and the output is the greedy output without drafts."""
    import json as _json
    from pagedserve import StructuredOutputsParams
    schema = {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}}},
              "required": ["fruits"]}
    messages = [[{"role": "user", "content": "Return JSON with the key fruits listing: apples, pears, plums, "
                                             "apples, pears, figs, apples, pears, plums."}],
                [{"role": "user", "content": "Say apples, pears, apples, pears, apples, pears."}]]
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=r"(apples, pears, ){2,5}apples"))]
    runs = {}
    for name, spec in (("off", None), ("on", NGRAM)):
        with LLM(smollm2_path, max_model_len=1024, speculative_config=spec) as llm:
            runs[name] = [o.outputs[0] for o in llm.chat(messages, params, use_tqdm=False)]
            stats = llm.engine.scheduler.make_stats()
    assert [o.token_ids for o in runs["on"]] == [o.token_ids for o in runs["off"]]
    assert stats.spec_num_accepted_tokens > 5
    assert _json.dumps(runs["on"][0].text).startswith('"{') and '"fruits"' in runs["on"][0].text
    assert runs["on"][1].text.startswith("apples, pears, apples") and runs["on"][1].text.endswith("apples")


def _stepped_run(core, prompt: list[int], max_tokens: int) -> tuple[list[int], dict[int, list[int]]]:
    """Steps one greedy request through the core: its tokens, and the draft's proposals after each step keyed by
    the request's length then."""
    from pagedserve.ipc.messages import EngineCoreRequest
    core.add_request(EngineCoreRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                   ignore_eos=True), arrival_time=0.0))
    tokens, proposals = [], {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += out.new_token_ids
        request = core.scheduler.requests.get("r")
        if request is not None and request.spec_token_ids:
            proposals[request.num_tokens] = list(request.spec_token_ids)
    return tokens, proposals


@pytest.mark.slow
@pytest.mark.skipif(not c_step_runs(), reason="the C step needs the AVX-512 build of the CPU kernels")
def test_a_quantized_draft_runs_in_its_own_c_step(smollm2_path):
    """The embedded Q4 GGUF drafting for itself: its one-token passes and the step's catch-up pass take its own C
    decode step; its proposals are the ones its PyTorch layers make, and the greedy output is the output
    without drafts."""
    from pagedserve.common.config.engine_args import EngineArgs
    from pagedserve.core.engine_core import EngineCore
    from pagedserve.executor.procs.uniproc_executor import UniProcExecutor
    prompt = _repetitive_prompts(1, seed=2)[0]["prompt_token_ids"]
    kw = dict(model=smollm2_path, max_model_len=512, enable_prefix_caching=False)
    plain = EngineCore.from_engine_args(EngineArgs(**kw), UniProcExecutor)
    want, _ = _stepped_run(plain, prompt, 40)
    plain.shutdown()
    core = EngineCore.from_engine_args(EngineArgs(**kw, speculative_config={
        "method": "draft_model", "model": smollm2_path, "num_speculative_tokens": 3}), UniProcExecutor)
    core.scheduler.spec.cost = FixedStepCosts()      # the same drafts in both runs, however fast each step ran
    drafter = core.executor.worker.runner.drafter
    c_step, taken = drafter.decode_step, []
    assert c_step is not None

    def spy(input_ids, positions, meta):
        hidden = c_step(input_ids, positions, meta)
        taken.append(len(input_ids) if hidden is not None else 0)
        return hidden
    drafter.decode_step = spy
    with_c, proposals_c = _stepped_run(core, prompt, 40)
    drafter.decode_step = None                                    # the draft's PyTorch layers for every pass
    with_layers, proposals_layers = _stepped_run(core, prompt, 40)
    stats = core.scheduler.make_stats()
    core.shutdown()
    assert with_c == with_layers == want
    assert stats.spec_num_accepted_tokens > 20
    assert 1 in taken and max(taken) > 1                          # one-token passes, and catch-up passes of a few
    common = proposals_c.keys() & proposals_layers.keys()
    assert len(common) >= 5 and all(proposals_c[n] == proposals_layers[n] for n in common)
