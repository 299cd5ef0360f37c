"""--batch-invariant / --no-batch-invariant (EngineArgs.batch_invariant, issue 50): the flag parses with
VLLM_BATCH_INVARIANT as its default, `LLM(batch_invariant=True)` takes it, it reaches a worker process through the
config (not the environment: a worker whose environment says otherwise still follows it), and it changes what
the worker runs (the per-token attention backend and the fixed-row linears) and what a float model answers: with
it a prompt's greedy answer is the same bits at chunk 32 as at 2048, without it it is not."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.frontend.cli import parse_args
from pagedserve.tests.helpers.kernels.cpu_kernels import c_step_runs
from pagedserve.tests.helpers.models.tiny_models import random_prompts

PROBE = "pagedserve.tests.helpers.rl.rl_extension.PathProbe"


def test_flag_parses_with_the_env_as_default(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert parse_args([])[0].batch_invariant is False
    assert parse_args(["--batch-invariant"])[0].batch_invariant is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert parse_args([])[0].batch_invariant is True
    assert EngineArgs().batch_invariant is True
    assert parse_args(["--no-batch-invariant"])[0].batch_invariant is False


@pytest.mark.parametrize("asked,backend", [(True, "mp"), (False, "uni")])
def test_flag_reaches_the_worker(tiny_llama_dir, monkeypatch, asked, backend):
    """mp: a worker process of its own, which gets the config as JSON. The environment says the opposite: the
    worker inherits it, and must follow the config instead."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0" if asked else "1")
    with LLM(tiny_llama_dir, dtype="float32", batch_invariant=asked, distributed_executor_backend=backend,
             max_model_len=256, worker_extension_cls=PROBE) as llm:
        (path,) = llm.collective_rpc("batch_invariant_path")
    assert path == ({"attention": "CPU_BATCH_INVARIANT", "linear": "fixed_rows", "config": True} if asked
                    else {"attention": "CPU", "linear": "unquantized", "config": False})


def _answers(model: str, chunk: int, prompts: list[list[int]], asked: bool) -> list[tuple]:
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
    with LLM(model, dtype="float32", batch_invariant=asked, max_num_batched_tokens=chunk, max_model_len=512) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids),
             tuple(tuple(sorted((i, lp.logprob) for i, lp in step.items())) for step in o.outputs[0].logprobs))
            for o in outs]


@pytest.mark.skipif(not c_step_runs(), reason="the per-token attention is the C decode kernel")
def test_flag_changes_a_float_models_answers(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    prompts = random_prompts(11, [200, 150, 97], 512)
    on = [_answers(tiny_llama_dir, chunk, prompts, True) for chunk in (32, 2048)]
    assert on[0] == on[1], "--batch-invariant: chunk 32 and 2048 must give the same bits"
    off = [_answers(tiny_llama_dir, chunk, prompts, False) for chunk in (32, 2048)]
    assert off[0] != off[1], "without it the float path's rounding depends on the chunk (else this proves nothing)"
