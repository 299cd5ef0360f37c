"""Async scheduling: step N+1 is scheduled before step N's sampled ids are back.

The engine core's bookkeeping runs against a fake executor whose outputs come back one step late
(placeholders, a stop found late, aborts and preemption with a step in flight); then the real engine on
the tiny Llama must give the same tokens with async scheduling on as off."""
from __future__ import annotations

import argparse
import random
from functools import partial

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.common.config.arg_utils import add_dataclass_args, dataclass_from
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.core.engine_core import EngineCore
from pagedserve.ipc.messages import EngineCoreRequest
from pagedserve.tests.helpers.fake_executor import EOS, FakeExecutor, expected_tokens

Finished = dict[str, tuple[list[int], str | None]]


def make_core(model_dir: str, async_on: bool, eos_at: dict[str, int] | None = None, **kw) -> EngineCore:
    settings = dict(dtype="float32", device="cpu", generation_config="vllm", block_size=4, max_model_len=64,
                    max_num_batched_tokens=32, num_gpu_blocks_override=64)
    settings.update(kw)
    args = EngineArgs(model=model_dir, async_scheduling=async_on, **settings)
    return EngineCore.from_engine_args(args, partial(FakeExecutor, eos_at=eos_at))


def add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    core.add_request(EngineCoreRequest(rid, prompt, params, arrival_time=0.0))


def collect(core: EngineCore, done: Finished, max_steps: int = 500) -> None:
    """Step until nothing is left, gathering each request's ids and finish reason."""
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return
        for out in core.step().outputs:
            tokens, _ = done.get(out.request_id, ([], None))
            if out.request_id in done and done[out.request_id][1] is not None:
                raise AssertionError(f"{out.request_id}: output after it finished: {out}")
            done[out.request_id] = (tokens + list(out.new_token_ids), out.finish_reason)
    raise AssertionError("requests did not finish")


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def assert_all_free(core: EngineCore) -> None:
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks
    assert not core.scheduler.requests and not core.scheduler.running and not core._in_flight


# ---------------------------------------------------------------- bookkeeping, fake executor

def test_placeholders_count_the_ids_in_flight(tiny_llama_dir):
    core = make_core(tiny_llama_dir, async_on=True)
    prompt = prompts(0, [10])[0]
    add(core, "a", prompt, max_tokens=5)
    request = core.scheduler.requests["a"]

    assert core.step().outputs == []                  # step 1 (the prefill) started, nothing back yet
    assert (request.num_output_placeholders, request.num_computed_tokens, request.num_tokens) == (1, 10, 10)

    outs = core.step().outputs                       # step 2 started on the id step 1 sampled; step 1 back
    assert [o.new_token_ids for o in outs] == [expected_tokens(prompt, 1)]
    assert (request.num_output_placeholders, request.num_computed_tokens, request.num_tokens) == (1, 11, 11)
    worker = core.executor.states["a"]
    assert len(worker.token_ids) == 12               # the worker already holds step 2's id
    assert core.executor.log == [("start", 1), ("start", 2), ("result", 1)]

    done: Finished = {"a": (outs[0].new_token_ids, None)}
    collect(core, done)
    assert done["a"] == (expected_tokens(prompt, 5), "length")
    # max_tokens is known ahead: no step is started for a token past it.
    assert core.executor.sampled["a"] == expected_tokens(prompt, 5)
    assert_all_free(core)


def test_steps_overlap_one_deep(tiny_llama_dir):
    core = make_core(tiny_llama_dir, async_on=True)
    for i, p in enumerate(prompts(1, [7, 20, 13])):
        add(core, f"r{i}", p, max_tokens=6)
    collect(core, {})
    log = core.executor.log
    for step in range(2, core.executor.num_steps + 1):
        # step k starts before step k-1's output is taken, and after step k-2's.
        assert log.index(("start", step)) < log.index(("result", step - 1))
        if step > 2:
            assert log.index(("result", step - 2)) < log.index(("start", step))


def test_late_stop_drops_the_extra_token(tiny_llama_dir):
    a, b = prompts(2, [9, 14])
    core = make_core(tiny_llama_dir, async_on=True, eos_at={"a": 2})
    add(core, "a", a, max_tokens=20)
    add(core, "b", b, max_tokens=8)
    done: Finished = {}
    collect(core, done)
    assert done["a"] == (expected_tokens(a, 20, eos_at=2), "stop")
    assert done["a"][0][-1] == EOS and len(done["a"][0]) == 3
    assert done["b"] == (expected_tokens(b, 8), "length")
    # The step started before EOS was seen sampled a 4th id for "a": the core never reported it, the
    # worker was told to drop the request, and its blocks went back to the pool.
    assert len(core.executor.sampled["a"]) == 4
    assert "a" in core.executor.dropped
    assert_all_free(core)


