"""Pipeline parallelism on CPU: the layers split over stages (worker processes, gloo), activations sent from
stage to stage, the engine core keeping one batch per stage in flight.

Greedy parity with HF transformers at PP = 2 and TP = 2 x PP = 2 (and an uneven split, a tied embedding, a
mixture-of-experts model); chunked prefill, preemption and aborts with batches in flight; a killed stage;
sizes that cannot work refused with the numbers."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.core.engine_core import EngineCore
from pagedserve.executor.procs.multiproc_executor import MultiProcExecutor
from pagedserve.frontend.client.core_client import EngineDeadError
from pagedserve.ipc.messages import EngineCoreRequest
from pagedserve.tests.helpers.models.tiny_models import hf_greedy, make_tiny_model, random_prompts

PROMPTS = random_prompts(31, [9, 40, 17, 70, 5, 33], 512)
MAX_NEW = 16


def _model(tmp_path_factory, name: str, arch: str = "llama", **kw) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp(name)), arch=arch, tokenizer="synthetic", **kw)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> str:
    return _model(tmp_path_factory, "pp_llama", num_hidden_layers=4)


def hf_tokens(path: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_greedy(model, PROMPTS, MAX_NEW)


def engine_tokens(path: str, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(path, dtype="float32", max_num_batched_tokens=32, **kw) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2), (1, 3)], ids=["pp2", "tp2xpp2", "pp3-uneven"])
def test_greedy_parity_with_hf(four_layers, tp, pp):
    assert engine_tokens(four_layers, tensor_parallel_size=tp, pipeline_parallel_size=pp) == hf_tokens(four_layers)


@pytest.mark.parametrize("arch,kw", [("llama", dict(tie_word_embeddings=True)),
                                     ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                        moe_intermediate_size=64, decoder_sparse_step=1))],
                         ids=["tied-embedding", "moe"])
def test_tied_embedding_and_experts_split(tmp_path_factory, arch, kw):
    """A tied embedding is the last stage's LM head too; experts load on the stage of their layer."""
    path = _model(tmp_path_factory, f"pp_{arch}", arch=arch, num_hidden_layers=4, **kw)
    assert engine_tokens(path, pipeline_parallel_size=2) == hf_tokens(path)


def _core(path: str, **kw) -> EngineCore:
    args = EngineArgs(model=path, dtype="float32", device="cpu", block_size=4, max_model_len=128,
                      max_num_batched_tokens=24, generation_config="vllm", **kw)
    return EngineCore.from_engine_args(args, MultiProcExecutor)


def _run(core: EngineCore, abort_after: dict[str, int] | None = None) -> tuple[dict[str, list[int]], int]:
    """Step until done; abort_after: request id -> abort once it has this many tokens (its batch in flight)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, arrival_time=float(i)))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    in_flight_seen = 0
    start = core.executor.execute_model_async

    def started(sched):          # a batch starts while this many are in flight
        nonlocal in_flight_seen
        in_flight_seen = max(in_flight_seen, len(core._batch_queue) + 1)
        return start(sched)
    core.executor.execute_model_async = started
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for out in core.step().outputs:
            got[out.request_id] += out.new_token_ids
        for rid, n in list((abort_after or {}).items()):
            if len(got[rid]) >= n:
                core.abort_requests([rid])
                del abort_after[rid]
    assert not core.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    return got, in_flight_seen


def test_chunked_prefill_preemption_and_aborts_with_batches_in_flight(four_layers):
    ref = _core(four_layers)
    want, _ = _run(ref)
    ref.executor.shutdown()
    core = _core(four_layers, pipeline_parallel_size=2, num_gpu_blocks_override=48)
    try:
        got, in_flight = _run(core, abort_after={"r1": 3, "r4": 10})
        assert core.scheduler.num_preemptions > 0
        assert in_flight == 2                          # the stages had a batch each
    finally:
        core.executor.shutdown()
    for rid, tokens in got.items():
        if rid in ("r1", "r4"):                        # aborted: a prefix of what it would have said
            assert tokens == want[rid][:len(tokens)] and len(tokens) < len(want[rid])
        else:
            assert tokens == want[rid], rid


def test_killed_stage_fails_requests_fast(four_layers):
    llm = LLM(four_layers, dtype="float32", pipeline_parallel_size=2, multiprocess_core=True)
    params = SamplingParams(temperature=0.0, max_tokens=800, ignore_eos=True)
    core_pid = llm.client.proc.proc.pid
    workers = [p for p in psutil.Process(core_pid).children() if p.name().startswith("ps-worker")]
    assert len(workers) == 2
    threading.Timer(2.0, lambda: os.kill(workers[1].pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises((EngineDeadError, ValueError), match="worker rank 1 died"):
        llm.generate(random_prompts(5, [30] * 4, 512), params, use_tqdm=False)
    assert time.monotonic() - start < 2.0 + 5.0
    llm.shutdown()


@pytest.mark.parametrize("kw,match", [
    (dict(pipeline_parallel_size=5), "pipeline_parallel_size=5 exceeds the model's 4 layers"),
    (dict(pipeline_parallel_size=2, distributed_executor_backend="uni"), "distributed_executor_backend 'mp'"),
    (dict(pipeline_parallel_size=2, async_scheduling=True), "async_scheduling"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size"),
])
def test_sizes_that_cannot_work_are_refused(four_layers, kw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=four_layers, **kw).create_engine_config()


def test_family_without_stages_is_refused(tmp_path_factory):
    phi = _model(tmp_path_factory, "pp_phi3", arch="phi3", num_hidden_layers=2, pad_token_id=0)
    with pytest.raises(ValueError, match="Phi3ForCausalLM runs in one stage only"):
        EngineArgs(model=phi, pipeline_parallel_size=2).create_engine_config()


def test_sampling_features_match_one_stage(four_layers):
    """Seeded sampling, penalties, n > 1, logprobs and prompt logprobs need what only the last stage has:
    PP = 2 gives what one stage gives."""
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=12, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3, prompt_logprobs=1,
                             ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8, ignore_eos=True)]
    prompts = PROMPTS[:3]

    def run(**kw) -> tuple[list, list]:
        with LLM(four_layers, dtype="float32", max_num_batched_tokens=32, **kw) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [[c.token_ids for c in o.outputs] for o in outs]
        # (token id, logprob) of every reported entry, sampled positions then prompt positions
        lps = [[(t, lp.logprob) for step in (o.outputs[0].logprobs or []) + [p for p in o.prompt_logprobs or [] if p]
                for t, lp in step.items()] for o in outs]
        return tokens, lps
    (tokens, lps), (want_tokens, want_lps) = run(pipeline_parallel_size=2), run()
    assert tokens == want_tokens
    for got, want in zip(lps, want_lps):      # float32 in other processes: the same to rounding
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-4)
    assert lps[0] and lps[1]


def test_structured_outputs_across_stages(tiny_serving_model):
    """The scheduler's grammar bitmask reaches the last stage, which samples under it: a regex and a choice hold
    at PP = 2, with the same tokens as one stage."""
    from pagedserve.tests.helpers.grammar_rows import PROMPTS, checked_rows, grammar_params
    rows = {}
    for pp in (1, 2):
        with LLM(tiny_serving_model, dtype="float32", max_model_len=256, kv_cache_memory=0.02,
                 pipeline_parallel_size=pp) as llm:
            rows[pp] = checked_rows(llm.generate(PROMPTS, grammar_params(), use_tqdm=False))
    assert rows[2] == rows[1]
