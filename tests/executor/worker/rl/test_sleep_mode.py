"""Sleep mode (issue 30): level 1 releases the KV cache, level 2 the weights too, and the process's RSS drops by
at least what was released; wake_up brings the same answers back (level 2 after reload_weights); requests
held by the engine when it goes to sleep finish or are aborted, none is lost; new ones are refused."""
from __future__ import annotations

import os
import time

import pytest

from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.core.engine_core import EngineCore
from pagedserve.executor.procs.backends import get_executor_class
from pagedserve.frontend.offline.llm import LLM
from pagedserve.ipc.messages import EngineCoreRequest
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model, random_prompts

VOCAB = 16384
PROMPTS = random_prompts(3, [256] * 4, vocab=VOCAB)
# f32 KV per token: 2 layers x (K, V) x 4 heads x 64 dims x 4 bytes = 4 KiB; the prompts write 4 MiB of it.
KV_WRITTEN = 4 * 256 * 4096


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # 16 MiB embeddings (x2, untied): the weights' release is far above allocator noise.
    return make_tiny_model(str(tmp_path_factory.mktemp("sleep") / "m"), vocab_size=VOCAB, hidden_size=256,
                           num_attention_heads=4, num_key_value_heads=4, intermediate_size=512)


def greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_sleep_levels_release_memory_and_wake_to_the_same_answers(model_dir) -> None:
    weight_bytes = os.path.getsize(os.path.join(model_dir, "model.safetensors"))
    with LLM(model_dir, dtype="float32", enable_sleep_mode=True, kv_cache_memory=0.125) as llm:
        before = greedy(llm)
        start = rss()
        llm.sleep(level=1)
        assert llm.is_sleeping()
        assert start - rss() >= KV_WRITTEN // 2, "level 1 did not give the KV cache's pages back"
        with pytest.raises(ValueError, match="sleeping"):
            greedy(llm)
        llm.wake_up()
        assert not llm.is_sleeping() and greedy(llm) == before
        start = rss()
        llm.sleep(level=2)
        assert start - rss() >= 0.8 * weight_bytes, "level 2 did not give the weights' memory back"
        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping()                            # the KV cache still sleeps
        llm.wake_up(tags=["kv_cache"])
        llm.reload_weights()
        assert greedy(llm) == before


@pytest.mark.parametrize("abort", [False, True])
def test_sleep_finishes_or_aborts_held_requests(model_dir, abort: bool) -> None:
    args = EngineArgs(model=model_dir, dtype="float32", enable_sleep_mode=True, kv_cache_memory=0.125)
    core = EngineCore.from_engine_args(args, get_executor_class("uni"))
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS[:3]):
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params, time.time()))
        tokens: dict[str, list[int]] = {}
        finished: dict[str, str] = {}
        for out in core.step().outputs:                     # under way when the sleep comes
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        core.call_utility("sleep", [1, abort])
        assert not core.scheduler.has_unfinished_requests()
        with pytest.raises(ValueError, match="sleeping"):
            core.add_request(EngineCoreRequest("late", PROMPTS[3], params, time.time()))
        while core.has_unfinished_requests():               # the held outputs go out with the next step
            for out in core.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason:
                    finished[out.request_id] = out.finish_reason
        assert finished == {f"r{i}": "abort" if abort else "length" for i in range(3)}
        if not abort:
            assert all(len(t) == 5 for t in tokens.values())
    finally:
        core.shutdown()


def test_wait_policy_queues_requests_until_wake_up(model_dir) -> None:
    args = EngineArgs(model=model_dir, dtype="float32", enable_sleep_mode=True, kv_cache_memory=0.125,
                      requests_while_sleeping="wait")
    core = EngineCore.from_engine_args(args, get_executor_class("uni"))
    try:
        core.call_utility("sleep", [1])
        core.add_request(EngineCoreRequest("queued", PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0,
                                                                                ignore_eos=True), time.time()))
        assert not core.has_unfinished_requests() and core.step().outputs == []    # nothing runs asleep
        core.call_utility("wake_up", [None])
        tokens = []
        while core.has_unfinished_requests():
            tokens += [t for out in core.step().outputs for t in out.new_token_ids]
        assert len(tokens) == 3
    finally:
        core.shutdown()