@pytest.mark.parametrize("async_on", [False, True])
def test_same_tokens_as_sync_across_preemption(tiny_llama_dir, async_on):
    lengths = [10, 23, 7, 31, 15, 12]
    max_tokens = [20, 9, 25, 14, 30, 11]
    eos_at = {"r2": 6, "r4": 17}
    # 16 blocks of 4 tokens: one max_model_len request fits, six growing ones do not.
    core = make_core(tiny_llama_dir, async_on=async_on, eos_at=eos_at, num_gpu_blocks_override=16)
    ps = prompts(3, lengths)
    for i, (p, m) in enumerate(zip(ps, max_tokens)):
        add(core, f"r{i}", p, m)
    done: Finished = {}
    collect(core, done)
    for i, (p, m) in enumerate(zip(ps, max_tokens)):
        want = expected_tokens(p, m, eos_at.get(f"r{i}"))
        assert done[f"r{i}"] == (want, "stop" if want[-1] == EOS else "length"), f"r{i}"
    assert core.scheduler.num_preemptions > 0
    assert_all_free(core)


def test_preempted_request_stopped_by_its_id_in_flight(tiny_llama_dir):
    # 16 blocks: a (32 tokens, 8 blocks) and b (28, 7) prefill together; step 2 needs one more block each,
    # so b is preempted while step 1's id for it is in flight, and that id (EOS) ends it in the queue.
    a, b = prompts(6, [32, 28])
    core = make_core(tiny_llama_dir, async_on=True, eos_at={"b": 0}, num_gpu_blocks_override=16,
                     max_num_batched_tokens=64, enable_prefix_caching=False)
    add(core, "a", a, max_tokens=10)
    add(core, "b", b, max_tokens=10)
    core.step()
    outs = {o.request_id: o for o in core.step().outputs}
    assert core.scheduler.num_preemptions == 1
    assert (outs["b"].new_token_ids, outs["b"].finish_reason) == ([EOS], "stop")
    assert "b" not in core.scheduler.requests and not len(core.scheduler.waiting)
    done: Finished = {"a": (outs["a"].new_token_ids, None)}
    collect(core, done)
    assert done["a"] == (expected_tokens(a, 10), "length")
    assert_all_free(core)


def test_abort_with_a_step_in_flight(tiny_llama_dir):
    a, b = prompts(4, [12, 8])
    core = make_core(tiny_llama_dir, async_on=True)
    add(core, "a", a, max_tokens=30)
    add(core, "b", b, max_tokens=10)
    done: Finished = {}
    for _ in range(4):
        for out in core.step().outputs:
            done[out.request_id] = (done.get(out.request_id, ([], None))[0] + out.new_token_ids, None)
    assert core._in_flight is not None and "a" in core._in_flight[0].num_scheduled_tokens
    seen = len(done["a"][0])
    aborted = core.abort_requests(["a"])
    assert [(o.request_id, o.finish_reason) for o in aborted] == [("a", "abort")]
    done["a"] = (done["a"][0], "abort")
    # The id is free again at once: the in-flight step's output for the old "a" must not reach the new one.
    a2 = prompts(5, [6])[0]
    add(core, "a", a2, max_tokens=4)
    done_after: Finished = {}
    collect(core, done_after)
    assert done["a"][0] == expected_tokens(a, seen)
    assert done_after["a"] == (expected_tokens(a2, 4), "length")
    assert done["b"][0] + done_after["b"][0] == expected_tokens(b, 10)
    assert done_after["b"][1] == "length"
    assert_all_free(core)


def test_async_scheduling_flag():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineArgs)
    assert dataclass_from(parser.parse_args(["--async-scheduling"]), EngineArgs).async_scheduling is True
    assert dataclass_from(parser.parse_args([]), EngineArgs).async_scheduling is False     # off by default


# ---------------------------------------------------------------- end to end, tiny Llama

E2E_LENGTHS = [10, 300, 25, 47, 180, 80, 120, 15]
E2E_CONFIGS = {
    "default": dict(),
    "preempt": dict(num_gpu_blocks_override=32, max_model_len=512, max_num_batched_tokens=128),
}


def e2e_params(stops: dict[int, int] | None = None, stop_str: str | None = None) -> list[SamplingParams]:
    """Greedy and seeded rows side by side, max_tokens varying, penalties on row 3, logprobs on rows 4 and
    5, prompt logprobs on row 6; stops: row -> a stop token id; stop_str: a stop string for row 7."""
    stops = stops or {}
    params = []
    for i in range(len(E2E_LENGTHS)):
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, top_p=0.95, seed=100 + i)
        extra = {3: dict(repetition_penalty=1.3, frequency_penalty=0.5), 4: dict(logprobs=3),
                 5: dict(logprobs=2), 6: dict(prompt_logprobs=2), 7: dict(stop=[stop_str] if stop_str else None)}
        params.append(SamplingParams(max_tokens=12 + 3 * i, stop_token_ids=[stops[i]] if i in stops else None,
                                     **sampling, **extra.get(i, {})))
    return params


def generate(path: str, prompts_: list[list[int]], params: list[SamplingParams], **engine) -> tuple[LLM, list]:
    llm = LLM(path, dtype="float32", **engine)
    outs = llm.generate(prompts_, params, use_tqdm=False)
    assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_blocks
    return llm, [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], outs


def logprob_steps(out) -> list[dict[int, float]]:
    """Per sampled position, then per prompt position: token id -> logprob."""
    steps = list(out.outputs[0].logprobs or []) + [p for p in out.prompt_logprobs or [] if p]
    return [{t: lp.logprob for t, lp in step.items()} for step in steps]


def assert_logprobs_close(got: list[dict[int, float]], want: list[dict[int, float]], row: int) -> None:
    assert len(got) == len(want), f"row {row}"
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), f"row {row}"
        assert list(g.values()) == pytest.approx(list(w.values()), rel=1e-4, abs=1e-5), f"row {row}"


@pytest.mark.parametrize("name", list(E2E_CONFIGS))
def test_async_equals_sync_on_tiny_llama(tiny_llama_dir, name):
    from pagedserve.tests.helpers.models.tiny_models import random_prompts
    prompts_ = random_prompts(11, E2E_LENGTHS, 512)
    _, sync, sync_outs = generate(tiny_llama_dir, prompts_, e2e_params(), **E2E_CONFIGS[name])
    # Stops on three rows, each at an id the row samples mid-way: found a step late under async scheduling;
    # and a stop string on row 7, which the frontend finds and aborts the request for.
    stops = {i: sync[i][0][4 + i] for i in (1, 2, 5)}
    text7 = sync_outs[7].outputs[0].text
    stop_str = text7[len(text7) // 2:len(text7) // 2 + 3]
    llm, out, outs = generate(tiny_llama_dir, prompts_, e2e_params(stops, stop_str), async_scheduling=True,
                              **E2E_CONFIGS[name])
    for i, (tokens, reason) in enumerate(sync):
        if i in stops:
            end = tokens.index(stops[i]) + 1
            tokens, reason = tokens[:end], "stop"
        if i == 7:
            assert outs[i].outputs[0].text == text7[:text7.index(stop_str)]
            assert out[i][1] == "stop" and out[i][0] == tokens[:len(out[i][0])]
            continue
        assert out[i] == (tokens, reason), f"row {i} ({len(prompts_[i])} prompt tokens) diverged"
        want = logprob_steps(sync_outs[i])
        if i == 5:                       # stopped early: the steps both made
            want = want[:len(tokens)]
        assert_logprobs_close(logprob_steps(outs[i]), want, i)
    assert any(reason == "length" for _, reason in out)
    assert logprob_steps(outs[4]) and logprob_steps(outs[5]) and logprob_steps(outs[6])
    if name == "preempt":
        assert llm.engine.scheduler.num_preemptions > 0


def test_structured_outputs_under_async_scheduling(tiny_serving_model):
    """A grammar must see step N's token before step N+1's bitmask: the core takes each output first, and
    the constrained and free rows still equal synchronous scheduling."""
    from pagedserve.tests.helpers.grammar_rows import PROMPTS, checked_rows, grammar_params
    rows = {}
    for async_on in (False, True):
        with LLM(tiny_serving_model, dtype="float32", max_model_len=256, kv_cache_memory=0.02,
                 async_scheduling=async_on) as llm:
            rows[async_on] = checked_rows(llm.generate(PROMPTS, grammar_params(), use_tqdm=False))
    assert rows[True] == rows[False]


def test_async_scheduling_in_the_core_process(tiny_llama_dir):
    """The engine-core process's busy loop drives async steps too (the server's path)."""
    from pagedserve.tests.helpers.models.tiny_models import random_prompts
    prompts_ = random_prompts(12, [9, 40, 17], 512)
    params = [SamplingParams(temperature=0.0, max_tokens=10), SamplingParams(temperature=0.8, seed=3, max_tokens=7),
              SamplingParams(temperature=0.0, max_tokens=1)]
    _, sync, _ = generate(tiny_llama_dir, prompts_, params)
    with LLM(tiny_llama_dir, dtype="float32", multiprocess_core=True, async_scheduling=True) as llm:
        outs = llm.generate(prompts_, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs] == sync


def test_async_scheduling_with_worker_processes(tiny_llama_dir):
    """The mp executor starts a step on its ranks and reads the output later (two stages)."""
    from pagedserve.tests.helpers.models.tiny_models import random_prompts
    prompts_ = random_prompts(13, [9, 40, 17, 5], 512)
    params = [SamplingParams(temperature=0.0, max_tokens=9), SamplingParams(temperature=0.8, seed=4, max_tokens=12)] * 2
    _, sync, _ = generate(tiny_llama_dir, prompts_, params)
    llm, out, _ = generate(tiny_llama_dir, prompts_, params, distributed_executor_backend="mp", async_scheduling=True)
    llm.shutdown()
    assert out == sync
